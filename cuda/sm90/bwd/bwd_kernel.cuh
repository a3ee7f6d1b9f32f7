// FlashAttention-3 style backward for Hopper (sm_90a): dK, dV (and dQ into
// the fp32 dq_accum workspace) of one KV block per CTA.
//
// Grid: one CTA per (KV block of kBlockN keys: 128, hdim 256: 64, kv head,
// batch), in the order of BwdTileOrder (tile_scheduler.cuh; causal: heaviest
// KV blocks first). CTA = 384 threads:
//   warpgroup 0 (setmaxnreg.dec 24): warp 0 = producer (TMA of K, V once and
//     of the Q / dO ring, LSE / delta stages), warp 1 = dQ writer (bulk
//     reduce-add of the staged dQ tiles into dq_accum), warps 2-3 idle;
//   warpgroups 1, 2 (setmaxnreg.inc 240): consumers, 64 keys each (hdim 256:
//     128 of the 256 columns each), dK and dV in registers for the whole
//     sweep (bwd_mainloop.cuh; hdim 256: bwd_consumer_hd256.cuh), then the epilogue
//     (dK * scale, dV -> 16-bit -> the K / V tiles -> TMA store, which clips
//     the seq and head-dim tails).
// The sweep covers every (q head of the GQA group, visible query block), so
// GQA sums stay in registers. dQ is accumulated with fp32 bulk reductions in
// an order that depends on timing, except with kDet (BwdParams::deterministic):
// then the KV blocks add into each dQ tile in descending order, through
// semaphores in global memory (bwd_mainloop.cuh, bwd_dq_writer), the KV blocks
// are scheduled in descending order (BwdTileOrder<true>) and each CTA takes
// its tile index from a counter (ClaimedSingleTileScheduler: in the order in
// which CTAs start, so a CTA only ever waits for a smaller index, held by a
// running or finished CTA, whatever order the hardware launches the blocks in).
//
// Synchronisation:
//   mbarriers  full_kv (1 arrival + K/V bytes; waited with parity 0 once),
//              full_q/full_do[s] (32 producer lanes + TMA bytes),
//              empty_q/empty_do[s] (8 consumer warps); dO: 1 stage for hdim 256;
//   named      PdS (256: both consumer WGs wrote dS), dQFull/dQEmpty + wg
//              (160: consumer WG + writer warp), Epi (256), EpiWG + wg (128).
#pragma once

#include <type_traits>

#include "bwd_consumer_hd256.cuh"
#include "bwd_mainloop.cuh"

namespace jax_flash::sm90 {

// The consumer warpgroups of the config's work split (bwd_config.cuh).
template <typename Element, typename Cfg, bool kSoftcap, bool kDqTensor, bool kPacked>
using BwdConsumerFor =
    std::conditional_t<Cfg::kSdpSwapAB, BwdConsumer<Element, Cfg, kSoftcap, kDqTensor, kPacked>,
                       BwdConsumerHd256<Element, Cfg, kSoftcap, kDqTensor, kPacked>>;

// kPacked: packed sequences (the tile spans of segment ids; BwdConsumer).
template <typename Element, typename Cfg, bool kSoftcap, bool kDqTensor, bool kDet = false,
          bool kPacked = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    bwd_kernel(const __grid_constant__ BwdKernelParams<BwdTileScheduler<kDet>> params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Scheduler = BwdTileScheduler<kDet>;
  static_assert(Scheduler::kOneTilePerCta, "the roles process one tile per CTA");
  static_assert(Scheduler::kNumBarriers == 0 && Scheduler::kDataBytes <= 4,
                "the scheduler's data fits the plan's slack (BwdSmem::claim_slot)");
  const BwdKernelArgs& args = params.args;
  extern __shared__ __align__(1024) char smem_raw[];
  BwdSmem<Cfg> sm;
  sm.base = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;
  const typename Scheduler::Smem sched{0u, sm.claim_slot()};  // no scheduler barriers

  const int warp = ptx::warp_id_uniform();
  if (threadIdx.x == 0) {
    ptx::mbar_init(sm.full_kv(), 1);
#pragma unroll
    for (int s = 0; s < Cfg::kStages; ++s) {
      ptx::mbar_init(sm.full_q(s), Cfg::kFullArrivals);
      ptx::mbar_init(sm.empty_q(s), Cfg::kEmptyArrivals);
      if (s < Cfg::kStagesDo) {
        ptx::mbar_init(sm.full_do(s), Cfg::kFullArrivals);
        ptx::mbar_init(sm.empty_do(s), Cfg::kEmptyArrivals);
      }
    }
    ptx::mbar_fence_init();
    ptx::prefetch_tmap(&args.tm_q);
    ptx::prefetch_tmap(&args.tm_k);
    ptx::prefetch_tmap(&args.tm_v);
    ptx::prefetch_tmap(&args.tm_do);
    if constexpr (kDqTensor) ptx::prefetch_tmap(&args.tm_dqacc);
  }
  // Another warp than the barrier set-up's, so the claim's latency overlaps it.
  if (threadIdx.x == 32) Scheduler::claim_first(params.scheduler, sched);
  __syncthreads();

  // grid_size() CTAs, each with one valid tile (kOneTilePerCta).
  const WorkTile work = Scheduler::initial_work(params.scheduler, sched);
  const BwdTile tile =
      make_bwd_tile<Cfg, kPacked>(args, Scheduler::coord(params.scheduler, work),
                                  params.scheduler.order.num_blocks);
  if (warp < 4) {  // producer warpgroup
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (warp == 0) {
      bwd_producer<Cfg>(args, sm, tile);
    } else if (warp == 1) {
      bwd_dq_writer<Cfg, kDqTensor, kDet>(args, sm, tile);
    }
  } else {
    ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
    const int tid_wg = threadIdx.x % 128;
    const BwdConsumerFor<Element, Cfg, kSoftcap, kDqTensor, kPacked> c{args, sm, warp / 4 - 1, tid_wg / 32,
                                                                     tid_wg % 32};
    c.run(tile);
  }
#else
  // Built for another target: this kernel needs sm_90a (wgmma, setmaxnreg).
  __trap();
#endif
}

}  // namespace jax_flash::sm90
