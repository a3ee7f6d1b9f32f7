// The three roles of the sm90 backward (see bwd_kernel.cuh for the overview).
//
// Producer warp (warp 0 of the producer warpgroup, all 32 lanes): K and V of
// the CTA's KV block once (full_kv); then per step (q head, query block) the
// Q and dO tiles by TMA into a kStages ring, and the step's LSE (converted to
// log2 units; +inf for fully masked rows and rows past seqlen_q, so P = 0
// there) and delta rows by plain loads into the matching stat stages. A full
// barrier completes when the 32 lanes have arrived (each after its stat
// stores: release) and the TMA bytes have landed.
//
// dQ writer warp (warp 1 of the producer warpgroup): per step (and dQ slice,
// hdim 256) and consumer warpgroup, waits for the WG's staged 64 x 64 fp32 dQ
// tile (named barrier dQFull), adds it into dq_accum with one
// cp.reduce.async.bulk per row (rows < seqlen_q, columns < head_dim), and
// once the copy engine has read the tile hands it back (dQEmpty). FA3's dQ
// path (store_dq), with row bulk ops instead of a permuted dq_accum so that
// dq_accum stays row-major [b, h, seqlen_q_rounded, head_dim_rounded] for the
// shared dq_convert pass. The producer and the writer serve both work splits
// (bwd_config.cuh); the hdim-256 consumer is bwd_consumer_hd256.cuh.
// Deterministic mode (kDet): the KV blocks add into each dQ tile in a fixed
// order (descending block, bwd_mask.cuh dq_pred_range), through a semaphore
// per (batch, q head, query block) in global memory (BwdKernelArgs::dq_sem).
// Before the step's first reduction the writer waits (polls, then ld.acquire.gpu) until
// block n + 1, if it adds into the tile, has stored n + 2; once its own
// reductions are complete (cp.async.bulk.wait_group, not .read: the adds
// performed) it stores n + 1 (st.release.gpu). fence.proxy.async.global on
// both sides orders the async-proxy reductions with the generic flag accesses.
// Forward progress: block n + 1 of the same (batch, kv head) has the smaller
// tile index (BwdTileOrder<true>) and tiles are claimed in index
// order from a counter by running CTAs (bwd_kernel.cuh), so the CTA waited
// for is resident or done and itself waits only on smaller indices.
//
// Consumer warpgroup wg (SdP_swapAB: keys [64 wg, 64 wg + 64) of the block), per step:
//   S^T  = K_wg Q^T        wgmma SS  (A = K rows, B = Q, both K-major), N = kBlockM
//   dP^T = V_wg dO^T       wgmma SS
//   P^T  = 2^(S^T scale_log2 - lse_log2[q]),  dS^T = P^T (dP^T - delta[q])
//          (softcap: S^T <- tanh, dS^T *= 1 - tanh^2; the mask between)
//   dV  += P^T dO          wgmma RS  (P^T packed from the accumulator; dO MN-major)
//   dS^T -> dS (queries x keys, K-major) in shared memory, stmatrix.trans
//   --- both WGs' dS written (named barrier PdS)
//   dQ   = dS K            wgmma SS  (64 x 64 per WG; K MN-major; kBlockM 80:
//                          dQ^T = K^T dS^T, 64 columns x 80 queries per WG)
//   dK  += dS^T Q          wgmma RS  (Q MN-major)
//   dQ -> staging tile (dQEmpty / dQFull hand-off with the writer warp)
// Releases: dO (empty_do) once dV is done, Q (empty_q) once dK is done.
#pragma once

#include "bwd_config.cuh"
#include "bwd_mask.cuh"
#include "sm90/ptx/barrier.cuh"
#include "sm90/ptx/gmem_sync.cuh"
#include "sm90/ptx/mbarrier.cuh"
#include "sm90/ptx/smem_ops.cuh"
#include "sm90/ptx/tma.cuh"
#include "sm90/ptx/wgmma.cuh"

namespace jax_flash::sm90 {

// The CTA's work: KV block (of num_n_blocks per head), kv head, batch, and
// the visible query blocks [m_first, m_last) of every q head of the GQA group
// (iters steps: query block fastest, then q head).
struct BwdTile {
  int n_block, head_k, batch;
  int m_first, m_last, iters;
  int num_n_blocks;
};

template <typename Cfg, bool kPacked = false>
JF_DEVICE BwdTile make_bwd_tile(const BwdKernelArgs& a, const TileCoord& c, int num_n_blocks) {
  BwdTile w;
  w.num_n_blocks = num_n_blocks;
  w.n_block = c.block;
  w.head_k = c.head;
  w.batch = c.batch;
  if constexpr (kPacked) {
    a.mask.q_block_range(w.batch, w.n_block * Cfg::kBlockN, Cfg::kBlockN, Cfg::kBlockM, w.m_first, w.m_last);
  } else {
    a.mask.BlockMath<MaskInfo>::q_block_range(w.n_block * Cfg::kBlockN, Cfg::kBlockN, Cfg::kBlockM, w.m_first,
                                              w.m_last);
  }
  w.iters = (w.m_last - w.m_first) * a.heads_per_kv;
  return w;
}

// Walks (q head, query block) in step order.
struct BwdStepWalker {
  int hq, mb, m_first, m_last;
  JF_DEVICE BwdStepWalker(const BwdTile& w, int heads_per_kv)
      : hq(w.head_k * heads_per_kv), mb(w.m_first), m_first(w.m_first), m_last(w.m_last) {}
  JF_DEVICE void advance() {
    if (++mb == m_last) {
      mb = m_first;
      ++hq;
    }
  }
};

// ------------------------------------------------------------------ producer
template <typename Cfg>
JF_DEVICE void bwd_producer(const BwdKernelArgs& a, const BwdSmem<Cfg>& sm, const BwdTile& w) {
  using namespace ptx;
  constexpr int kCB = Cfg::kHeadDim / 64;       // TMA boxes per tile
  // Stat rows per lane (kBlockM 80: lanes 0-15 take a third row).
  constexpr int kRowsPerLane = (Cfg::kBlockM + 31) / 32;
  constexpr bool kFullRows = Cfg::kBlockM % 32 == 0;
  if (w.iters == 0) return;
  const int lane = lane_id();
  const int n0 = w.n_block * Cfg::kBlockN;
  if (lane == 0) {
    mbar_arrive_expect_tx(sm.full_kv(), 2 * Cfg::kKVBytes);
#pragma unroll
    for (int cb = 0; cb < kCB; ++cb)
      tma_load_4d(&a.tm_k, sm.full_kv(), sm.k() + cb * Cfg::kBlockN * 128, cb * 64, n0, w.head_k,
                  w.batch);
#pragma unroll
    for (int cb = 0; cb < kCB; ++cb)
      tma_load_4d(&a.tm_v, sm.full_kv(), sm.v() + cb * Cfg::kBlockN * 128, cb * 64, n0, w.head_k,
                  w.batch);
  }
  const int seqlen_q = a.mask.seqlen_q;
  // The dO ring has its own state only when it has fewer stages (hdim 256).
  constexpr bool kSameStages = Cfg::kStagesDo == Cfg::kStages;
  PipeState<Cfg::kStages> st;
  PipeState<Cfg::kStagesDo> st_do;
  BwdStepWalker walk(w, a.heads_per_kv);
  for (int it = 0; it < w.iters; ++it) {
    const int m0 = walk.mb * Cfg::kBlockM;
    const int64_t stat = (int64_t(w.batch) * a.num_heads + walk.hq) * seqlen_q;
    // The step's statistics, loaded before waiting for the slot.
    float lse[kRowsPerLane], dl[kRowsPerLane];
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int row = m0 + lane + 32 * i;
      lse[i] = INFINITY;
      dl[i] = 0.f;
      if ((kFullRows || lane + 32 * i < Cfg::kBlockM) && row < seqlen_q) {
        const float l = __ldg(a.lse + stat + row);
        lse[i] = l == -INFINITY ? INFINITY : l * kLog2e;
        dl[i] = __ldg(a.delta + stat + row);
      }
    }
    const int s = st.index;
    // Q + LSE
    mbar_wait(sm.empty_q(s), st.phase ^ 1u);
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i)
      if (kFullRows || lane + 32 * i < Cfg::kBlockM) st_shared_f32(sm.lse(s) + 4 * (lane + 32 * i), lse[i]);
    if (lane == 0) {
      mbar_arrive_expect_tx(sm.full_q(s), Cfg::kQBytes);
#pragma unroll
      for (int cb = 0; cb < kCB; ++cb)
        tma_load_4d(&a.tm_q, sm.full_q(s), sm.q(s) + cb * Cfg::kBlockM * 128, cb * 64, m0, walk.hq,
                    w.batch);
    } else {
      mbar_arrive(sm.full_q(s));
    }
    // dO + delta
    const int sd = kSameStages ? s : st_do.index;
    const uint32_t ph_do = kSameStages ? st.phase : st_do.phase;
    mbar_wait(sm.empty_do(sd), ph_do ^ 1u);
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i)
      if (kFullRows || lane + 32 * i < Cfg::kBlockM) st_shared_f32(sm.delta(sd) + 4 * (lane + 32 * i), dl[i]);
    if (lane == 0) {
      mbar_arrive_expect_tx(sm.full_do(sd), Cfg::kQBytes);
#pragma unroll
      for (int cb = 0; cb < kCB; ++cb)
        tma_load_4d(&a.tm_do, sm.full_do(sd), sm.dout(sd) + cb * Cfg::kBlockM * 128, cb * 64, m0,
                    walk.hq, w.batch);
    } else {
      mbar_arrive(sm.full_do(sd));
    }
    __syncwarp();
    st.advance();
    if constexpr (!kSameStages) st_do.advance();
    walk.advance();
  }
}

// ------------------------------------------------------------------ dQ writer
// kDqTensor: lane 0 adds each staged tile with two tensor reductions (boxes
// of kDqRows (64; dQ_swapAB: kBlockM = 80) rows x 32 columns; TMA skips rows
// >= seqlen_q and columns >= head_dim). Else every lane adds rows of it (64
// rows per tile).
template <typename Cfg, bool kDqTensor, bool kDet = false>
JF_DEVICE void bwd_dq_writer(const BwdKernelArgs& a, const BwdSmem<Cfg>& sm, const BwdTile& w) {
  using namespace ptx;
  static_assert(kDqTensor || Cfg::kDqRows == 64, "row reductions: 64-row tiles");
  if (w.iters == 0) return;
  const int lane = lane_id();
  // kDet: query blocks [pred_first, pred_last) also get block n + 1's dQ,
  // which adds first (see the top).
  int pred_first = 0, pred_last = 0;
  if constexpr (kDet)
    dq_pred_range(a.mask, w.n_block, w.num_n_blocks, Cfg::kBlockN, Cfg::kBlockM, pred_first,
                  pred_last);
  // Both staging tiles start out empty.
  named_bar_arrive(kBwdBarDqEmpty + 0, kBwdDqBarThreads);
  named_bar_arrive(kBwdBarDqEmpty + 1, kBwdDqBarThreads);
  const int seqlen_q = a.mask.seqlen_q;
  BwdStepWalker walk(w, a.heads_per_kv);
  // Hand-offs: kDqSlices per step (hdim 256: 2, the WG's columns
  // [128 wg + 64 sl, +64), one after the other through its staging tile).
  const int handoffs = w.iters * Cfg::kDqSlices;
  for (int it = 0; it < handoffs; ++it) {
    const int sl = it % Cfg::kDqSlices;
    const int m0 = walk.mb * Cfg::kBlockM;
    float* dq_bh = a.dq_accum + (int64_t(w.batch) * a.num_heads + walk.hq) *
                                    int64_t(a.seqlen_q_rounded) * a.dq_pitch;
    int* sem = nullptr;
    if constexpr (kDet) {
      sem = a.dq_sem + (int64_t(w.batch) * a.num_heads + walk.hq) * a.sem_m_blocks + walk.mb;
      // The lanes that issue reductions wait for block n + 1's adds (tensor
      // reductions: lane 0 only).
      if (sl == 0 && walk.mb >= pred_first && walk.mb < pred_last && (!kDqTensor || lane == 0)) {
        const int want = w.n_block + 2;
        while (ld_relaxed_gpu(sem) != want) nanosleep_ns(64);
        // Acquire (reads `want` again: only this CTA changes it next, so it
        // synchronizes with block n + 1's release), then order it before this
        // lane's async-proxy reductions.
        (void)ld_acquire_gpu(sem);
        fence_proxy_async_global();
      }
      __syncwarp();
    }
#pragma unroll
    for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg) {
      const int row0 = m0 + (Cfg::kDqSplitM == 2 ? 64 * wg : 0);
      const int col0 = (Cfg::kDqSplitN == 2 ? Cfg::kDqWGCols * wg : 0) + Cfg::kDqCols * sl;
      // Slices entirely past head_dim (hdim 256 bucket, head_dim <= 192) hold
      // zeros: nothing to add. Else head_dim % 8 == 0 and > col0: a positive
      // multiple of 32 bytes.
      const bool cols_in = Cfg::kDqSlices == 1 || col0 < a.head_dim;
      const uint32_t bytes = uint32_t(min(Cfg::kDqCols, a.head_dim - col0)) * 4u;
      named_bar_sync(kBwdBarDqFull + wg, kBwdDqBarThreads);
      if constexpr (kDqTensor) {
        if (lane == 0 && row0 < seqlen_q && cols_in) {  // no box entirely out of bounds
#pragma unroll
          for (int b = 0; b < 2; ++b)
            if (col0 + 32 * b < a.head_dim)
              tma_reduce_add_4d(&a.tm_dqacc, sm.dq(wg) + b * Cfg::kDqRows * 128, col0 + 32 * b, row0,
                                walk.hq, w.batch);
        }
      } else {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int r = lane + 32 * i;
          if (row0 + r < seqlen_q && cols_in)
            bulk_reduce_add_f32(dq_bh + int64_t(row0 + r) * a.dq_pitch + col0,
                                sm.dq(wg) + uint32_t(r * Cfg::kDqPitch * 4), bytes);
        }
      }
      bulk_commit();  // one group per WG tile (possibly empty for this lane)
      __syncwarp();
    }
    if (it + 1 < handoffs) {  // the last hand-back would have no taker
      bulk_wait_read<1>();   // WG 0's tile read out
      __syncwarp();
      named_bar_arrive(kBwdBarDqEmpty + 0, kBwdDqBarThreads);
      bulk_wait_read<0>();
      __syncwarp();
      named_bar_arrive(kBwdBarDqEmpty + 1, kBwdDqBarThreads);
    }
    if constexpr (kDet) {
      if (sl == Cfg::kDqSlices - 1) {  // the tile's reductions issued: announce them once done
        bulk_wait<0>();                // complete (writes performed), not only read out
        fence_proxy_async_global();    // async-proxy writes -> the generic release below
        __syncwarp();
        if (lane == 0) st_release_gpu(sem, w.n_block + 1);
      }
    }
    if (sl == Cfg::kDqSlices - 1) walk.advance();
  }
  bulk_wait<0>();  // every reduction complete before the CTA exits
}

// ------------------------------------------------------------------ consumers
template <int kRows>
struct KMajorStep {  // k-step kk of a K-major [cols/64][kRows][64] tile
  JF_DEVICE uint32_t operator()(int kk) const { return (kk / 4) * kRows * 128 + (kk % 4) * 32; }
};
struct MNMajorStep {  // k-step kk of an MN-major tile: 16 rows of 128 B
  JF_DEVICE uint32_t operator()(int kk) const { return kk * 16 * 128; }
};

// dQ fragment (64 x 64 fp32, both consumers) -> a WG's staging tile.
// kDqTensor: two 128B-swizzled [64][32] boxes (row r's 16-byte chunk c at
// c ^ (r % 8)); the thread's float2 at (r, 8j + 2t) is box j / 4, chunk
// 2 (j % 4) + t / 2, byte 8 (t % 2), and rows r, r + 8 share r % 8. Both
// layouts store without bank conflicts (the row layout only with the padded
// pitch). Else the row-major tile of pitch kDqPitch.
// Byte offset in the WG's staging tile of the float2 dq[4j + 2h], dq[4j + 2h + 1]
// of `lane` (warp `warp`).
template <typename Cfg, bool kDqTensor>
JF_DEVICE uint32_t dq_stage_offset(int warp, int lane, int j, int h) {
  if constexpr (kDqTensor) {
    const int t = lane % 4;
    const uint32_t row_addr = uint32_t((16 * warp + lane / 4) * 128 + 8 * (t % 2));
    const uint32_t sw = uint32_t(lane / 4) << 4;  // (r % 8) << 4
    return row_addr + uint32_t((j / 4) * 64 * 128) + ((uint32_t(2 * (j % 4) + t / 2) << 4) ^ sw) +
           uint32_t(h * 8 * 128);
  } else {
    const int row = 16 * warp + lane / 4;
    return uint32_t((row * Cfg::kDqPitch + 2 * (lane % 4)) * 4) +
           uint32_t((8 * h * Cfg::kDqPitch + 8 * j) * 4);
  }
}

// &a when kInPlace, else &b (b sized kN when used).
template <bool kInPlace, int kN, int kM>
JF_DEVICE float (*select_p(float (*a)[kN], float (*b)[kM]))[kN] {
  if constexpr (kInPlace) {
    return a;
  } else {
    static_assert(kM == kN, "separate P buffer");
    return b;
  }
}

// kPacked: packed sequences (tile spans; fwd_tuning.h `packed`): the
// spans' query-block ranges and masks, in kernels of their own.
template <typename Element, typename Cfg, bool kSoftcap, bool kDqTensor, bool kPacked = false>
struct BwdConsumer {
  static_assert(Cfg::kStagesDo == Cfg::kStages, "one stage index for Q and dO");
  static constexpr int kD = Cfg::kHeadDim;
  static constexpr int kBM = Cfg::kBlockM;
  static constexpr int kBN = Cfg::kBlockN;
  static constexpr int kSR = kBM / 2;   // S^T / dP^T registers (64 x kBlockM)
  static constexpr int kKR = kD / 2;    // dK / dV registers (64 x D)
  // dQ registers: 64 x 64 (dQ_swapAB: dQ^T, 64 columns x kBlockM queries)
  static constexpr int kQR = Cfg::kDqSwapAB ? kBM / 2 : Cfg::kDqCols / 2;
  static_assert(!Cfg::kDqSwapAB || kDqTensor, "dQ_swapAB: tensor reductions only");
  static constexpr int kPK = kBM / 16;  // k-steps of dV / dK (P^T, dS^T fragments)
  // Segment-id mask: 0 = fully unrolled (the -inf writes interleaved with the
  // loads); kBlockM 80 with softcap: mismatch bits in 2 batches of 5 query
  // pairs (fully unrolled, the 20 query ids in flight spill 36 bytes there).
  static constexpr int kMaskSegUnroll = (kSoftcap && Cfg::kDqSwapAB) ? 5 : 0;

  const BwdKernelArgs& a;
  const BwdSmem<Cfg>& sm;
  int wg, warp, lane;

  // Every thread arrives on an "empty" barrier (BwdConfig::kEmptyArrivals),
  // after its wgmma wait and its last read of the stage.
  JF_DEVICE void release(uint32_t bar) const { ptx::mbar_arrive(bar); }
  JF_DEVICE void wait_full(uint32_t bar, uint32_t phase) const {
    ptx::mbar_wait(bar, phase);
    __syncwarp();
  }

  // Descriptors of k-step 0 of each GEMM (static: also used by the host-side
  // layout check). The k-step offsets are KMajorStep / MNMajorStep.
  // S^T (or dP^T) = A_wg B^T: A = rows [64 wg, 64 wg + 64) of a K-major
  // [D/64][kBlockN][64] tile (K or V), B = a K-major [D/64][kBlockM][64] tile
  // (Q or dO).
  static JF_DEVICE uint64_t sdp_desc_a(int wg, uint32_t a_tile) {
    return ptx::make_desc(ptx::kDescKMajor, a_tile + 64 * wg * 128);
  }
  static JF_DEVICE uint64_t sdp_desc_b(uint32_t b_tile) { return ptx::make_desc(ptx::kDescKMajor, b_tile); }
  using SdpStepA = KMajorStep<kBN>;
  using SdpStepB = KMajorStep<kBM>;
  // dV += P^T dO (or dK += dS^T Q): A from registers (K = kBlockM queries),
  // B = an MN-major [D/64][kBlockM][64] tile (dO or Q), N = D.
  static JF_DEVICE uint64_t dkv_desc_b(uint32_t b_tile) {
    return ptx::make_desc(ptx::desc_mn_major<kBM>(), b_tile);
  }
  using DkvStepB = MNMajorStep;
  // dQ tile of this WG = dS[rows] K[:, cols]: A = dS rows [64 wgM, +64) of
  // the K-major [kBlockN/64][kBlockM][64] dS buffer, B = column block wgN of
  // K ([D/64][kBlockN][64], MN-major), N = 64, K = kBlockN keys.
  static constexpr int dq_wg_m(int wg) { return Cfg::kDqSplitM == 2 ? wg : 0; }
  static constexpr int dq_wg_n(int wg) { return Cfg::kDqSplitN == 2 ? wg : 0; }
  static JF_DEVICE uint64_t dq_desc_a(int wg, uint32_t ds_tile) {
    return ptx::make_desc(ptx::kDescKMajor, ds_tile + 64 * dq_wg_m(wg) * 128);
  }
  static JF_DEVICE uint64_t dq_desc_b(int wg, uint32_t k_tile) {
    return ptx::make_desc(ptx::desc_mn_major<kBN>(), k_tile + dq_wg_n(wg) * kBN * 128);
  }
  using DqStepA = KMajorStep<kBM>;
  using DqStepB = MNMajorStep;
  // dQ_swapAB: dQ^T[cols of WG wg] = K[:, cols]^T dS^T, the same two tiles
  // with the roles swapped: A (m = column, k = key) = dq_desc_b (K, read
  // MN-major: tnspA; M = 64 = one column block), B (n = query, k = key) =
  // dq_desc_a (all kBlockM rows of dS, K-major; kDqSplitM = 1 so its row
  // offset is 0), N = kBlockM.

  // Issue only (no commit / wait).
  JF_DEVICE void issue_sdp(float (&acc)[kSR], uint32_t a_tile, uint32_t b_tile) const {
    ptx::gemm_ss<Element, kBM, 0, kD / 16>(acc, sdp_desc_a(wg, a_tile), sdp_desc_b(b_tile), SdpStepA{},
                                           SdpStepB{}, true);
  }
  JF_DEVICE void issue_dkv(float (&acc)[kKR], const uint32_t (&frag)[kPK][4], uint32_t b_tile) const {
    ptx::gemm_rs<Element, kD, 1, kPK>(acc, frag, dkv_desc_b(b_tile), DkvStepB{}, false);
  }
  JF_DEVICE void issue_dq(float (&acc)[kQR], uint32_t ds_tile) const {
    if constexpr (Cfg::kDqSwapAB) {
      ptx::gemm_ss<Element, kBM, 0, kBN / 16, 1>(acc, dq_desc_b(wg, sm.k()), dq_desc_a(wg, ds_tile), DqStepB{},
                                                DqStepA{}, true);
    } else {
      ptx::gemm_ss<Element, Cfg::kDqCols, 1, kBN / 16>(acc, dq_desc_a(wg, ds_tile), dq_desc_b(wg, sm.k()),
                                                        DqStepA{}, DqStepB{}, true);
    }
  }

  // dS^T (accumulator layout, packed as A fragments) -> the dS buffer
  // (queries x keys, 128B-swizzled K-major), transposing with stmatrix:
  // fragment k covers queries 16k..16k+15 (matrices i = 0..3: queries
  // 16k + 8 (i / 2) + 0..7, keys 64 wg + 16 warp + 8 (i % 2) + 0..7).
  // Byte offset in the dS buffer of the row address that `lane` (warp `warp`
  // of consumer WG `wg`) gives to the stmatrix of fragment k (also used by
  // the host-side layout check, cuda/tests/sm90_bwd_layout_check.cpp).
  static JF_DEVICE uint32_t ds_offset(int wg, int warp, int lane, int k) {
    const int i = lane / 8, c = lane % 8;
    return uint32_t(wg * kBM * 128) + uint32_t((8 * (i / 2) + c) * 128) +
           (uint32_t((2 * warp + (i % 2)) ^ c) << 4) + uint32_t(k * 16 * 128);
  }
  JF_DEVICE void store_ds(const uint32_t (&dsf)[kPK][4], uint32_t ds_tile) const {
#pragma unroll
    for (int k = 0; k < kPK; ++k)
      ptx::stmatrix_x4_trans(ds_tile + ds_offset(wg, warp, lane, k), dsf[k][0], dsf[k][1], dsf[k][2],
                             dsf[k][3]);
  }

  // dQ fragment (64 x 64 fp32) -> the WG's staging tile (dq_stage_offset).
  static JF_DEVICE uint32_t dq_offset(int warp, int lane, int j, int h) {
    return dq_stage_offset<Cfg, kDqTensor>(warp, lane, j, h);
  }
  // dQ_swapAB: dQ^T fragment (64 columns x kBlockM queries) -> the WG's
  // staging tile, two 128B-swizzled [kDqRows][32] fp32 boxes (row = query):
  // dq[4j + 2h + e] = dQ[query 8j + 2t + e][column 16 warp + g + 8h] at box
  // c / 32, row q, chunk (c % 32) / 4 ^ (q % 8), word c % 4. One 4-byte store
  // per element; a warp's 32 stores of one register hit 32 distinct banks
  // (g % 4: the word; g / 4 and the query's q % 8 = 2t + e: 8 distinct
  // chunks, since the chunk base (16 warp + 8h) / 4 is even).
  static JF_DEVICE uint32_t dq_t_offset(int warp, int lane, int j, int h, int e) {
    const int c = 16 * warp + lane / 4 + 8 * h, q = 8 * j + 2 * (lane % 4) + e;
    return uint32_t((c / 32) * Cfg::kDqRows * 128 + q * 128) +
           ((uint32_t((c % 32) / 4) ^ uint32_t(q % 8)) << 4) + uint32_t((c % 4) * 4);
  }
  JF_DEVICE void store_dq(const float (&dq)[kQR]) const {
    if constexpr (Cfg::kDqSwapAB) {
#pragma unroll
      for (int j = 0; j < kQR / 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            ptx::st_shared_f32(sm.dq(wg) + dq_t_offset(warp, lane, j, h, e), dq[4 * j + 2 * h + e]);
    } else {
#pragma unroll
      for (int j = 0; j < kQR / 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          ptx::st_shared_v2_f32(sm.dq(wg) + dq_offset(warp, lane, j, h), dq[4 * j + 2 * h],
                                dq[4 * j + 2 * h + 1]);
    }
  }

  // dK (scaled) / dV fragment -> rows [64 wg, +64) of a [D/64][kBlockN][64]
  // 128B-swizzled tile (the K / V buffer), 16-bit.
  // Byte offset in the tile of the packed pair acc[4j + 2h], acc[4j + 2h + 1].
  static JF_DEVICE uint32_t kv_offset(int wg, int warp, int lane, int j, int h) {
    const int row = 64 * wg + 16 * warp + lane / 4;  // h = 0; row % 8 == lane / 4
    const uint32_t row_addr = uint32_t(row * 128 + 4 * (lane % 4));
    const uint32_t sw = uint32_t(lane / 4) << 4;
    return row_addr + uint32_t((j / 8) * kBN * 128) + ((uint32_t(j % 8) << 4) ^ sw) +
           uint32_t(h * 8 * 128);
  }
  JF_DEVICE void store_kv_tile(const float (&acc)[kKR], uint32_t tile) const {
#pragma unroll
    for (int j = 0; j < kD / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        ptx::st_shared_b32(tile + kv_offset(wg, warp, lane, j, h),
                           ptx::pack2<Element>(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
  }

  JF_DEVICE void run(const BwdTile& w) const {
    using namespace ptx;
    float dk[kKR], dv[kKR];
#pragma unroll
    for (int i = 0; i < kKR; ++i) dk[i] = dv[i] = 0.f;
    const int n0 = w.n_block * kBN;

    if (w.iters > 0) {
      wait_full(sm.full_kv(), 0);
      const float scale_log2 = a.sm.scale_log2;
      const float softcap_pre = kSoftcap ? a.sm.softcap_pre : 0.f;
      PipeState<Cfg::kStages> st;
      BwdStepWalker walk(w, a.heads_per_kv);
      for (int it = 0; it < w.iters; ++it) {
        const int m0 = walk.mb * kBM;
        const int s = st.index;
        // Accumulators overwritten by their first wgmma (scale-d = 0). Declared
        // per step: their values are dead between steps (declared outside the
        // loop, the wgmma's "+f" operands would keep them live across it).
        float sc[kSR], dp[kSR], dq[kQR];

        // ---- S^T = K Q^T, dP^T = V dO^T
        wait_full(sm.full_q(s), st.phase);
        wgmma_fence();
        issue_sdp(sc, sm.k(), sm.q(s));
        wgmma_commit();
        wait_full(sm.full_do(s), st.phase);
        wgmma_fence();  // (after the wait loop's branch: ptxas wants it adjacent)
        issue_sdp(dp, sm.v(), sm.dout(s));
        wgmma_commit();
        wgmma_wait<1>();  // S^T ready (dP^T may still run)
        fence_regs(sc);

        // ---- P^T, dS^T. Column (query) statistics from the stat stage:
        // this thread's queries are 8j + 2t + {0, 1}.
        const uint32_t lse_addr = sm.lse(s) + 8 * (lane % 4);
        const uint32_t dl_addr = sm.delta(s) + 8 * (lane % 4);
        // (kSoftcap is a template parameter: with the wgmma waits under one
        // run-time condition ptxas cannot prove dP^T complete where it is read
        // and serialises the wgmma pipeline, warning C7514.)
        if constexpr (kSoftcap) {  // tanh' needs the finite scores: before the mask
          wgmma_wait<0>();
          fence_regs(dp);
#pragma unroll
          for (int j = 0; j < kSR / 4; ++j) {
            const float2 d2 = ld_shared_v2_f32(dl_addr + 32 * j);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int i0 = 4 * j + 2 * h;
              const float t0 = tanh_approx(sc[i0] * softcap_pre);
              const float t1 = tanh_approx(sc[i0 + 1] * softcap_pre);
              sc[i0] = t0;
              sc[i0 + 1] = t1;
              dp[i0] = (dp[i0] - d2.x) * (1.f - t0 * t0);
              dp[i0 + 1] = (dp[i0 + 1] - d2.y) * (1.f - t1 * t1);
            }
          }
        }
        if constexpr (kPacked) {
          if (a.mask.block_needs_mask(w.batch, m0, kBM, n0 + 64 * wg, 64))
            apply_mask_t<true, kMaskSegUnroll>(sc, a.mask, w.batch, n0 + 64 * wg + 16 * warp + lane / 4,
                                               m0 + 2 * (lane % 4), a.mask.keys_exact(w.batch, n0 + 64 * wg, 64));
        } else {
          if (a.mask.block_needs_mask_by_position(m0, kBM, n0 + 64 * wg, 64))
            apply_mask_t<false, kMaskSegUnroll>(sc, a.mask, w.batch, n0 + 64 * wg + 16 * warp + lane / 4,
                                                m0 + 2 * (lane % 4), false);
        }
        // P^T into its own registers: ptxas holds back writes to the S^T
        // accumulator registers (in place) until every wgmma in flight is done,
        // which would serialise this with the dP^T GEMM.
        // (With softcap the dP^T GEMM is already waited for: P^T in place,
        // which keeps the hdim-64 softcap kernel within its registers.)
        float pr_own[kSoftcap ? 1 : kSR];
        float(&pr)[kSR] = *select_p<kSoftcap>(&sc, &pr_own);
#pragma unroll
        for (int j = 0; j < kSR / 4; ++j) {
          const float2 l2 = ld_shared_v2_f32(lse_addr + 32 * j);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int i0 = 4 * j + 2 * h;
            pr[i0] = exp2_approx(fmaf(sc[i0], scale_log2, -l2.x));
            pr[i0 + 1] = exp2_approx(fmaf(sc[i0 + 1], scale_log2, -l2.y));
          }
        }
        if constexpr (!kSoftcap) {
          fence_regs(pr);   // P^T computed while the dP^T GEMM runs (not sunk below the wait)
          wgmma_wait<0>();  // dP^T ready
          fence_regs(dp);
#pragma unroll
          for (int j = 0; j < kSR / 4; ++j) {
            const float2 d2 = ld_shared_v2_f32(dl_addr + 32 * j);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int i0 = 4 * j + 2 * h;
              dp[i0] = pr[i0] * (dp[i0] - d2.x);
              dp[i0 + 1] = pr[i0 + 1] * (dp[i0 + 1] - d2.y);
            }
          }
        } else {
#pragma unroll
          for (int i = 0; i < kSR; ++i) dp[i] *= pr[i];
        }

        // ---- 16-bit P^T, dS^T fragments; dS -> shared memory
        uint32_t pf[kPK][4], dsf[kPK][4];
        acc_to_a<Element>(pr, pf);
        acc_to_a<Element>(dp, dsf);
        const uint32_t ds_tile = sm.ds(it & 1);
        store_ds(dsf, ds_tile);

        // ---- dV += P^T dO
        fence_regs(pf);
        fence_regs(dv);
        wgmma_fence();
        issue_dkv(dv, pf, sm.dout(s));
        wgmma_commit();

        // ---- dQ = dS K once both WGs' dS are in shared memory
        fence_proxy_async_smem();  // stmatrix (generic proxy) -> wgmma reads (async proxy)
        named_bar_sync(kBwdBarPdS, 256);
        wgmma_fence();
        issue_dq(dq, ds_tile);
        wgmma_commit();
        wgmma_wait<1>();  // dV done: dO is free
        fence_regs(dv);
        fence_regs(pf);
        release(sm.empty_do(s));

        // ---- dK += dS^T Q
        fence_regs(dsf);
        fence_regs(dk);
        wgmma_fence();
        issue_dkv(dk, dsf, sm.q(s));
        wgmma_commit();
        wgmma_wait<1>();  // dQ done
        fence_regs(dq);

        // ---- dQ -> staging tile -> (writer warp) dq_accum
        named_bar_sync(kBwdBarDqEmpty + wg, kBwdDqBarThreads);
        store_dq(dq);
        fence_proxy_async_smem();  // st.shared -> bulk copy reads
        named_bar_arrive(kBwdBarDqFull + wg, kBwdDqBarThreads);

        wgmma_wait<0>();  // dK done: Q is free
        fence_regs(dk);
        fence_regs(dsf);
        release(sm.empty_q(s));
        st.advance();
        walk.advance();
      }
    }

    // ---- epilogue: dK * scale, dV -> 16-bit -> the K / V tiles -> TMA store
    const float scale = a.scale;
#pragma unroll
    for (int i = 0; i < kKR; ++i) dk[i] *= scale;
    named_bar_sync(kBwdBarEpi, 256);  // both WGs are past their last GEMM on K and V
    store_kv_tile(dk, sm.k());
    store_kv_tile(dv, sm.v());
    fence_proxy_async_smem();
    named_bar_sync(kBwdBarEpiWG + wg, 128);
    if (warp == 0 && lane == 0 && n0 + 64 * wg < a.mask.seqlen_k) {
#pragma unroll
      for (int cb = 0; cb < kD / 64; ++cb) {
        tma_store_4d(&a.tm_dk, sm.k() + cb * kBN * 128 + 64 * wg * 128, cb * 64, n0 + 64 * wg,
                     w.head_k, w.batch);
        tma_store_4d(&a.tm_dv, sm.v() + cb * kBN * 128 + 64 * wg * 128, cb * 64, n0 + 64 * wg,
                     w.head_k, w.batch);
      }
      bulk_commit();
      bulk_wait<0>();  // stores done before the CTA's shared memory goes away
    }
    __syncwarp();
  }
};

}  // namespace jax_flash::sm90
