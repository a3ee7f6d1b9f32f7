// FlashAttention-2 backward (algorithm 2), dK/dV kernel with fused dQ atomics.
//
// CTA = (KV block of kBlockN keys, kv head, batch). K and V stay in shared
// memory, dK and dV in registers. The CTA sweeps every (q head of the GQA
// group, visible query block) pair, so GQA sums happen in registers in a fixed
// order (no dk/dv atomics, deterministic). Per query block:
//
//   wait Q, dO[it] ------------------------ barrier
//   issue cp.async Q, dO[it+1] (other stage)
//   S = Q K^T, dP = dO V^T                  (warp tiles of the S layout)
//   P = 2^(S*scale*log2e - LSE*log2e), dS = P (dP - delta) [* tanh']
//   P, dS -> shared memory (16-bit) ------- barrier
//   dV += P^T dO, dK += dS^T Q              (warp tiles of the dKV layout)
//   dQ  = dS K -> dq_accum                   (fast mode only)
//
// With a value head dim of its own (Cfg::kHeadDimV), V, dO and dV are that
// wide: dP = dO V^T reduces over it and dV += P^T dO has its warp tiles.
//
// dQ reaches dq_accum (fp32) by float2 atomics, or on sm90 (kBulkDq) through
// a shared-memory tile that the copy engine adds into dq_accum one row per
// instruction (cp.reduce.async.bulk), issued after the next iteration's first
// barrier so that it overlaps that iteration's S/dP products.
//
// Deterministic mode skips the dQ part; bwd_dq_kernel.cuh computes dQ.
//
// Dropout (kDropout): the S warp tiles hold rows = queries, columns = keys,
// the layout the generator is defined on (dropout.cuh), so the keep bits of
// a thread's S / dP elements are its own calls of the generator; as the warp
// tiles are often narrower than a call's 64 keys, the calls of the whole tile
// are drawn once each into a shared-memory table (KeepTable: the next tile's
// during the dV / dK products, integer work next to the tensor cores) and
// each thread takes its bits from there, to use them twice. With Z the
// mask and ks = keep_scale, the gradients are
//   dV = ks (P Z)^T dO,  dS = P (Z ks dP - delta) = ks P (Z dP - delta / ks),
// so the loop only zeroes: dP <- Z dP (before dP - delta, with delta scaled
// by 1 / ks) and P <- Z P (after dS is formed); the factor ks of dV, dK and
// dQ is applied once, in the epilogue and in the dQ conversion (delta =
// rowsum(dO * O) - dLSE comes from the caller, from the dropped O).
#pragma once

#include "dropout.cuh"
#include "kernel_traits.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "warp_gemm.cuh"

namespace jax_flash::sm80 {

struct BwdKernelArgs {
  BwdParams p;
  MaskInfo mask;
  SoftmaxScale sm;
};

// A thread's lane and its warp's origins in the three warp layouts (see
// kernel_traits.cuh). Built from opaque_tid() in each phase of the loop so the
// values are recomputed (a few integer ops) rather than held in registers.
template <typename Cfg>
struct BwdCoords {
  int lane, s_row, s_col, kv_row, k_col, q_row, q_col;
  JF_DEVICE explicit BwdCoords(int tid) {
    const int warp = tid / 32;
    lane = tid % 32;
    s_row = (warp % Cfg::kWarpsM_S) * Cfg::kRowsS;
    s_col = (warp / Cfg::kWarpsM_S) * Cfg::kColsS;
    kv_row = (warp % Cfg::kWarpsN_KV) * Cfg::kRowsKV;
    k_col = (warp / Cfg::kWarpsN_KV) * Cfg::kColsK;
    q_row = (warp % Cfg::kWarpsM_Q) * Cfg::kRowsQ;
    q_col = (warp / Cfg::kWarpsM_Q) * Cfg::kColsQ;
  }
  // dV's column origin: dK's warp column in units of dV's warp tile.
  // Computed on use, not stored: with one head dim it is k_col itself.
  JF_DEVICE int v_col() const {
    if constexpr (Cfg::kColsV == Cfg::kColsK) return k_col;
    else return k_col / Cfg::kColsK * Cfg::kColsV;
  }
};

// Rows of the dQ tile staged in shared memory -> dq_accum (kBulkDq): thread r
// issues row r. dq points at the tile's first row.
template <typename Cfg>
JF_DEVICE void issue_dq_rows(float* dq, uint32_t sdQ, int rows_valid, int tid) {
  if (tid < Cfg::kBlockM && tid < rows_valid) {
    bulk_reduce_add_f32(dq + tid * Cfg::kHeadDim, sdQ + tid * Cfg::kDqPitch * 4,
                        Cfg::kHeadDim * 4);
    bulk_commit();
  }
}

// kPacked: packed sequences, kDropout: attention dropout (see fwd_kernel.cuh).
template <typename Element, typename Cfg, bool kBulkDq, bool kPacked = false,
          bool kDropout = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1) bwd_kernel(const __grid_constant__ BwdKernelArgs args) {
  JF_SMEM(smem);
  check_smem_alignment(smem);
  const BwdParams& p = args.p;
  const int tid = threadIdx.x;
  using QTile = typename Cfg::QTile;
  using dOTile = typename Cfg::dOTile;
  using KTile = typename Cfg::KTile;
  using VTile = typename Cfg::VTile;
  using PTile = typename Cfg::PTile;
  constexpr int kT = Cfg::kThreads;

  const int n_block = blockIdx.x, head_k = blockIdx.y, batch = blockIdx.z;
  const int group = p.num_heads / p.num_heads_k;
  const int n0 = n_block * Cfg::kBlockN;
  const int keys_valid = p.seqlen_k - n0;

  // Read from parameter space where used (keeps registers free).
  const MaskInfo& mi = args.mask;

  const Element* k = static_cast<const Element*>(p.k) + batch * p.k_batch_stride +
                     head_k * p.k_head_stride + n0 * p.k_row_stride;
  const Element* v = static_cast<const Element*>(p.v) + batch * p.v_batch_stride +
                     head_k * p.v_head_stride + n0 * p.v_row_stride;
  // The q-side pointers of (q head, query block); strides of dq follow q.
  // (batch is laundered so that these are rebuilt at each use in the loop.)
  auto q_ptr = [&](int hq, int m0) {
    return static_cast<const Element*>(p.q) + launder(batch) * p.q_batch_stride +
           hq * p.q_head_stride + m0 * p.q_row_stride;
  };
  auto do_ptr = [&](int hq, int m0) {
    return static_cast<const Element*>(p.dout) + launder(batch) * p.o_batch_stride +
           hq * p.o_head_stride + m0 * p.o_row_stride;
  };

  int m_first, m_last;
  if constexpr (kPacked) {
    mi.q_block_range(batch, n0, Cfg::kBlockN, Cfg::kBlockM, m_first, m_last);
  } else {
    mi.BlockMath<MaskInfo>::q_block_range(n0, Cfg::kBlockN, Cfg::kBlockM, m_first, m_last);
  }
  const int num_m = m_last - m_first;
  const int iters = num_m * group;

  const uint32_t sK = smem_addr(smem + Cfg::kSmemK);
  const uint32_t sV = smem_addr(smem + Cfg::kSmemV);
  const uint32_t sQ0 = smem_addr(smem + Cfg::kSmemQ);
  const uint32_t sdO0 = smem_addr(smem + Cfg::kSmemdO);
  const uint32_t sP = smem_addr(smem + Cfg::kSmemP);
  const uint32_t sdS = smem_addr(smem + Cfg::kSmemdS);

  float acc_dk[Cfg::kMT_KV][Cfg::kNT_K][4];
  float acc_dv[Cfg::kMT_KV][Cfg::kNT_V][4];
  zero(acc_dk);
  zero(acc_dv);

  // Dropout: the keep table past the tiles (see KeepTable).
  using Table = KeepTable<Cfg::kBlockM, Cfg::kBlockN, kT>;
  [[maybe_unused]] char* const keep_table = smem + Cfg::kSmemBytes;

  if (iters > 0) {
    load_tile_async<KTile, kT>(sK, k, p.k_row_stride, keys_valid, p.head_dim, tid);
    load_tile_async<VTile, kT>(sV, v, p.v_row_stride, keys_valid, value_head_dim<Cfg>(p), tid);
    const int hq = head_k * group, m0 = m_first * Cfg::kBlockM;
    load_tile_async<QTile, kT>(sQ0, q_ptr(hq, m0), p.q_row_stride, p.seqlen_q - m0, p.head_dim, tid);
    load_tile_async<dOTile, kT>(sdO0, do_ptr(hq, m0), p.o_row_stride, p.seqlen_q - m0,
                                value_head_dim<Cfg>(p), tid);
    cp_async_commit();
  }

  const float softcap_pre = args.sm.softcap_pre;
  const float scale_log2 = args.sm.scale_log2;
  const bool fused_dq = !p.deterministic;
  // The key words, read once (device memory); unused without dropout.
  const Dropout drop = kDropout ? Dropout(p.dropout) : Dropout();
  if constexpr (kDropout)  // the first tile's keep table (read after the loop's first barrier)
    Table::write(keep_table, drop, batch, head_k * group, m_first * Cfg::kBlockM, n0, tid);
  // dQ rows of the staged tile (kBulkDq): of dq_accum row block (hq, m0).
  const uint32_t sdQ = smem_addr(smem + Cfg::kSmemdQ);
  auto dq_accum_ptr = [&](int hq, int m0) {
    return p.dq_accum + ((int64_t(launder(batch)) * p.num_heads + hq) * p.seqlen_q_rounded + m0) *
                            Cfg::kHeadDim;
  };
  int staged_hq = 0, staged_m0 = 0;  // the tile waiting in sdQ (kBulkDq)

  // Iteration it visits (q head hq, query block m_block); the pair advances
  // m_block first, then the head of the GQA group.
  int hq = head_k * group, m_block = m_first;
  for (int it = 0; it < iters; ++it) {
    const int stage = it & 1;
    const int m0 = m_block * Cfg::kBlockM;
    int hq_n = hq, m_block_n = m_block + 1;
    if (m_block_n == m_last) {
      m_block_n = m_first;
      ++hq_n;
    }
    const int rows_valid = p.seqlen_q - m0;
    const uint32_t sQ = sQ0 + stage * QTile::kBytes;
    const uint32_t sdO = sdO0 + stage * dOTile::kBytes;

    cp_async_wait<0>();
    __syncthreads();  // Q/dO[it] visible; every warp is done with iteration it-1
    if constexpr (kBulkDq)
      if (fused_dq && it > 0)  // dQ of iteration it-1 is complete in sdQ
        issue_dq_rows<Cfg>(dq_accum_ptr(staged_hq, staged_m0), sdQ, p.seqlen_q - staged_m0,
                           opaque_tid());
    if (it + 1 < iters) {
      const int m0_n = m_block_n * Cfg::kBlockM;
      const uint32_t next = stage ^ 1;
      load_tile_async<QTile, kT>(sQ0 + next * QTile::kBytes, q_ptr(launder(hq_n), m0_n),
                                 p.q_row_stride, p.seqlen_q - m0_n, p.head_dim, opaque_tid());
      load_tile_async<dOTile, kT>(sdO0 + next * dOTile::kBytes, do_ptr(launder(hq_n), m0_n),
                                  p.o_row_stride, p.seqlen_q - m0_n, value_head_dim<Cfg>(p),
                                  opaque_tid());
      cp_async_commit();
    }

    // ---- S = Q K^T and dP = dO V^T on the S warp tiles
    const int64_t row_stat = (int64_t(launder(batch)) * p.num_heads + hq) * p.seqlen_q + m0;
    float acc_s[Cfg::kMT_S][Cfg::kNT_S][4];
    float acc_dp[Cfg::kMT_S][Cfg::kNT_S][4];
    {
      const BwdCoords<Cfg> c(opaque_tid());
      const LdsmLane ldsm{c.lane};
      float lse_log2[Cfg::kMT_S][2], delta[Cfg::kMT_S][2];
      load_row_stats(lse_log2, delta, p.lse + row_stat, p.delta + row_stat, c.s_row, rows_valid,
                     c.lane);
      [[maybe_unused]] FragKeep<Cfg::kMT_S, Cfg::kNT_S> keep;
      if constexpr (kDropout) {
        Table::read(keep, keep_table, c.s_row, c.s_col, c.lane);
        scale_rows(delta, dropout_keep_rate(p.dropout));
      }
      zero(acc_s);
      zero(acc_dp);
      gemm_ss<Element, Cfg::kMT_S, Cfg::kNT_S, Cfg::kHeadDim, false, false, QTile, KTile>(
          acc_s, sQ, c.s_row, sK, c.s_col, ldsm);
      gemm_ss<Element, Cfg::kMT_S, Cfg::kNT_S, Cfg::kHeadDimV, false, false, dOTile, VTile>(
          acc_dp, sdO, c.s_row, sV, c.s_col, ldsm);
      if constexpr (kDropout) keep.apply(acc_dp);
      dp_minus_delta(acc_s, acc_dp, delta, softcap_pre);
      if constexpr (kPacked) {
        if (mi.block_needs_mask(batch, m0, Cfg::kBlockM, n0, Cfg::kBlockN))
          apply_mask<true>(acc_s, mi, batch, m0 + c.s_row, n0 + c.s_col, c.lane,
                           mi.rows_exact(batch, m0, Cfg::kBlockM));
      } else {
        if (mi.block_needs_mask_by_position(m0, Cfg::kBlockM, n0, Cfg::kBlockN))
          apply_mask<false>(acc_s, mi, batch, m0 + c.s_row, n0 + c.s_col, c.lane, false);
      }
      probs_and_dscores(acc_s, acc_dp, lse_log2, scale_log2);
      if constexpr (kDropout) keep.apply(acc_s, dropout_opaque_zero(p.dropout));
    }
    {
      const BwdCoords<Cfg> c(opaque_tid());
      store_c<Element, Cfg::kMT_S, Cfg::kNT_S, PTile>(smem + Cfg::kSmemP, acc_s, c.s_row, c.s_col,
                                                      c.lane);
      store_c<Element, Cfg::kMT_S, Cfg::kNT_S, PTile>(smem + Cfg::kSmemdS, acc_dp, c.s_row,
                                                      c.s_col, c.lane);
    }
    if constexpr (kBulkDq) bulk_wait_read_all();  // sdQ free again (issued at the top)
    __syncthreads();  // P and dS complete

    // ---- dV += P^T dO, dK += dS^T Q on the dKV warp tiles
    if constexpr (kDropout)  // the next tile's keep table (past the last one: unread)
      Table::write(keep_table, drop, launder(batch), hq_n, m_block_n * Cfg::kBlockM, n0,
                   opaque_tid());
    {
      const BwdCoords<Cfg> c(opaque_tid());
      gemm_ss<Element, Cfg::kMT_KV, Cfg::kNT_V, Cfg::kBlockM, true, true, PTile, dOTile>(
          acc_dv, sP, c.kv_row, sdO, c.v_col(), LdsmLane{c.lane});
    }
    {
      const BwdCoords<Cfg> c(opaque_tid());
      gemm_ss<Element, Cfg::kMT_KV, Cfg::kNT_K, Cfg::kBlockM, true, true, PTile, QTile>(
          acc_dk, sdS, c.kv_row, sQ, c.k_col, LdsmLane{c.lane});
    }

    // ---- dQ (unscaled) = dS K, accumulated in fp32 with atomics
    if (fused_dq) {
      const BwdCoords<Cfg> c(opaque_tid());
      float acc_dq[Cfg::kMT_Q][Cfg::kNT_Q][4];
      zero(acc_dq);
      gemm_ss<Element, Cfg::kMT_Q, Cfg::kNT_Q, Cfg::kBlockN, false, true, PTile, KTile>(
          acc_dq, sdS, c.q_row, sK, c.q_col, LdsmLane{c.lane});
      const int g = c.lane >> 2, t = c.lane & 3;
      if constexpr (kBulkDq) {  // whole tile (rows past the end are never issued)
        float* tile = reinterpret_cast<float*>(smem + Cfg::kSmemdQ);
#pragma unroll
        for (int i = 0; i < Cfg::kMT_Q; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int n = 0; n < Cfg::kNT_Q; ++n) {
              const int r = c.q_row + i * 16 + g + 8 * h, col = c.q_col + n * 8 + 2 * t;
              *reinterpret_cast<float2*>(tile + r * Cfg::kDqPitch + col) =
                  make_float2(acc_dq[i][n][2 * h], acc_dq[i][n][2 * h + 1]);
            }
        fence_proxy_async_smem();  // visible to the copy engine after the next barrier
        staged_hq = hq;
        staged_m0 = m0;
      } else {
        float* dq = dq_accum_ptr(hq, m0);
#pragma unroll
        for (int i = 0; i < Cfg::kMT_Q; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = c.q_row + i * 16 + g + 8 * h;
            if (r < rows_valid) {
#pragma unroll
              for (int n = 0; n < Cfg::kNT_Q; ++n) {
                const int col = c.q_col + n * 8 + 2 * t;
                if (col < p.head_dim)  // head_dim % 8 == 0: col + 1 is valid too
                  atomic_add2(dq + r * Cfg::kHeadDim + col, acc_dq[i][n][2 * h],
                              acc_dq[i][n][2 * h + 1]);
              }
            }
          }
      }
    }
    hq = hq_n;
    m_block = m_block_n;
  }

  // ---- epilogue: dK (times the softmax scale), dV -> 16-bit -> global
  __syncthreads();  // every warp is done reading K and V (and writing sdQ)
  if constexpr (kBulkDq)
    if (fused_dq && iters > 0)
      issue_dq_rows<Cfg>(dq_accum_ptr(staged_hq, staged_m0), sdQ, p.seqlen_q - staged_m0, tid);
  const float scale = args.p.scale;
#pragma unroll
  for (int i = 0; i < Cfg::kMT_KV; ++i)
#pragma unroll
    for (int n = 0; n < Cfg::kNT_K; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc_dk[i][n][j] *= scale;
  if constexpr (kDropout) {
    const float keep_scale = dropout_keep_scale(p.dropout);
    scale_frags(acc_dk, keep_scale);
    scale_frags(acc_dv, keep_scale);
  }
  {
    const BwdCoords<Cfg> c(tid);
    store_c<Element, Cfg::kMT_KV, Cfg::kNT_K, KTile>(smem + Cfg::kSmemK, acc_dk, c.kv_row,
                                                     c.k_col, c.lane);
    store_c<Element, Cfg::kMT_KV, Cfg::kNT_V, VTile>(smem + Cfg::kSmemV, acc_dv, c.kv_row,
                                                     c.v_col(), c.lane);
  }
  __syncthreads();
  Element* dk = static_cast<Element*>(p.dk) + batch * p.k_batch_stride + head_k * p.k_head_stride +
                n0 * p.k_row_stride;
  Element* dv = static_cast<Element*>(p.dv) + batch * p.v_batch_stride + head_k * p.v_head_stride +
                n0 * p.v_row_stride;
  store_tile<KTile, kT>(smem + Cfg::kSmemK, dk, p.k_row_stride, keys_valid, p.head_dim, tid);
  store_tile<VTile, kT>(smem + Cfg::kSmemV, dv, p.v_row_stride, keys_valid, value_head_dim<Cfg>(p),
                        tid);
  if constexpr (kBulkDq) bulk_wait_all();  // the last reductions must finish before exit
}

}  // namespace jax_flash::sm80
