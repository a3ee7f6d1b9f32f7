// FlashAttention-3 style forward for Hopper (sm_90a).
//
// CTA = 1 producer warpgroup + kConsumerWGs consumer warpgroups, persistent
// over tiles (scheduler.cuh). Roles split once, at the top:
//   producer (setmaxnreg.dec): one thread issues TMA loads of Q and of the K/V
//     ring (mainloop.cuh) and never touches a register-heavy fragment;
//   consumers (setmaxnreg.inc): wgmma + online softmax on 64 query rows each,
//     then the epilogue (epilogue.cuh).
// Synchronisation: mbarriers for data (full_q/empty_q, full/empty per K and V
// stage), named barriers for the pingpong turns and the per-WG epilogue.
#pragma once

#include "epilogue.cuh"
#include "mainloop.cuh"

namespace jax_flash::sm90 {

template <typename Element, typename Cfg, int kFlags>
JF_DEVICE void consumer_loop(const FwdKernelArgs& a, const SmemPlan<Cfg>& sm, int wg) {
  constexpr bool kDynamic = (kFlags & kFlagDynamic) != 0;
  const int tid_wg = threadIdx.x % 128;
  const int warp = tid_wg / 32, lane = tid_wg % 32;
  ptx::PipeState<Cfg::kStages> kst, vst;
  using Mainloop = ConsumerMainloop<Element, Cfg, kFlags>;
  const Mainloop ml{a, sm, wg, warp, lane, kst, vst};
  if constexpr (Mainloop::kPingpong) {
    if (wg == 0) ptx::named_bar_arrive(kBarSched + 0, 256);  // the first turn is WG 0's
  }
  uint32_t it = 0;
  for (int tile = blockIdx.x; tile < a.sched.total; ++it) {
    int m_block, head, batch;
    a.sched.decode(tile, m_block, head, batch);
    const int m0 = m_block * Cfg::kBlockM;
    int n_first, n_last;
    a.mask.kv_block_range(m0, Cfg::kBlockM, Cfg::kBlockN, n_first, n_last);

    float o[Cfg::kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < Cfg::kHeadDim / 2; ++i) o[i] = 0.f;
    OnlineSoftmax smx;
    smx.init();
    ml.wait_full(sm.full_q(), it & 1u);
    const typename Mainloop::QOperand q = ml.load_q();
    // kQInRegs: the warp's only reads of Q's buffer are the ldmatrix above;
    // the arrive (after __syncwarp, release semantics) orders them before the
    // producer's empty_q wait and so before the next tile's TMA write. The
    // proxy fence orders these generic-proxy reads before that async-proxy
    // write, as CUTLASS's TMA epilogue does before releasing smem it read into
    // registers. The next tile's Q then loads during this mainloop.
    if constexpr (Mainloop::kQInRegs) {
      ptx::fence_proxy_async_smem();
      ml.release(sm.empty_q());
    }
    if (n_last > n_first) ml.run(o, smx, q, m0 + 64 * wg, batch, n_first, n_last);
    if constexpr (!Mainloop::kQInRegs && !Cfg::kOAliasQ)
      ml.release(sm.empty_q());  // all QK^T of this warp are done
    int next = tile + int(gridDim.x);
    if constexpr (kDynamic) {  // before the epilogue, as FA3: the producer is ahead anyway
      ptx::mbar_wait(sm.tile_full(), it & 1u);
      next = ld_shared_s32(sm.tile_slot());
      ptx::mbar_arrive(sm.tile_empty());  // every thread, after its own read
    }
    epilogue_store<Element, Cfg>(a, sm, wg, warp, lane, o, smx, m0, head, batch);
    tile = next;
  }
  if (tid_wg == 0) ptx::bulk_wait<0>();  // stores done before the CTA's smem goes away
}

template <typename Element, typename Cfg, int kFlags>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdKernelArgs args) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  SmemPlan<Cfg> sm;
  sm.base = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;

  const int warp = ptx::warp_id_uniform();
  if (threadIdx.x == 0) {
    ptx::mbar_init(sm.full_q(), 1);
    ptx::mbar_init(sm.empty_q(), Cfg::kQEmptyArrivals);
#pragma unroll
    for (int s = 0; s < Cfg::kStages; ++s) {
      ptx::mbar_init(sm.full_k(s), 1);
      ptx::mbar_init(sm.empty_k(s), Cfg::kKVEmptyArrivals);
      ptx::mbar_init(sm.full_v(s), 1);
      ptx::mbar_init(sm.empty_v(s), Cfg::kKVEmptyArrivals);
    }
    ptx::mbar_init(sm.o_free(), Cfg::kOFreeArrivals);
    ptx::mbar_init(sm.tile_full(), 1);
    ptx::mbar_init(sm.tile_empty(), 128 * Cfg::kConsumerWGs);
    ptx::mbar_fence_init();
    ptx::prefetch_tmap(&args.tm_q);
    ptx::prefetch_tmap(&args.tm_k);
    ptx::prefetch_tmap(&args.tm_v);
    ptx::prefetch_tmap(&args.tm_o);
  }
  __syncthreads();

  if (warp < 4) {  // producer warpgroup
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (warp == 0 && ptx::lane_id() == 0)
      producer_loop<Cfg, kFlags>(args, sm);
  } else {
    ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
    consumer_loop<Element, Cfg, kFlags>(args, sm, warp / 4 - 1);
  }
#else
  // Built for another target: this kernel needs sm_90a (wgmma, setmaxnreg).
  __trap();
#endif
}

}  // namespace jax_flash::sm90
