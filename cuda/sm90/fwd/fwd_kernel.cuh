// The sm90 forward kernel, composed as Mainloop x Epilogue x TileScheduler
// (the pattern of FA3's hopper/flash_fwd_kernel_sm90.h):
//   FwdMainloop   (mainloop.cuh)       TMA producer + consumer GEMM/softmax pipeline
//   FwdEpilogue   (epilogue.cuh)       O / LSE store, where O is staged
//   TileScheduler (tile_scheduler.cuh) the persistent sequence of work tiles
// Each part has host Arguments -> device Params (to_params) and its own
// shared memory (tiles and/or mbarriers); FwdKernel composes the Params and
// the SharedStorage and runs the roles.
//
// CTA = 1 producer warpgroup + kConsumerWGs consumer warpgroups, persistent
// over tiles. Roles split once, at the top:
//   producer (setmaxnreg.dec): one thread issues the TMA loads and decides the
//     tile sequence; it never touches a register-heavy fragment; 8-bit: warps
//     1..3 of the producer warpgroup transpose each V stage (mainloop.cuh);
//     dropout with the producer mask: warps 1..3 draw the keep masks;
//   consumers (setmaxnreg.inc): wgmma + online softmax on 64 query rows each,
//     then the epilogue.
// Synchronisation: mbarriers for data (full_q/empty_q, full/empty per K and V
// stage, the scheduler's hand-off, o_free), named barriers for the pingpong
// turns and the per-WG epilogue (fwd_named_barriers.h).
#pragma once

#include <type_traits>

#include "epilogue.cuh"
#include "fwd_tuning.h"
#include "mainloop.cuh"
#include "sm90/common/tile_scheduler.cuh"

namespace jax_flash::sm90 {

template <typename Mainloop_, typename Epilogue_, typename Scheduler_>
struct FwdKernel {
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  using Scheduler = Scheduler_;
  static constexpr int kConsumerWGs = Mainloop::kConsumerWGs;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  // Register budgets after setmaxnreg (FA3: 24/240 with 2 consumer WGs,
  // 32/160 with 3). They must fit the registers the CTA is launched with:
  // __launch_bounds__(kThreads, 1) caps ptxas at 65536 / kThreads rounded
  // down to a multiple of 8 per thread (168 x 384 = 64512 with two consumer
  // WGs), and a setmaxnreg.inc beyond what the other warps gave back waits
  // forever. The mask warps' generator (Philox state, key, positions) needs
  // 32, so with two consumer WGs they get 232.
  static constexpr int kProducerRegs = kConsumerWGs == 2 && !Mainloop::kDropMask ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumerWGs == 2 ? (Mainloop::kDropMask ? 232 : 240) : 160;
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static_assert(128 * (kProducerRegs + kConsumerWGs * kConsumerRegs) <= kLaunchRegs * kThreads,
                "setmaxnreg budgets beyond the CTA's launch allocation deadlock");

  // ---------------------------------------------------------------- shared memory
  // [mainloop tiles][epilogue tile][mainloop barriers][epilogue barriers]
  // [scheduler barriers][scheduler data], from a 1 KB aligned base.
  struct SharedStorage {
    static constexpr int kOffMainloop = 0;
    static constexpr int kOffEpilogue = kOffMainloop + Mainloop::kTileBytes;
    static constexpr int kOffMainloopBars = kOffEpilogue + Epilogue::kTileBytes;
    static constexpr int kOffEpilogueBars = kOffMainloopBars + 8 * Mainloop::kNumBarriers;
    static constexpr int kOffSchedulerBars = kOffEpilogueBars + 8 * Epilogue::kNumBarriers;
    static constexpr int kOffSchedulerData = kOffSchedulerBars + 8 * Scheduler::kNumBarriers;
    static constexpr int kBytes = kOffSchedulerData + Scheduler::kDataBytes;
    static constexpr int kAlloc = kBytes + 1024;  // + slack to align the base to 1 KB
    static_assert(kOffEpilogue % 1024 == 0, "128B-swizzled tiles must start 1 KB aligned");
    static_assert(kBytes <= kFwdSmemLimit + 256, "shared memory plan too large");

    uint32_t base;  // 1 KB-aligned shared-window address

    JF_DEVICE typename Mainloop::Smem mainloop() const {
      return {base + kOffMainloop, base + kOffMainloopBars, base + kOffEpilogueBars};
    }
    JF_DEVICE typename Epilogue::Smem epilogue() const {
      const typename Mainloop::Smem ml = mainloop();
      const uint32_t o = Epilogue::kOStage == Epilogue::kInV  ? ml.v(0)
                         : Epilogue::kOStage == Epilogue::kInQ ? ml.q()
                                                               : base + kOffEpilogue;
      return {o, base + kOffEpilogueBars, ml.empty_q()};
    }
    JF_DEVICE typename Scheduler::Smem scheduler() const {
      return {base + kOffSchedulerBars, base + kOffSchedulerData};
    }
  };
  static constexpr int kSmemAlloc = SharedStorage::kAlloc;

  // ---------------------------------------------------------------- host -> device
  struct Arguments {
    typename Mainloop::Arguments mainloop;
    typename Epilogue::Arguments epilogue;
    typename Scheduler::Arguments scheduler;
  };
  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename Scheduler::Params scheduler;
  };
  static bool to_params(const Arguments& a, Params& p) {
    if (!Mainloop::to_params(a.mainloop, p.mainloop)) return false;
    if (!Epilogue::to_params(a.epilogue, p.epilogue)) return false;
    p.scheduler = Scheduler::to_params(a.scheduler);
    return true;
  }

  // ---------------------------------------------------------------- device
  JF_DEVICE static void producer(const Params& p, const SharedStorage& ss) {
    const typename Mainloop::Smem sm = ss.mainloop();
    const typename Scheduler::Smem sched = ss.scheduler();
    ptx::PipeState<Mainloop::kStages> kst, vst;
    uint32_t it = 0;
    for (WorkTile work = Scheduler::initial_work(p.scheduler, sched); Scheduler::valid(p.scheduler, work);
         ++it) {
      const WorkTile next = Scheduler::prefetch_next(p.scheduler, work);  // used after the loads
      const TileCoord c = Scheduler::coord(p.scheduler, work);
      Mainloop::load(p.mainloop, sm, kst, vst, c, it);
      Scheduler::publish_next(sched, it, next);
      work = next;
    }
    Mainloop::finish_loads(sm, vst);
  }

  // Mainloop::kDropMask: mask thread j of warps 1..kMaskWarps, the same tile
  // sequence as the consumers (a consumer of the scheduler's hand-off).
  JF_DEVICE static void mask_producer(const Params& p, const SharedStorage& ss, int j) {
    const typename Mainloop::Smem sm = ss.mainloop();
    const typename Scheduler::Smem sched = ss.scheduler();
    ptx::PipeState<Mainloop::kMaskStages> mst;
    uint32_t it = 0;
    for (WorkTile work = Scheduler::initial_work(p.scheduler, sched); Scheduler::valid(p.scheduler, work);
         ++it) {
      Mainloop::make_masks(p.mainloop, sm, mst, Scheduler::coord(p.scheduler, work), j);
      work = Scheduler::consumer_next(p.scheduler, sched, it, work);
    }
  }

  JF_DEVICE static void consumer(const Params& p, const SharedStorage& ss, int wg) {
    const int tid_wg = threadIdx.x % 128;
    const int warp = tid_wg / 32, lane = tid_wg % 32;
    const typename Mainloop::Smem sm = ss.mainloop();
    const typename Epilogue::Smem esm = ss.epilogue();
    const typename Scheduler::Smem sched = ss.scheduler();
    ptx::PipeState<Mainloop::kStages> kst, vst;
    ptx::PipeState<Mainloop::kMaskStages> mst;
    const typename Mainloop::Consumer ml{p.mainloop, sm, wg, warp, lane, kst, vst, mst};
    ml.start();
    uint32_t it = 0;
    for (WorkTile work = Scheduler::initial_work(p.scheduler, sched); Scheduler::valid(p.scheduler, work);
         ++it) {
      const TileCoord c = Scheduler::coord(p.scheduler, work);
      const int m0 = c.block * Mainloop::kBlockM;
      int n_first, n_last;
      Mainloop::kv_block_range(p.mainloop, c.batch, m0, n_first, n_last);

      float o[Mainloop::kOR];
      if constexpr (Mainloop::kZeroFillO) {
#pragma unroll
        for (int i = 0; i < Mainloop::kOR; ++i) o[i] = 0.f;
      }
      typename Mainloop::Softmax smx;
      smx.init();
      ml.template mma<Epilogue::kReleasesQ>(o, smx, m0, c.head, c.batch, n_first, n_last, it);
      // Before the epilogue, as FA3: the producer is ahead anyway.
      const WorkTile next = Scheduler::consumer_next(p.scheduler, sched, it, work);
      Epilogue::store(p.epilogue, esm, wg, warp, lane, o, smx, m0, c.head, c.batch);
      work = next;
    }
    if (tid_wg == 0) ptx::bulk_wait<0>();  // stores done before the CTA's smem goes away
  }

  JF_DEVICE static void run(const Params& p, char* smem_raw) {
    SharedStorage ss;
    ss.base = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;
    const int warp = ptx::warp_id_uniform();
    if (threadIdx.x == 0) {
      Mainloop::template init_barriers<Epilogue::kQEmptyArrivals>(ss.mainloop());
      Epilogue::init_barriers(ss.epilogue());
      Scheduler::template init_barriers<128 * kConsumerWGs + Mainloop::kMaskThreads>(ss.scheduler());
      Scheduler::claim_first(p.scheduler, ss.scheduler());
      ptx::mbar_fence_init();
      Mainloop::prefetch_descriptors(p.mainloop);
      Epilogue::prefetch_descriptors(p.epilogue);
    }
    __syncthreads();

    if (warp < 4) {  // producer warpgroup
      ptx::setmaxnreg_dec<kProducerRegs>();
      if (warp == 0) {
        if (ptx::lane_id() == 0) producer(p, ss);
      } else if (warp <= Mainloop::kTransposeWarps) {
        Mainloop::transpose_loop(ss.mainloop(), warp - 1, ptx::lane_id());
      } else if constexpr (Mainloop::kDropMask) {
        if (warp <= Mainloop::kMaskWarps) mask_producer(p, ss, int(threadIdx.x) - 32);
      }
    } else {
      ptx::setmaxnreg_inc<kConsumerRegs>();
      consumer(p, ss, warp / 4 - 1);
    }
  }
};

template <typename Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    fwd_kernel(const __grid_constant__ typename Kernel::Params params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  Kernel::run(params, smem_raw);
#else
  // Built for another target: this kernel needs sm_90a (wgmma, setmaxnreg).
  __trap();
#endif
}

// The kernel of one (element type, head-dim bucket, tuning[, output type[,
// value head dim]]) configuration; kHeadDimV != kHeadDim: a head-dim pair.
template <typename Element, int kHeadDim, typename Tuning, typename OutElement = Element,
          int kHeadDimV = kHeadDim>
struct FwdKernelFor {
  using Mainloop = FwdMainloop<Element, kHeadDim, Tuning, OutElement, kHeadDimV>;
  using Epilogue = FwdEpilogue<Mainloop>;
  using Scheduler = std::conditional_t<Tuning::value.dynamic_scheduler, DynamicPersistentTileScheduler,
                                       StaticPersistentTileScheduler>;
  using type = FwdKernel<Mainloop, Epilogue, Scheduler>;
};

}  // namespace jax_flash::sm90
