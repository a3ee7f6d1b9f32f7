// The sm90 backward kernel (FlashAttention-3 style: dK, dV, and dQ into the
// fp32 dq_accum workspace, of one KV block per CTA), composed as Mainloop x
// Epilogue x TileScheduler like the forward (fwd_kernel.cuh; FA3's
// hopper/flash_bwd_kernel_sm90.h):
//   BwdMainloop   (bwd_mainloop.cuh)   producer warp, dQ writer warp
//                                      (bwd_dq.cuh), consumer sweep with the
//                                      config's work split (bwd_key_split.cuh,
//                                      bwd_column_split.cuh)
//   BwdEpilogue   (bwd_epilogue.cuh)   dK * scale, dV -> 16-bit -> TMA store
//   TileScheduler (tile_scheduler.cuh) BwdTileScheduler<kDet>: one tile per CTA
// Each part has host Arguments -> device Params (to_params). The parts' Params
// are fields of one block, BwdKernelArgs (bwd_config.cuh), whose order
// interleaves the parts: the kernels' code addresses each parameter by its
// offset in that block. The shared memory is the config's plan (BwdSmem).
//
// Grid: one CTA per (KV block of kBlockN keys: 128, hdim 256: 64, the pair
// 192 / 128: 96, kv head, batch), in the order of BwdTileOrder
// (tile_scheduler.cuh; causal: heaviest KV blocks first). CTA = 384 threads:
//   warpgroup 0 (setmaxnreg.dec 24): warp 0 = producer (TMA of K, V once and
//     of the Q / dO ring, LSE / delta stages), warp 1 = dQ writer (bulk
//     reduce-add of the staged dQ tiles into dq_accum), warps 2-3 idle (with
//     producer-drawn dropout masks, BwdDropoutConfig kDropProducer, they
//     draw them: setmaxnreg.dec 32);
//   warpgroups 1, 2 (setmaxnreg.inc 240): consumers (hdim 64 / 128: 64 keys
//     each; hdim 256: 128 of the 256 columns each; the pair 192 / 128: 48 keys
//     each, dK^T and dV^T), dK and dV in registers for the whole sweep, then
//     the epilogue (the TMA store clips the seq and head-dim tails).
// The sweep covers every (q head of the GQA group, visible query block), so
// GQA sums stay in registers. dQ is accumulated with fp32 bulk reductions in
// an order that depends on timing, except with kDet (BwdParams::deterministic):
// then the KV blocks add into each dQ tile in descending order, through
// semaphores in global memory (bwd_dq.cuh), the KV blocks are scheduled in
// descending order (BwdTileOrder<true>) and each CTA takes its tile index from
// a counter (ClaimedSingleTileScheduler: in the order in which CTAs start, so
// a CTA only ever waits for a smaller index, held by a running or finished
// CTA, whatever order the hardware launches the blocks in).
//
// Synchronisation:
//   mbarriers  full_kv (1 arrival + K/V bytes; waited with parity 0 once),
//              full_q/full_do[s] (32 producer lanes + TMA bytes),
//              empty_q/empty_do[s] (every consumer thread); dO: 1 stage for hdim 256;
//   named      PdS (256: both consumer WGs wrote dS), dQFull/dQEmpty + wg
//              (160: consumer WG + writer warp), Epi (256), EpiWG + wg (128).
#pragma once

#include "bwd_epilogue.cuh"
#include "bwd_mainloop.cuh"
#include "sm90/ptx/barrier.cuh"

namespace jax_flash::sm90 {

template <typename Mainloop_, typename Epilogue_, typename Scheduler_>
struct BwdKernel {
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  using Scheduler = Scheduler_;
  using Cfg = typename Mainloop::Cfg;
  static constexpr int kThreads = Cfg::kThreads;
  static constexpr int kSmemAlloc = Cfg::kSmemAlloc;
  static_assert(Scheduler::kOneTilePerCta, "the roles process one tile per CTA");
  static_assert(Scheduler::kNumBarriers == 0 && Scheduler::kDataBytes <= 4,
                "the scheduler's data fits the plan's slack (BwdSmem::claim_slot)");

  // ---------------------------------------------------------------- host -> device
  struct Arguments {
    typename Mainloop::Arguments mainloop;
    typename Epilogue::Arguments epilogue;
    typename Scheduler::Arguments scheduler;
  };
  using Params = BwdKernelParams<Scheduler>;
  static bool to_params(const Arguments& a, Params& p) {
    if (!Mainloop::to_params(a.mainloop, p.args)) return false;
    if (!Epilogue::to_params(a.epilogue, p.args)) return false;
    p.scheduler = Scheduler::to_params(a.scheduler);
    return true;
  }

  // ---------------------------------------------------------------- device
  JF_DEVICE static void run(const Params& params, char* smem_raw) {
    const BwdKernelArgs& args = params.args;
    BwdSmem<Cfg> sm;
    sm.base = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;
    const typename Scheduler::Smem sched{0u, sm.claim_slot()};  // no scheduler barriers

    const int warp = ptx::warp_id_uniform();
    if (threadIdx.x == 0) {
      Mainloop::init_barriers(sm);
      ptx::mbar_fence_init();
      Mainloop::prefetch_descriptors(args);
    }
    // Another warp than the barrier set-up's, so the claim's latency overlaps it.
    if (threadIdx.x == 32) Scheduler::claim_first(params.scheduler, sched);
    __syncthreads();

    // grid_size() CTAs, each with one valid tile (kOneTilePerCta).
    const WorkTile work = Scheduler::initial_work(params.scheduler, sched);
    const BwdTile tile =
        Mainloop::tile(args, Scheduler::coord(params.scheduler, work), params.scheduler.order.num_blocks);
    if (warp < 4) {  // producer warpgroup
      ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
      if (warp == 0) {
        Mainloop::load(args, sm, tile);
      } else if (warp == 1) {
        Mainloop::store_dq(args, sm, tile);
      } else if constexpr (Cfg::kDropProducer) {
        Mainloop::draw_masks(args, sm, tile, int(threadIdx.x) - 64);  // warps 2-3
      }
    } else {
      ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
      // The consumer warpgroup as its work split sees it: Params, smem plan, WG, warp, lane.
      const int tid_wg = threadIdx.x % 128;
      Mainloop::template consume<Epilogue>({args, sm, warp / 4 - 1, tid_wg / 32, tid_wg % 32}, tile);
    }
  }
};

// The kernel of one (element type, config, variant): kSoftcap, kDqTensor (dQ
// by TMA tensor reductions, else by row bulk reductions: measurements only),
// kDet (deterministic dQ order), kPacked (packed sequences).
template <typename Element, typename Cfg, bool kSoftcap, bool kDqTensor, bool kDet, bool kPacked>
struct BwdKernelFor {
  using Mainloop = BwdMainloop<Element, Cfg, kSoftcap, kDqTensor, kDet, kPacked>;
  using type = BwdKernel<Mainloop, BwdEpilogue<Mainloop>, BwdTileScheduler<kDet>>;
};

// The __global__ entry of BwdKernelFor<...>::type (its Params are
// BwdKernelParams<BwdTileScheduler<kDet>>).
template <typename Element, typename Cfg, bool kSoftcap, bool kDqTensor, bool kDet = false,
          bool kPacked = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    bwd_kernel(const __grid_constant__ BwdKernelParams<BwdTileScheduler<kDet>> params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  BwdKernelFor<Element, Cfg, kSoftcap, kDqTensor, kDet, kPacked>::type::run(params, smem_raw);
#else
  // Built for another target: this kernel needs sm_90a (wgmma, setmaxnreg).
  __trap();
#endif
}

}  // namespace jax_flash::sm90
