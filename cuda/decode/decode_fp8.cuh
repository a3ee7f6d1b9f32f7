// The FP8 (e4m3) KV cache of the decoding kernel: tile loads of e4m3 rows
// and their per-key descales, and the two products fed from e4m3 in shared
// memory, converted to fp16 in registers.
//
// Each ring stage holds K8 and V8 [kBlockN][head_dim] bytes, stored as tiles
// of 16-bit pairs (SmemTile<kBlockN, head_dim / 2>, swizzled like the 16-bit
// path's), and the tile's K and V descales [kBlockN] floats. ldmatrix moves
// pairs of e4m3 as if they were 16-bit values; each lane then converts its
// four bytes to two fp16x2 (cvt.rn.f16x2.e4m3x2 on sm89+):
//   S = Q K^T: a non-transposed ldmatrix gives lane (g, t) the e4m3 of key g
//     at head-dim columns 4t..4t+3 of each 16, where the mma wants 2t, 2t+1
//     and 2t+8, 2t+9: the head dim is permuted within each 16 (fp8_q_column),
//     which leaves q.k unchanged when Q is permuted the same way; Q is
//     converted once per CTA to fp16 (times the softmax scale) in that order.
//   O = P V: a transposed ldmatrix gives the lane keys 2t, 2t+1 at two
//     adjacent columns 2g, 2g+1; a byte permute regroups them by column, so
//     one load feeds the even and the odd columns of a 16-column block as two
//     n-tiles; the output's columns are mapped back when O is written
//     (fp8_o_column).
// With per-key descales, u = kFp8Unscale (1 with the hardware conversion,
// 2^8 with the bit move):
//   S  = (q * scale)_fp16 . k16 * (u * k_descale[key])
//   P' = P * v_descale[key]          (fp16; the row sum l is of P)
//   O  = u * sum P' v16 / l
#pragma once

#include "decode/decode_params.h"
#include "sm80/smem_layout.cuh"
#include "sm80/warp_gemm.cuh"

namespace jax_flash::decode {

// e4m3 -> fp16. sm89+: the hardware conversion (cvt.rn.f16x2.e4m3x2), exact.
// Elsewhere (sm80, the host emulator) a bit move: each byte to the top of a
// 16-bit half, the sign stays at bit 15 and the 7 magnitude bits move to
// bits [7, 14): e4m3's exponent bias, 7, is fp16's 15 minus 8, so this gives
// 2^-8 times the value, exact, subnormals included (e4m3's NaN, which the
// quantiser never writes, is not kept). kFp8Unscale undoes the factor.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define JF_FP8_HW_CVT 1
constexpr float kFp8Unscale = 1.f;
#else
constexpr float kFp8Unscale = 256.f;
#endif

// Two e4m3 values (the low 16 bits of x) as fp16x2 (times 1 / kFp8Unscale).
JF_DEVICE uint32_t e4m3x2_to_half2(uint32_t x) {
#ifdef JF_FP8_HW_CVT
  uint32_t d;
  const uint16_t lo = uint16_t(x & 0xFFFFu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(lo));
  return d;
#else
  const uint32_t a = ((x & 0xFFu) << 8) | ((x & 0xFF00u) << 16);
  return (a & 0x80008000u) | ((a >> 1) & 0x3F803F80u);
#endif
}

// Four e4m3 values: bytes 0, 1 -> lo, bytes 2, 3 -> hi. sm89+: the high
// half goes to the conversion as a register half (F2FP reads R.H1), not
// shifted down first: one instruction per pair instead of two.
JF_DEVICE void e4m3x4_to_half2x2(uint32_t x, uint32_t& lo, uint32_t& hi) {
#ifdef JF_FP8_HW_CVT
  asm("{\n"
      " .reg .b16 l, h;\n"
      " mov.b32 {l, h}, %2;\n"
      " cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n"
      "}"
      : "=r"(lo), "=r"(hi)
      : "r"(x));
#else
  lo = e4m3x2_to_half2(x);
  hi = e4m3x2_to_half2(x >> 16);
#endif
}

template <typename Cfg>
struct Fp8Stage {
  using Tile8 = SmemTile<Cfg::kBlockN, Cfg::kHeadDim / 2>;  // e4m3 pairs as 16-bit
  static constexpr int kTileBytes = Cfg::kBlockN * Cfg::kHeadDim;
  static_assert(Tile8::kBytes == kTileBytes, "e4m3 tile size");
  static constexpr int kK = 0, kV = kTileBytes, kKScale = 2 * kTileBytes,
                       kVScale = kKScale + Cfg::kBlockN * 4;
  static constexpr int kChunks = Cfg::kHeadDim / 16;  // 16 e4m3 per 16-byte chunk
  static constexpr int kPerThread = Cfg::kBlockN * kChunks / Cfg::kThreads;
  static_assert(Cfg::kBlockN * kChunks % Cfg::kThreads == 0, "whole passes");
  static_assert(kVScale + Cfg::kBlockN * 4 == decode_stage_bytes(Cfg::kHeadDim, Cfg::kBlockN, true),
                "stage size");
};

// Rows n0 .. n0 + kBlockN - 1 of K8, V8 and their descales into one stage.
// Keys past seqlen_k and columns past head_dim are zero-filled; descales are
// loaded in groups of four keys (page_size % 4 == 0), so those of keys past
// seqlen_k may be anything: the kernel masks those keys and ignores their V
// descale.
template <typename Cfg>
JF_DEVICE void load_kv_tile_fp8(uint32_t stage, const DecodeParams& p, const DecodeBlock& d, int n0,
                                int tid) {
  using St = Fp8Stage<Cfg>;
  const uint8_t* k = static_cast<const uint8_t*>(p.k);
  const uint8_t* v = static_cast<const uint8_t*>(p.v);
  const int32_t* table = p.page_table + int64_t(d.b) * p.max_pages;
  // Keys and page sizes are non-negative: unsigned division is the shorter.
  const unsigned ps = unsigned(p.page_size);
  const int page0 = int(unsigned(n0) / ps);
  const int in_page0 = n0 - page0 * int(ps);
  // Block-uniform: the whole tile in one page (a contiguous cache, or pages
  // of a multiple of the tile) takes one table lookup, for rows and descales.
  const bool one_page = in_page0 + Cfg::kBlockN <= int(ps);
  const int pid0 = one_page ? page_id(p, table, page0) : 0;
  // A thread copies one 16-byte column c of rows r0 + i * kRowsPerPass: whole
  // swizzle periods apart, so its shared-memory offsets are one base plus
  // immediates (fewer live registers across the main loop).
  constexpr int kRowsPerPass = Cfg::kThreads / St::kChunks;
  static_assert(kRowsPerPass * St::Tile8::kRowBytes % 1024 == 0, "passes keep the swizzle phase");
  const int r0 = tid / St::kChunks, c = (tid % St::kChunks) * 16;
  const uint32_t so0 = St::Tile8::offset(r0, c / 2);
  const bool col_ok = c < p.head_dim;
  const int64_t head = int64_t(d.hk) * p.kv_head_stride + c;
  // Block-uniform branch: one page, the rows' offsets are one base plus a
  // step per pass (no per-row lookup on the common path).
  if (one_page) {
    const int64_t step = int64_t(kRowsPerPass) * p.kv_row_stride;
    int64_t row_off = int64_t(pid0) * p.kv_page_stride + int64_t(in_page0 + r0) * p.kv_row_stride + head;
#pragma unroll
    for (int i = 0; i < St::kPerThread; ++i) {
      const bool ok = col_ok && n0 + r0 + i * kRowsPerPass < d.blk.seqlen_k;
      const int64_t off = ok ? row_off : 0;
      row_off += step;
      const uint32_t so = so0 + uint32_t(i * kRowsPerPass * St::Tile8::kRowBytes);
      sm80::cp_async_16(stage + St::kK + so, k + off, ok);
      sm80::cp_async_16(stage + St::kV + so, v + off, ok);
    }
  } else {
#pragma unroll
    for (int i = 0; i < St::kPerThread; ++i) {
      const unsigned j = unsigned(n0 + r0 + i * kRowsPerPass);
      const bool ok = col_ok && int(j) < d.blk.seqlen_k;
      int64_t off = 0;
      if (ok) off = page_base(p, table, int(j / ps)) + int64_t(j % ps) * p.kv_row_stride + head;
      const uint32_t so = so0 + uint32_t(i * kRowsPerPass * St::Tile8::kRowBytes);
      sm80::cp_async_16(stage + St::kK + so, k + off, ok);
      sm80::cp_async_16(stage + St::kV + so, v + off, ok);
    }
  }
  // Descales: threads [0, kBlockN / 4) the K ones, the next kBlockN / 4 the V
  // ones, four keys each.
  if (tid < 2 * Cfg::kBlockN / 4) {
    const bool is_v = tid >= Cfg::kBlockN / 4;
    const int r = (tid % (Cfg::kBlockN / 4)) * 4, j = n0 + r;
    const bool ok = j < d.blk.seqlen_k;
    const float* src = is_v ? p.v_descale : p.k_descale;
    const float* at = src;
    if (ok) {
      const int pid = one_page ? pid0 : page_id(p, table, int(unsigned(j) / ps));
      const int slot = one_page ? in_page0 + r : int(unsigned(j) % ps);
      at = src + (int64_t(pid) * p.num_heads_k + d.hk) * int(ps) + slot;
    }
    sm80::cp_async_16(stage + (is_v ? St::kVScale : St::kKScale) + uint32_t(r * 4), at, ok);
  }
}

// Head-dim column of Q / K read by mma k index `l` within a block of 16
// (see the header): logical 2t, 2t+1, 2t+8, 2t+9 are physical 4t .. 4t+3.
JF_DEVICE constexpr int fp8_q_column(int l) { return 4 * ((l % 8) / 2) + 2 * (l / 8) + l % 2; }

// Output column of accumulator column `c` of n-tile `n` (gemm_pv_fp8): each
// 32 columns are four n-tiles: even, odd columns of the first 16, then of
// the second 16.
JF_DEVICE constexpr int fp8_o_column(int n, int c) {
  return (n / 4) * 32 + ((n % 4) / 2) * 16 + 2 * c + n % 2;
}

JF_DEVICE float lo_to_float(uint32_t x, __nv_bfloat16) { return __uint_as_float(x << 16); }
JF_DEVICE float hi_to_float(uint32_t x, __nv_bfloat16) { return __uint_as_float(x & 0xFFFF0000u); }
JF_DEVICE float lo_to_float(uint32_t x, __half) {
  __half h;
  const uint16_t b = uint16_t(x & 0xFFFFu);
  memcpy(&h, &b, 2);
  return __half2float(h);
}
JF_DEVICE float hi_to_float(uint32_t x, __half h) { return lo_to_float(x >> 16, h); }

// The Q tile (Element, as loaded) -> fp16 times the softmax scale into q16,
// its head dim permuted by fp8_q_column. Reads chunks other threads loaded:
// call between two barriers.
template <typename Element, typename Cfg>
JF_DEVICE void convert_q_tile(const char* sq, char* q16, float scale, int tid) {
  using QTile = typename Cfg::QTile;
  constexpr int kPairs = Cfg::kHeadDim / 2;
  for (int idx = tid; idx < Cfg::kRows * kPairs; idx += Cfg::kThreads) {
    const int r = idx / kPairs, c = (idx % kPairs) * 2;  // logical columns c, c + 1
    const int base = (c / 16) * 16;
    auto at = [&](int col) {
      const uint16_t* row = reinterpret_cast<const uint16_t*>(sq + QTile::offset(r, col & ~1));
      const uint32_t two = *reinterpret_cast<const uint32_t*>(row);
      return (col & 1) ? hi_to_float(two, Element()) : lo_to_float(two, Element());
    };
    const float x0 = at(base + fp8_q_column(c % 16)), x1 = at(base + fp8_q_column(c % 16 + 1));
    *reinterpret_cast<uint32_t*>(q16 + QTile::offset(r, c)) = Pack<__half>::pack(x0 * scale, x1 * scale);
  }
}

// Bytes a and b of x as the low 16 bits.
JF_DEVICE uint32_t pick_bytes(uint32_t x, int a, int b) {
  return ((x >> (8 * a)) & 0xFFu) | (((x >> (8 * b)) & 0xFFu) << 8);
}
// Bytes (0, 2) low, (1, 3) high: one byte permute (the shift-and-mask form
// compiles to several).
JF_DEVICE uint32_t even_odd_bytes(uint32_t x) {
#ifdef JAX_FLASH_HOST_EMULATION
  return pick_bytes(x, 0, 2) | (pick_bytes(x, 1, 3) << 16);
#else
  return __byte_perm(x, 0u, 0x3120u);
#endif
}

// acc[kMT][kNS][4] += Q K^T for the warp's 16 or 32 keys (rows kw .. of the
// e4m3 K tile), Q fp16 with its head dim permuted (convert_q_tile). Each Q
// fragment feeds every 16-key group of the slice.
template <typename Cfg, int kMT>
JF_DEVICE void gemm_qk_fp8(float (&acc)[kMT][Cfg::kNS][4], uint32_t q16, uint32_t k8, int kw, LdsmLane l) {
  using QTile = typename Cfg::QTile;
  using Tile8 = typename Fp8Stage<Cfg>::Tile8;
  const auto fa = sm80::addr_a<QTile>(q16, 0, l);
  const auto fb = sm80::addr_b_nk<Tile8>(k8, kw, l);
#pragma unroll
  for (int ks = 0; ks < Cfg::kHeadDim / 32; ++ks) {  // 32 e4m3 = 16 pairs per load
    uint32_t b[Cfg::kKS][4];  // per 16 keys: b[0], b[1]: keys 0-7; b[2], b[3]: keys 8-15
#pragma unroll
    for (int kg = 0; kg < Cfg::kKS; ++kg) sm80::ldmatrix_x4(b[kg], fb.at(kg * 16, ks * 16));
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the two 16-column halves
      uint32_t a[kMT][4];
#pragma unroll
      for (int m = 0; m < kMT; ++m) sm80::ldmatrix_x4(a[m], fa.at(m * 16, ks * 32 + h * 16));
#pragma unroll
      for (int kg = 0; kg < Cfg::kKS; ++kg)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          uint32_t b0, b1;
          e4m3x4_to_half2x2(b[kg][2 * nt + h], b0, b1);
#pragma unroll
          for (int m = 0; m < kMT; ++m) sm80::Mma<__half>::run(acc[m][2 * kg + nt], a[m], b0, b1);
        }
    }
  }
}

// acc[kMT][kHeadDim / 8][4] += P V for the warp's 16 or 32 keys, P fp16
// fragments (one k-step of 16 keys each), V the e4m3 tile (its rows kw ..);
// accumulator columns in fp8_o_column order.
template <typename Cfg, int kMT>
JF_DEVICE void gemm_pv_fp8(float (&acc)[kMT][Cfg::kNT_O][4], const uint32_t (&p)[kMT][Cfg::kKS][4],
                           uint32_t v8, int kw, LdsmLane l) {
  using Tile8 = typename Fp8Stage<Cfg>::Tile8;
  // 16 rows = whole swizzle periods: the warp's slice is a tile of its own.
  const auto fb = sm80::addr_b_kn<Tile8, true>(v8 + uint32_t(kw * Tile8::kRowBytes), 0, l);
#pragma unroll
  for (int ks = 0; ks < Cfg::kKS; ++ks)
#pragma unroll
    for (int cb = 0; cb < Cfg::kHeadDim / 32; ++cb) {
      uint32_t r[4];  // (keys 0-7 | 8-15) x (columns 0-15 | 16-31) of the block, as pairs
      sm80::ldmatrix_x4_trans(r, fb.at(ks * 16, cb * 16));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t b[2][2];  // [even, odd columns][keys 0-7, 8-15]
        e4m3x4_to_half2x2(even_odd_bytes(r[2 * h]), b[0][0], b[1][0]);
        e4m3x4_to_half2x2(even_odd_bytes(r[2 * h + 1]), b[0][1], b[1][1]);
#pragma unroll
        for (int par = 0; par < 2; ++par)
#pragma unroll
          for (int m = 0; m < kMT; ++m)
            sm80::Mma<__half>::run(acc[m][cb * 4 + 2 * h + par], p[m][ks], b[par][0], b[par][1]);
      }
    }
}

}  // namespace jax_flash::decode
