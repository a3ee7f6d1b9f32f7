// Split-KV decoding kernel (sm80 instructions; runs on sm80..sm90).
//
// CTA = (16 or 32 packed query rows, one sequence's KV head, one split of its
// keys).
// Pack-GQA: the rows are (token, query head) pairs of the heads that share the
// KV head, so every key is read once per KV head, not once per query head.
// The keys are the memory-bound part: they stream through a kStages-deep
// cp.async ring of K and V tiles of 64 or 128 keys (decode_params.h's
// decode_tile; paged: each row's page looked up in the page table, one lookup
// per tile when the tile lies in one page), and the four warps split each tile
// 16 or 32 keys apiece, each with its own online softmax over all the rows:
//
//   wait tile i ------------------------------ barrier (stage of i-1 free)
//   issue cp.async tile i + kStages - 1        (into the stage of i-1)
//   S_w = Q K_w^T, softcap, mask at the edges  (registers, rows x 16 or 32 per warp)
//   online softmax; O_w += P_w V_w
//
// At the end the four warps' (max, sum, O) are merged through shared memory
// (the K/V ring is free by then) and the CTA writes either the output (one
// split, with the head's sink folded in) or its split's normalised fp32
// partial and LSE for the combine kernel (decode_combine.cuh, which adds the
// sink).
#pragma once

#include "decode/decode_block.cuh"
#include "decode/decode_fp8.cuh"
#include "sm80/softmax.cuh"
#include "sm80/warp_gemm.cuh"

#include <type_traits>

namespace jax_flash::decode {

// Score columns (keys kw + n * 8 + 2 tq + j of the warp's slice) times
// mul * col_scale[key].
template <int kMT, int kNS>
JF_DEVICE void scale_columns(float (&s)[kMT][kNS][4], const float* col_scale, float mul, int lane) {
  const int tq = lane & 3;
#pragma unroll
  for (int n = 0; n < kNS; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float c = col_scale[n * 8 + 2 * tq + j] * mul;
#pragma unroll
      for (int m = 0; m < kMT; ++m) {
        s[m][n][j] *= c;
        s[m][n][2 + j] *= c;
      }
    }
}

// The same for keys kb + ... < limit; the others' columns are left as they
// are (their probabilities are 0, and their scales were never loaded).
template <int kMT, int kNS>
JF_DEVICE void scale_columns_visible(float (&s)[kMT][kNS][4], const float* col_scale, int kb, int limit,
                                     int lane) {
  const int tq = lane & 3;
#pragma unroll
  for (int n = 0; n < kNS; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int off = n * 8 + 2 * tq + j;
      const float c = kb + off < limit ? col_scale[off] : 1.f;
#pragma unroll
      for (int m = 0; m < kMT; ++m) {
        s[m][n][j] *= c;
        s[m][n][2 + j] *= c;
      }
    }
}


// Cfg is decode_params.h's tile unless the self-test's benchmark passes
// another (cuda/tests/decode_variants.cuh).
template <typename Element, int kHeadDim, int kMT, bool kSoftcap, bool kFp8 = false,
          typename Cfg = DecodeConfig<kHeadDim, kMT, kFp8>>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinCtas) decode_kernel(const __grid_constant__ DecodeParams p) {
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  using MmaT = std::conditional_t<kFp8, __half, Element>;  // the products' type
  constexpr int kStages = Cfg::kStages;
  JF_SMEM(smem);
  sm80::check_smem_alignment(smem);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const DecodeBlock d = decode_block(p, Cfg::kRows, Cfg::kBlockN);
  const int n_tiles = d.n_last - d.n_first;

  const uint32_t sQ = sm80::smem_addr(smem + Cfg::kSmemQ);
  const uint32_t sRing = sm80::smem_addr(smem + Cfg::kSmemRing);
  auto stage_at = [&](int s) { return sRing + uint32_t(s * Cfg::kStageBytes); };
  auto k_tile = [&](int s) { return stage_at(s); };
  auto v_tile = [&](int s) {
    if constexpr (kFp8)
      return stage_at(s) + uint32_t(Fp8Stage<Cfg>::kV);
    else
      return stage_at(s) + uint32_t(KTile::kBytes);
  };
  auto load_tile = [&](int s, int n) {
    if constexpr (kFp8)
      load_kv_tile_fp8<Cfg>(stage_at(s), p, d, n * Cfg::kBlockN, tid);
    else
      load_kv_tile<Element, Cfg>(stage_at(s), stage_at(s) + uint32_t(KTile::kBytes), p, d,
                                 n * Cfg::kBlockN, tid);
  };

  // Prologue: Q with the first tile, then the rest of the ring. Every stage
  // commits a group, loaded or not, so that the wait counts stay fixed.
  load_q_tile<Element, Cfg>(sQ, p, d, tid);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) load_tile(s, d.n_first + s);
    sm80::cp_async_commit();
  }

  // Q's A fragments (Cfg::kQRegs), loaded with the first tile.
  uint32_t q_frag[Cfg::kQRegs ? kMT : 1][Cfg::kQRegs ? kHeadDim / 16 : 1][4];
  float acc_o[kMT][Cfg::kNT_O][4];
  sm80::zero(acc_o);
  sm80::OnlineSoftmax<kMT> softmax;
  softmax.init();
  const float scale_log2 = p.sm.scale_log2;

  for (int i = 0; i < n_tiles; ++i) {
    const int s = i % kStages;
    sm80::cp_async_wait<kStages - 2>();  // this thread's chunks of tile i (and Q) landed
    if constexpr (kFp8) {
      if (i == 0) {  // Q to fp16 once: it reads what every thread loaded
        __syncthreads();
        convert_q_tile<Element, Cfg>(smem + Cfg::kSmemQ, smem + Cfg::kSmemQ16, p.q_scale, tid);
      }
    }
    __syncthreads();  // tile i visible to all; every warp is done with tile i - 1's stage
    if constexpr (Cfg::kQRegs) {
      if (i == 0) {  // Q landed with tile 0's group
        const auto fq = sm80::addr_a<QTile>(sQ, 0, LdsmLane{lane});
#pragma unroll
        for (int m = 0; m < kMT; ++m)
#pragma unroll
          for (int ks = 0; ks < kHeadDim / 16; ++ks) sm80::ldmatrix_x4(q_frag[m][ks], fq.at(m * 16, ks * 16));
      }
    }
    {
      const int next = i + kStages - 1;
      if (next < n_tiles) load_tile(next % kStages, d.n_first + next);
      sm80::cp_async_commit();
    }
    const int n0 = (d.n_first + i) * Cfg::kBlockN;
    const int kw = warp * Cfg::kKeysPerWarp;  // this warp's keys within the tile
    const bool edge = d.tile_needs_mask(n0, Cfg::kBlockN);

    float acc_s[kMT][Cfg::kNS][4];
    sm80::zero(acc_s);
    if constexpr (kFp8)
      gemm_qk_fp8<Cfg, kMT>(acc_s, sm80::smem_addr(smem + Cfg::kSmemQ16), k_tile(s), kw, LdsmLane{lane});
    else if constexpr (Cfg::kQRegs)
      sm80::gemm_rs<MmaT, kMT, Cfg::kNS, kHeadDim, false, KTile>(acc_s, q_frag, k_tile(s), kw, LdsmLane{lane});
    else
      sm80::gemm_ss<MmaT, kMT, Cfg::kNS, kHeadDim, false, false, QTile, KTile>(acc_s, sQ, 0, k_tile(s), kw,
                                                                              LdsmLane{lane});
    const float* descale = nullptr;  // FP8: this tile's K descales, then V's
    if constexpr (kFp8) {
      descale = reinterpret_cast<const float*>(smem + Cfg::kSmemRing + s * Cfg::kStageBytes +
                                               Fp8Stage<Cfg>::kKScale);
      scale_columns(acc_s, descale + kw, kFp8Unscale, lane);
    }
    if constexpr (kSoftcap) sm80::apply_softcap(acc_s, p.sm.softcap_pre);
    if (edge) mask_scores(acc_s, d, n0 + kw, lane);
    if (i == 0)
      softmax.template update<true>(acc_s, acc_o, scale_log2);
    else
      softmax.template update<false, true>(acc_s, acc_o, scale_log2);
    if constexpr (kFp8) {
      // P' = P * v_descale (keys past seqlen_k: P = 0, their descale unread).
      scale_columns_visible(acc_s, descale + Cfg::kBlockN + kw, n0 + kw, edge ? d.blk.seqlen_k : 0x7FFFFFFF,
                            lane);
    }

    uint32_t p_frag[kMT][Cfg::kKS][4];
    sm80::pack_c_to_a<MmaT>(p_frag, acc_s);
    // The warp's V rows: an offset of 16 or 32 rows keeps the swizzle phase
    // (16 rows are whole 1 KB periods), so the slice is addressed as a tile
    // of its own.
    if constexpr (kFp8)
      gemm_pv_fp8<Cfg, kMT>(acc_o, p_frag, v_tile(s), kw, LdsmLane{lane});
    else
      sm80::gemm_rs<MmaT, kMT, Cfg::kNT_O, Cfg::kKeysPerWarp, true, KTile, true>(
          acc_o, p_frag, v_tile(s) + uint32_t(kw * KTile::kRowBytes), 0, LdsmLane{lane});
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
  // Row r's LSE and the factor that normalises its O (relative to M). One
  // split folds the head's sink in here; several leave it to the combine, so
  // that it enters each row once.
  const bool partial = p.num_splits > 1;
  auto row_finish = [&](int r, float& lse, float& inv) {
    float M, L;
    row_stats(r, M, L);
    const int head = d.hk * d.blk.group + (d.r0 + r) % d.blk.group;
    const float sink = partial ? -INFINITY : sink_of(p.sinks, d.b, head, p.num_heads);
    if (sink != -INFINITY) {
      finish_row_with_sink(M * p.sm.scale_eff, L, sink, lse, inv);
    } else {
      const bool empty = M == -INFINITY || !(L > 0.f);
      inv = empty ? 0.f : 1.f / L;
      lse = empty ? -INFINITY : M * p.sm.scale_eff + __logf(L);
    }
    return M;
  };
  float* merge = reinterpret_cast<float*>(smem + Cfg::kSmemMerge);
  const float o_unscale = kFp8 ? kFp8Unscale : 1.f;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + g + 8 * h;
      float lse, inv;
      const float M = row_finish(r, lse, inv);
      const float m = softmax.m[mt][h];
      const float f = (m == -INFINITY || inv == 0.f) ? 0.f : exp2_approx((m - M) * scale_log2) * o_unscale * inv;
      float* dst = merge + (warp * Cfg::kRows + r) * Cfg::kMergePitch;
#pragma unroll
      for (int n = 0; n < Cfg::kNT_O; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // FP8: the accumulator's columns are in gemm_pv_fp8's order.
          const int col = kFp8 ? fp8_o_column(n, 2 * tq + e) : n * 8 + 2 * tq + e;
          dst[col] = acc_o[mt][n][2 * h + e] * f;
        }
    }
  __syncthreads();

  // ---- write: 8 columns per thread and step, summed over the warps
  constexpr int kChunks = kHeadDim / 8;
  for (int idx = tid; idx < Cfg::kRows * kChunks; idx += Cfg::kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int pr = d.r0 + r;
    if (pr >= d.blk.packed_rows() || c >= p.head_dim) continue;
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
    const int t = pr / d.blk.group, h = d.hk * d.blk.group + pr % d.blk.group;
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
  if (tid < Cfg::kRows && d.r0 + tid < d.blk.packed_rows()) {
    const int pr = d.r0 + tid;
    float lse, inv;
    row_finish(tid, lse, inv);
    const int t = pr / d.blk.group, h = d.hk * d.blk.group + pr % d.blk.group;
    const int64_t row = (int64_t(d.b) * p.num_heads + h) * p.seqlen_q + t;
    if (partial)
      p.lse_partial[int64_t(d.split) * p.batch * p.num_heads * p.seqlen_q + row] = lse;
    else
      p.lse[row] = lse;
  }
}

}  // namespace jax_flash::decode
