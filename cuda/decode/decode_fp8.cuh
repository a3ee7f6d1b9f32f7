// The FP8 (e4m3) KV cache of the decoding kernel: tile loads of e4m3 rows
// and their per-key descales, and the conversion to fp16 for the products.
//
// Each ring stage holds K8 and V8 [kBlockN][head_dim] bytes (row-major: only
// the thread that loaded a chunk reads it back) and the tile's K and V
// descales [kBlockN] floats. Each thread converts the chunks it loaded itself
// (its own cp.async groups are the ones it waited for) into one fp16 K and V
// tile in the swizzled layout of the 16-bit path, and the products run in
// fp16 (u = kFp8Unscale: 1 with the hardware conversion, 2^8 without):
//   S   = (q * scale)_fp16 . k16 * (u * k_descale[key])
//   P'  = P * v_descale[key]          (fp16; the row sum l is of P)
//   O   = u * sum P' v16 / l
// Q is converted once per CTA (times the softmax scale, so the scores need
// no further scale and fp16's range holds them).
#pragma once

#include "decode/decode_params.h"
#include "sm80/smem_layout.cuh"

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

// Sixteen e4m3 values -> sixteen fp16 (two 16-byte chunks).
JF_DEVICE void e4m3x16_to_half(const uint4& w, uint4& lo, uint4& hi) {
  lo = make_uint4(e4m3x2_to_half2(w.x), e4m3x2_to_half2(w.x >> 16), e4m3x2_to_half2(w.y),
                  e4m3x2_to_half2(w.y >> 16));
  hi = make_uint4(e4m3x2_to_half2(w.z), e4m3x2_to_half2(w.z >> 16), e4m3x2_to_half2(w.w),
                  e4m3x2_to_half2(w.w >> 16));
}

template <typename Cfg>
struct Fp8Stage {
  static constexpr int kTileBytes = Cfg::kBlockN * Cfg::kHeadDim;
  static constexpr int kK = 0, kV = kTileBytes, kKScale = 2 * kTileBytes,
                       kVScale = kKScale + Cfg::kBlockN * 4;
  static constexpr int kChunks = Cfg::kHeadDim / 16;  // 16 e4m3 per 16-byte chunk
  static constexpr int kPerThread = Cfg::kBlockN * kChunks / Cfg::kThreads;
  static_assert(Cfg::kBlockN * kChunks % Cfg::kThreads == 0, "whole passes");
  static_assert(kVScale + Cfg::kBlockN * 4 == decode_stage_bytes(Cfg::kHeadDim, true), "stage size");
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
  const int ps = p.page_size;
  const int page0 = n0 / ps;
  const bool one_page = (n0 + Cfg::kBlockN - 1) / ps == page0;
  const int64_t tile_base = one_page ? page_base(p, table, page0) + int64_t(n0 - page0 * ps) * p.kv_row_stride : 0;
  const int64_t head = int64_t(d.hk) * p.kv_head_stride;
#pragma unroll
  for (int i = 0; i < St::kPerThread; ++i) {
    const int idx = tid + i * Cfg::kThreads;
    const int r = idx / St::kChunks, c = (idx % St::kChunks) * 16;
    const int j = n0 + r;
    const bool ok = j < d.seqlen_k && c < p.head_dim;
    int64_t off = 0;
    if (ok) {
      off = one_page ? tile_base + int64_t(r) * p.kv_row_stride
                     : page_base(p, table, j / ps) + int64_t(j % ps) * p.kv_row_stride;
      off += head + c;
    }
    const uint32_t so = uint32_t(r * Cfg::kHeadDim + c);
    sm80::cp_async_16(stage + St::kK + so, k + off, ok);
    sm80::cp_async_16(stage + St::kV + so, v + off, ok);
  }
  // Descales: threads [0, 16) the K ones, [16, 32) the V ones, four keys each.
  if (tid < 2 * Cfg::kBlockN / 4) {
    const bool is_v = tid >= Cfg::kBlockN / 4;
    const int r = (tid % (Cfg::kBlockN / 4)) * 4, j = n0 + r;
    const bool ok = j < d.seqlen_k;
    const float* src = is_v ? p.v_descale : p.k_descale;
    const float* at = src;
    if (ok) {
      const int id = min(max(__ldg(table + j / ps), 0), p.num_pages - 1);
      at = src + (int64_t(id) * p.num_heads_k + d.hk) * ps + j % ps;
    }
    sm80::cp_async_16(stage + (is_v ? St::kVScale : St::kKScale) + uint32_t(r * 4), at, ok);
  }
}

// This thread's chunks of the stage (those it loaded) -> the fp16 K and V
// tiles (swizzled like the 16-bit path's).
template <typename Cfg>
JF_DEVICE void convert_kv_tile(const char* stage, char* k16, char* v16, int tid) {
  using St = Fp8Stage<Cfg>;
  using KTile = typename Cfg::KTile;
#pragma unroll
  for (int i = 0; i < St::kPerThread; ++i) {
    const int idx = tid + i * Cfg::kThreads;
    const int r = idx / St::kChunks, c = (idx % St::kChunks) * 16;
    const int so = r * Cfg::kHeadDim + c;
    uint4 lo, hi;
    e4m3x16_to_half(*reinterpret_cast<const uint4*>(stage + St::kK + so), lo, hi);
    *reinterpret_cast<uint4*>(k16 + KTile::offset(r, c)) = lo;
    *reinterpret_cast<uint4*>(k16 + KTile::offset(r, c + 8)) = hi;
    e4m3x16_to_half(*reinterpret_cast<const uint4*>(stage + St::kV + so), lo, hi);
    *reinterpret_cast<uint4*>(v16 + KTile::offset(r, c)) = lo;
    *reinterpret_cast<uint4*>(v16 + KTile::offset(r, c + 8)) = hi;
  }
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

// The Q tile in place: Element -> fp16 times the softmax scale, the chunks
// this thread loaded (load_q_tile's walk).
template <typename Element, typename Cfg>
JF_DEVICE void convert_q_tile(char* sq, float scale, int tid) {
  constexpr int kChunks = Cfg::kHeadDim / 8;
  for (int idx = tid; idx < Cfg::kRows * kChunks; idx += Cfg::kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    uint4* at = reinterpret_cast<uint4*>(sq + Cfg::QTile::offset(r, c));
    uint4 w = *at;
    uint32_t* x = &w.x;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      x[e] = Pack<__half>::pack(lo_to_float(x[e], Element()) * scale, hi_to_float(x[e], Element()) * scale);
    *at = w;
  }
}

}  // namespace jax_flash::decode
