// Deterministic dQ pass (params.deterministic): no atomics, fixed order.
//
// CTA = (query block, q head, batch), shaped like the forward: Q and dO stay
// in shared memory, dQ in registers, and the CTA sweeps the visible KV blocks
// in increasing order with double-buffered K/V tiles. Per KV block it
// recomputes S and dP, forms dS in registers and feeds it straight into
// dQ += dS K as the A operand (the C -> A fragment identity, like P V in the
// forward). dQ is written once, in the input dtype: dq_accum is not used.
// With a value head dim of its own (Cfg::kHeadDimV), dO and V are that wide
// (dP = dO V^T reduces over it); dQ has Q's width.
//
// Dropout (kDropout): rows = queries, as the generator's layout
// (dropout.cuh): each thread draws its own keep bits before the S and dP
// products (at head dim 256 the 32-key blocks take half of each call), and
// dP <- Z dP with delta scaled by 1 / keep_scale, so that keep_scale times
// the result is dS = P (Z keep_scale dP - delta) (applied to dQ at the end).
#pragma once

#include "bwd_kernel.cuh"  // BwdKernelArgs
#include "kernel_traits.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "warp_gemm.cuh"

namespace jax_flash::sm80 {

// kPacked: packed sequences, kDropout: attention dropout (see fwd_kernel.cuh).
template <typename Element, typename Cfg, bool kPacked = false, bool kDropout = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1) bwd_dq_kernel(const __grid_constant__ BwdKernelArgs args) {
  JF_SMEM(smem);
  check_smem_alignment(smem);
  const BwdParams& p = args.p;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const LdsmLane ldsm{lane};
  using QTile = typename Cfg::QTile;
  using dOTile = typename Cfg::dOTile;
  using KTile = typename Cfg::KTile;
  using VTile = typename Cfg::VTile;
  constexpr int kT = Cfg::kThreads;

  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int head_k = head / (p.num_heads / p.num_heads_k);
  const int m0 = m_block * Cfg::kBlockM;
  const int rows_valid = p.seqlen_q - m0;

  // Read from parameter space where used (keeps registers free).
  const MaskInfo& mi = args.mask;

  const Element* q = static_cast<const Element*>(p.q) + batch * p.q_batch_stride +
                     head * p.q_head_stride + m0 * p.q_row_stride;
  const Element* dout = static_cast<const Element*>(p.dout) + batch * p.o_batch_stride +
                        head * p.o_head_stride + m0 * p.o_row_stride;
  const Element* k = static_cast<const Element*>(p.k) + batch * p.k_batch_stride +
                     head_k * p.k_head_stride;
  const Element* v = static_cast<const Element*>(p.v) + batch * p.v_batch_stride +
                     head_k * p.v_head_stride;

  const uint32_t sQ = smem_addr(smem + Cfg::kSmemQ);
  const uint32_t sdO = smem_addr(smem + Cfg::kSmemdO);
  const uint32_t sKV0 = smem_addr(smem + Cfg::kSmemKV);

  int n_first, n_last;
  if constexpr (kPacked) {
    mi.kv_block_range(batch, m0, Cfg::kBlockM, Cfg::kBlockN, n_first, n_last);
  } else {
    mi.BlockMath<MaskInfo>::kv_block_range(m0, Cfg::kBlockM, Cfg::kBlockN, n_first, n_last);
  }

  auto load_kv = [&](int n, uint32_t stage_base) {
    const int nk0 = n * Cfg::kBlockN;
    load_tile_async<KTile, kT>(stage_base, k + nk0 * p.k_row_stride, p.k_row_stride,
                               p.seqlen_k - nk0, p.head_dim, tid);
    load_tile_async<VTile, kT>(stage_base + KTile::kBytes, v + nk0 * p.v_row_stride,
                               p.v_row_stride, p.seqlen_k - nk0, value_head_dim<Cfg>(p), tid);
  };

  const int wrow = warp * Cfg::kMT * 16;
  float acc_dq[Cfg::kMT][Cfg::kNT_O][4];
  zero(acc_dq);

  if (n_last > n_first) {
    load_tile_async<QTile, kT>(sQ, q, p.q_row_stride, rows_valid, p.head_dim, tid);
    load_tile_async<dOTile, kT>(sdO, dout, p.o_row_stride, rows_valid, value_head_dim<Cfg>(p), tid);
    load_kv(n_first, sKV0);
    cp_async_commit();
  }

  const int64_t row_stat = (int64_t(batch) * p.num_heads + head) * p.seqlen_q + m0;
  float lse_log2[Cfg::kMT][2], delta[Cfg::kMT][2];
  load_row_stats(lse_log2, delta, p.lse + row_stat, p.delta + row_stat, wrow, rows_valid, lane);
  if constexpr (kDropout) scale_rows(delta, dropout_keep_rate(p.dropout));
  const float softcap_pre = args.sm.softcap_pre;
  const float scale_log2 = args.sm.scale_log2;
  // The key words, read once (device memory); unused without dropout.
  const Dropout drop = kDropout ? Dropout(p.dropout) : Dropout();

  for (int n = n_first; n < n_last; ++n) {
    const int stage = (n - n_first) & 1;
    const uint32_t sK = sKV0 + stage * Cfg::kStageBytes;
    const uint32_t sV = sK + KTile::kBytes;
    cp_async_wait<0>();
    __syncthreads();  // K/V[n] visible; every warp is done with stage ^ 1
    if (n + 1 < n_last) {
      load_kv(n + 1, sKV0 + (stage ^ 1) * Cfg::kStageBytes);
      cp_async_commit();
    }

    [[maybe_unused]] FragKeep<Cfg::kMT, Cfg::kNT_S> keep;
    if constexpr (kDropout) keep.draw(drop, batch, head, m0 + wrow, n * Cfg::kBlockN, lane);
    float acc_s[Cfg::kMT][Cfg::kNT_S][4];
    float acc_dp[Cfg::kMT][Cfg::kNT_S][4];
    zero(acc_s);
    zero(acc_dp);
    gemm_ss<Element, Cfg::kMT, Cfg::kNT_S, Cfg::kHeadDim, false, false, QTile, KTile>(
        acc_s, sQ, wrow, sK, 0, ldsm);
    gemm_ss<Element, Cfg::kMT, Cfg::kNT_S, Cfg::kHeadDimV, false, false, dOTile, VTile>(
        acc_dp, sdO, wrow, sV, 0, ldsm);
    if constexpr (kDropout) keep.apply(acc_dp);
    dp_minus_delta(acc_s, acc_dp, delta, softcap_pre);
    const int n0 = n * Cfg::kBlockN;
    if constexpr (kPacked) {
      if (mi.block_needs_mask(batch, m0, Cfg::kBlockM, n0, Cfg::kBlockN))
        apply_mask<true>(acc_s, mi, batch, m0 + wrow, n0, lane, mi.rows_exact(batch, m0, Cfg::kBlockM));
    } else {
      if (mi.block_needs_mask_by_position(m0, Cfg::kBlockM, n0, Cfg::kBlockN))
        apply_mask<false>(acc_s, mi, batch, m0 + wrow, n0, lane, false);
    }
    probs_and_dscores(acc_s, acc_dp, lse_log2, scale_log2);

    uint32_t ds_frag[Cfg::kMT][Cfg::kNT_S / 2][4];
    pack_c_to_a<Element>(ds_frag, acc_dp);
    gemm_rs<Element, Cfg::kMT, Cfg::kNT_O, Cfg::kBlockN, true, KTile, true>(acc_dq, ds_frag, sK,
                                                                             0, ldsm);
  }

  // dQ = scale * sum_n dS K  -> 16-bit -> shared (the Q tile) -> global.
  const float scale = args.p.scale;
#pragma unroll
  for (int i = 0; i < Cfg::kMT; ++i)
#pragma unroll
    for (int n = 0; n < Cfg::kNT_O; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc_dq[i][n][j] *= scale;
  if constexpr (kDropout) scale_frags(acc_dq, dropout_keep_scale(p.dropout));
  __syncthreads();  // every warp is done reading Q
  store_c<Element, Cfg::kMT, Cfg::kNT_O, QTile>(smem + Cfg::kSmemQ, acc_dq, wrow, 0, lane);
  __syncthreads();
  Element* dq = static_cast<Element*>(p.dq) + batch * p.q_batch_stride + head * p.q_head_stride +
                m0 * p.q_row_stride;
  store_tile<QTile, kT>(smem + Cfg::kSmemQ, dq, p.q_row_stride, rows_valid, p.head_dim, tid);
}

}  // namespace jax_flash::sm80
