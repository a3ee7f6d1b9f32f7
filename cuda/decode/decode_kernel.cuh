// Split-KV decoding kernel (sm80 instructions; runs on sm80..sm90).
//
// CTA = (16 or 32 packed query rows, one sequence's KV head, one split of its
// keys).
// Pack-GQA: the rows are (token, query head) pairs of the heads that share the
// KV head, so every key is read once per KV head, not once per query head.
// The keys are the memory-bound part: they stream through a kStages-deep
// cp.async ring of 64-key K and V tiles (paged: each row's page looked up in
// the page table, one lookup per tile when the tile lies in one page), and the
// four warps split each tile 16 keys apiece, each with its own online softmax
// over all the rows:
//
//   wait tile i ------------------------------ barrier (stage of i-1 free)
//   issue cp.async tile i + kStages - 1        (into the stage of i-1)
//   S_w = Q K_w^T, softcap, mask at the edges  (registers, rows x 16 per warp)
//   online softmax; O_w += P_w V_w
//
// At the end the four warps' (max, sum, O) are merged through shared memory
// (the K/V ring is free by then) and the CTA writes either the output (one
// split) or its split's normalised fp32 partial and LSE for the combine
// kernel (decode_combine.cuh).
#pragma once

#include "decode/decode_params.h"
#include "jax_flash/block_info.h"  // min64, max64
#include "sm80/smem_layout.cuh"
#include "sm80/softmax.cuh"
#include "sm80/warp_gemm.cuh"

namespace jax_flash::decode {

// exp2_approx: jax_flash/fast_math.cuh on a GPU, sm80 emulation otherwise.
using namespace sm80;  // NOLINT: the sm80 primitives are this kernel's vocabulary

template <int kHeadDim_, int kMT_>
struct DecodeConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMT = kMT_;  // m-tiles (16 rows) per warp
  static constexpr int kRows = kMT * kDecodeMTileRows;
  static constexpr int kBlockN = kDecodeBlockN;
  static constexpr int kWarps = kDecodeWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKeysPerWarp = kBlockN / kWarps;  // 16: one k-step of P V
  static constexpr int kStages = decode_stages(kHeadDim);
  using QTile = SmemTile<kRows, kHeadDim>;
  using KTile = SmemTile<kBlockN, kHeadDim>;
  static constexpr int kNT_O = kHeadDim / 8;
  // fp32 merge buffer [warps][rows][kHeadDim + 4] (the pad spreads the
  // fragment stores over the banks), over the K/V ring after the loop.
  static constexpr int kMergePitch = kHeadDim + 4;
  static constexpr int kSmemQ = 0;
  static constexpr int kSmemRing = kSmemQ + QTile::kBytes;
  static constexpr int kStageBytes = 2 * KTile::kBytes;  // K then V
  static constexpr int kSmemStats = kSmemRing + kStages * kStageBytes;
  static constexpr int kSmemBytes = kSmemStats + 2 * kWarps * kRows * 4;  // row max, row sum
  static_assert(kSmemBytes == decode_smem_bytes(kHeadDim, kMT), "decode_params.h's size");
  static_assert(kWarps * kRows * kMergePitch * 4 <= kStages * kStageBytes, "merge buffer fits the ring");
  static_assert(kKeysPerWarp == 16, "one 16-key slice per warp");
};

// Which rows and keys one CTA owns, and where its tiles need the element mask.
struct DecodeBlock {
  int b, hk, split;
  int group;       // query heads per KV head
  int r0, rows;    // first packed row of the CTA; packed rows in total
  int seqlen_k;    // this sequence's keys
  int off;         // query token t sits at key position t + off
  int n_first, n_last;    // this split's KV tiles [n_first, n_last)
  int64_t full_lo, full_hi;  // keys that every row of the CTA sees

  JF_DEVICE bool tile_needs_mask(int n0, int bn) const { return n0 < full_lo || n0 + bn > full_hi; }
};

JF_DEVICE DecodeBlock decode_block(const DecodeParams& p, int rows_per_cta, int bn) {
  DecodeBlock d;
  d.b = blockIdx.y / p.num_heads_k;
  d.hk = blockIdx.y % p.num_heads_k;
  d.split = blockIdx.z;
  d.group = p.num_heads / p.num_heads_k;
  d.rows = p.seqlen_q * d.group;
  d.r0 = blockIdx.x * rows_per_cta;
  const int cap = p.num_pages > 0 ? p.max_pages * p.page_size : 0;  // no pages: no keys
  d.seqlen_k = max(0, min(__ldg(p.seqlens + d.b), cap));
  d.off = d.seqlen_k - p.seqlen_q;
  const int64_t t_lo = d.r0 / d.group;
  const int64_t t_hi = (min(d.r0 + rows_per_cta, d.rows) - 1) / d.group;
  int64_t lo = 0, hi = d.seqlen_k;
  d.full_lo = 0;
  d.full_hi = d.seqlen_k;
  if (p.window_left >= 0) {
    lo = max64(0, t_lo + d.off - p.window_left);
    d.full_lo = t_hi + d.off - p.window_left;
  }
  if (p.window_right >= 0) {
    hi = min64(hi, t_hi + d.off + p.window_right + 1);
    d.full_hi = min64(d.full_hi, t_lo + d.off + p.window_right + 1);
  }
  int first = 0, last = 0;
  if (hi > lo) {
    first = int(lo / bn);
    last = int((hi + bn - 1) / bn);
  }
  const int per = (last - first + p.num_splits - 1) / p.num_splits;
  d.n_first = min(last, first + d.split * per);
  d.n_last = min(last, d.n_first + per);
  return d;
}

// Q tile: packed row r of the CTA is token (r0 + r) / group of head
// hk * group + (r0 + r) % group. Rows past the packed rows and columns past
// head_dim are zero-filled.
template <typename Element, typename Cfg>
JF_DEVICE void load_q_tile(uint32_t sQ, const DecodeParams& p, const DecodeBlock& d, int tid) {
  constexpr int kChunks = Cfg::kHeadDim / 8;
  const Element* q = static_cast<const Element*>(p.q);
  for (int idx = tid; idx < Cfg::kRows * kChunks; idx += Cfg::kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int pr = d.r0 + r;
    const bool ok = pr < d.rows && c < p.head_dim;
    const Element* src = q;
    if (ok) {
      const int t = pr / d.group, h = d.hk * d.group + pr % d.group;
      src = q + d.b * p.q_batch_stride + t * p.q_row_stride + h * p.q_head_stride + c;
    }
    sm80::cp_async_16(sQ + Cfg::QTile::offset(r, c), src, ok);
  }
}

JF_DEVICE int64_t page_base(const DecodeParams& p, const int32_t* table, int page) {
  const int id = min(max(__ldg(table + page), 0), p.num_pages - 1);
  return int64_t(id) * p.kv_page_stride;
}

// K and V rows n0 .. n0 + kBlockN - 1 of sequence b, head hk, into one ring
// stage. Keys past seqlen_k and columns past head_dim are zero-filled (the
// mask removes those keys; zero V rows add nothing).
template <typename Element, typename Cfg>
JF_DEVICE void load_kv_tile(uint32_t sK, uint32_t sV, const DecodeParams& p, const DecodeBlock& d,
                            int n0, int tid) {
  using KTile = typename Cfg::KTile;
  constexpr int kChunks = Cfg::kHeadDim / 8;
  constexpr int kTotal = Cfg::kBlockN * kChunks;
  static_assert(kTotal % Cfg::kThreads == 0, "whole passes");
  const Element* k = static_cast<const Element*>(p.k);
  const Element* v = static_cast<const Element*>(p.v);
  const int32_t* table = p.page_table + int64_t(d.b) * p.max_pages;
  const int ps = p.page_size;
  const int page0 = n0 / ps;
  // Block-uniform: the whole tile in one page (a contiguous cache, or pages
  // of a multiple of the tile) takes one table lookup.
  const bool one_page = (n0 + Cfg::kBlockN - 1) / ps == page0;
  const int64_t tile_base = one_page ? page_base(p, table, page0) + int64_t(n0 - page0 * ps) * p.kv_row_stride : 0;
  const int64_t head = int64_t(d.hk) * p.kv_head_stride;
#pragma unroll
  for (int i = 0; i < kTotal / Cfg::kThreads; ++i) {
    const int idx = tid + i * Cfg::kThreads;
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int j = n0 + r;
    const bool ok = j < d.seqlen_k && c < p.head_dim;
    int64_t off = 0;
    if (ok) {
      off = one_page ? tile_base + int64_t(r) * p.kv_row_stride
                     : page_base(p, table, j / ps) + int64_t(j % ps) * p.kv_row_stride;
      off += head + c;
    }
    const uint32_t so = KTile::offset(r, c);
    sm80::cp_async_16(sK + so, k + off, ok);
    sm80::cp_async_16(sV + so, v + off, ok);
  }
}

// The element mask of one warp's (kMT * 16) x 16 score block (keys kb .. kb + 15).
template <int kMT>
JF_DEVICE void mask_scores(float (&s)[kMT][2][4], const DecodeParams& p, const DecodeBlock& d, int kb,
                           int lane) {
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t pos = int64_t((d.r0 + m * 16 + g + 8 * h) / d.group) + d.off;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int key = kb + n * 8 + 2 * tq + j;
          const bool vis = key < d.seqlen_k && (p.window_left < 0 || key >= pos - p.window_left) &&
                           (p.window_right < 0 || key <= pos + p.window_right);
          if (!vis) s[m][n][2 * h + j] = -INFINITY;
        }
    }
}

template <typename Element, int kHeadDim, int kMT, bool kSoftcap>
__global__ void __launch_bounds__(DecodeConfig<kHeadDim, kMT>::kThreads)
    decode_kernel(const __grid_constant__ DecodeParams p) {
  using Cfg = DecodeConfig<kHeadDim, kMT>;
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  constexpr int kStages = Cfg::kStages;
  JF_SMEM(smem);
  sm80::check_smem_alignment(smem);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const DecodeBlock d = decode_block(p, Cfg::kRows, Cfg::kBlockN);
  const int n_tiles = d.n_last - d.n_first;

  const uint32_t sQ = sm80::smem_addr(smem + Cfg::kSmemQ);
  const uint32_t sRing = sm80::smem_addr(smem + Cfg::kSmemRing);
  auto stage_k = [&](int s) { return sRing + uint32_t(s * Cfg::kStageBytes); };
  auto stage_v = [&](int s) { return sRing + uint32_t(s * Cfg::kStageBytes + KTile::kBytes); };

  // Prologue: Q with the first tile, then the rest of the ring. Every stage
  // commits a group, loaded or not, so that the wait counts stay fixed.
  load_q_tile<Element, Cfg>(sQ, p, d, tid);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) load_kv_tile<Element, Cfg>(stage_k(s), stage_v(s), p, d, (d.n_first + s) * Cfg::kBlockN, tid);
    sm80::cp_async_commit();
  }

  float acc_o[kMT][Cfg::kNT_O][4];
  sm80::zero(acc_o);
  sm80::OnlineSoftmax<kMT> softmax;
  softmax.init();
  const float scale_log2 = p.sm.scale_log2;

  for (int i = 0; i < n_tiles; ++i) {
    sm80::cp_async_wait<kStages - 2>();
    __syncthreads();  // tile i visible to all; every warp is done with tile i - 1's stage
    {
      const int next = i + kStages - 1;
      if (next < n_tiles) {
        const int s = next % kStages;
        load_kv_tile<Element, Cfg>(stage_k(s), stage_v(s), p, d, (d.n_first + next) * Cfg::kBlockN, tid);
      }
      sm80::cp_async_commit();
    }
    const int s = i % kStages;
    const int n0 = (d.n_first + i) * Cfg::kBlockN;
    const int kw = warp * Cfg::kKeysPerWarp;  // this warp's keys within the tile

    float acc_s[kMT][2][4];
    sm80::zero(acc_s);
    sm80::gemm_ss<Element, kMT, 2, kHeadDim, false, false, QTile, KTile>(acc_s, sQ, 0, stage_k(s), kw,
                                                                        LdsmLane{lane});
    if constexpr (kSoftcap) sm80::apply_softcap(acc_s, p.sm.softcap_pre);
    if (d.tile_needs_mask(n0, Cfg::kBlockN)) mask_scores(acc_s, p, d, n0 + kw, lane);
    if (i == 0)
      softmax.template update<true>(acc_s, acc_o, scale_log2);
    else
      softmax.template update<false>(acc_s, acc_o, scale_log2);

    uint32_t p_frag[kMT][1][4];
    sm80::pack_c_to_a<Element>(p_frag, acc_s);
    // The warp's 16 V rows: a 16-row offset keeps the swizzle phase (16 rows
    // are whole 1 KB periods), so the slice is addressed as a tile of its own.
    sm80::gemm_rs<Element, kMT, Cfg::kNT_O, 16, true, KTile, true>(
        acc_o, p_frag, stage_v(s) + uint32_t(kw * KTile::kRowBytes), 0, LdsmLane{lane});
  }

  // ---- merge the four warps' partial softmax states
  sm80::cp_async_wait<0>();
  float* s_max = reinterpret_cast<float*>(smem + Cfg::kSmemStats);
  float* s_sum = s_max + Cfg::kWarps * Cfg::kRows;
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float row_sum = sm80::quad_sum(softmax.l[m][h]);
      if (tq == 0) {
        s_max[warp * Cfg::kRows + m * 16 + g + 8 * h] = softmax.m[m][h];
        s_sum[warp * Cfg::kRows + m * 16 + g + 8 * h] = row_sum;
      }
    }
  __syncthreads();  // statistics visible; every warp is done reading the ring

  // Row r over the warps: M = max_w m_w, L = sum_w l_w 2^((m_w - M) scale_log2).
  auto row_stats = [&](int r, float& M, float& L) {
    M = -INFINITY;
#pragma unroll
    for (int w = 0; w < Cfg::kWarps; ++w) M = fmaxf(M, s_max[w * Cfg::kRows + r]);
    L = 0.f;
#pragma unroll
    for (int w = 0; w < Cfg::kWarps; ++w) {
      const float m = s_max[w * Cfg::kRows + r];
      if (m != -INFINITY) L += s_sum[w * Cfg::kRows + r] * exp2_approx((m - M) * scale_log2);
    }
  };
  float* merge = reinterpret_cast<float*>(smem + Cfg::kSmemRing);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + g + 8 * h;
      float M, L;
      row_stats(r, M, L);
      const float m = softmax.m[mt][h];
      const float f = (m == -INFINITY || !(L > 0.f)) ? 0.f : exp2_approx((m - M) * scale_log2) / L;
      float* dst = merge + (warp * Cfg::kRows + r) * Cfg::kMergePitch + 2 * tq;
#pragma unroll
      for (int n = 0; n < Cfg::kNT_O; ++n) {
        dst[n * 8] = acc_o[mt][n][2 * h] * f;
        dst[n * 8 + 1] = acc_o[mt][n][2 * h + 1] * f;
      }
    }
  __syncthreads();

  // ---- write: 8 columns per thread and step, summed over the warps
  constexpr int kChunks = kHeadDim / 8;
  const bool partial = p.num_splits > 1;
  for (int idx = tid; idx < Cfg::kRows * kChunks; idx += Cfg::kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int pr = d.r0 + r;
    if (pr >= d.rows || c >= p.head_dim) continue;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
    for (int w = 0; w < Cfg::kWarps; ++w) {
      const float4* src = reinterpret_cast<const float4*>(merge + (w * Cfg::kRows + r) * Cfg::kMergePitch + c);
      const float4 x = src[0], y = src[1];
      acc[0] += x.x; acc[1] += x.y; acc[2] += x.z; acc[3] += x.w;
      acc[4] += y.x; acc[5] += y.y; acc[6] += y.z; acc[7] += y.w;
    }
    const int t = pr / d.group, h = d.hk * d.group + pr % d.group;
    if (partial) {
      const int64_t row = ((int64_t(d.split) * p.batch + d.b) * p.num_heads + h) * p.seqlen_q + t;
      float4* dst = reinterpret_cast<float4*>(p.o_partial + row * p.head_dim + c);
      dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    } else {
      Element* o = static_cast<Element*>(p.o) + d.b * p.o_batch_stride + t * p.o_row_stride +
                   h * p.o_head_stride + c;
      uint4 v;
      v.x = Pack<Element>::pack(acc[0], acc[1]);
      v.y = Pack<Element>::pack(acc[2], acc[3]);
      v.z = Pack<Element>::pack(acc[4], acc[5]);
      v.w = Pack<Element>::pack(acc[6], acc[7]);
      *reinterpret_cast<uint4*>(o) = v;
    }
  }
  if (tid < Cfg::kRows && d.r0 + tid < d.rows) {
    const int pr = d.r0 + tid;
    float M, L;
    row_stats(tid, M, L);
    const float lse = (M == -INFINITY || !(L > 0.f)) ? -INFINITY : M * p.sm.scale_eff + __logf(L);
    const int t = pr / d.group, h = d.hk * d.group + pr % d.group;
    const int64_t row = (int64_t(d.b) * p.num_heads + h) * p.seqlen_q + t;
    if (partial)
      p.lse_partial[int64_t(d.split) * p.batch * p.num_heads * p.seqlen_q + row] = lse;
    else
      p.lse[row] = lse;
  }
}

}  // namespace jax_flash::decode
