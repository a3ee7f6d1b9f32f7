// The variable-length (cu_seqlens) sm90 forward: the mainloop and epilogue
// of the dense kernel (their kVarlen configuration) under the varlen tile
// scheduler (varlen_scheduler.cuh), FA3's varlen design:
//   - each tile is one query block of one sequence (never two), blocks
//     counted from the sequence's start, the KV blocks its own keys, causal
//     and windows bottom-right aligned per sequence (MaskInfo::for_sequence);
//   - Q, K and V are loaded by TMA at the sequence's row offsets; rows past
//     its end (the next tokens of the packed tensor) only ever meet -inf
//     scores (K, the mask selects), their own never-stored rows (Q), or
//     zeroed shared memory (V, Consumer::zero_v_tail), so nothing in other
//     sequences' tokens reaches an output;
//   - O rows are stored up to the sequence's end (TMA for whole 64-row
//     warpgroup boxes inside it, guarded row stores at the end), the LSE
//     per sequence row.
// Roles as FwdKernel (fwd_kernel.cuh), but the whole producer warp runs the
// scheduler's decode (a ballot over the sequences), lane 0 the loads.
#pragma once

#include "fwd_kernel.cuh"
#include "sm90/common/varlen_scheduler.cuh"

namespace jax_flash::sm90 {

template <typename Mainloop_, typename Epilogue_>
struct VarlenFwdKernel {
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  using Scheduler = VarlenTileScheduler;
  static_assert(Mainloop::kVarlen, "the mainloop's varlen configuration (FwdTuning::varlen)");
  // Shared memory and register budgets: the dense kernel's with this scheduler.
  using Layout = FwdKernel<Mainloop, Epilogue, Scheduler>;
  using SharedStorage = typename Layout::SharedStorage;
  static constexpr int kConsumerWGs = Layout::kConsumerWGs;
  static constexpr int kThreads = Layout::kThreads;
  static constexpr int kSmemAlloc = Layout::kSmemAlloc;

  struct Arguments {
    typename Mainloop::Arguments mainloop;
    typename Epilogue::Arguments epilogue;
    typename Scheduler::Arguments scheduler;
  };
  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename Scheduler::Params scheduler;
    GmemTensor o;  // the epilogue's guarded row stores
  };
  static bool to_params(const Arguments& a, Params& p) {
    if (!Mainloop::to_params(a.mainloop, p.mainloop)) return false;
    if (!Epilogue::to_params(a.epilogue, p.epilogue)) return false;
    p.scheduler = Scheduler::to_params(a.scheduler);
    p.o = a.epilogue.o;
    return true;
  }

  // Every lane of the producer warp.
  JF_DEVICE static void producer(const Params& p, const SharedStorage& ss) {
    const typename Mainloop::Smem sm = ss.mainloop();
    const typename Scheduler::Smem sched = ss.scheduler();
    const int lane = ptx::lane_id();
    ptx::PipeState<Mainloop::kStages> kst, vst;  // lane 0's are the ones that count
    VarlenCursor cur = Scheduler::start(p.scheduler);
    VarlenTile w = Scheduler::decode(p.scheduler, cur, int(blockIdx.x));
    if (lane == 0) Scheduler::publish(sched, 0u, w);
    for (uint32_t it = 0; w.block >= 0; ++it) {
      int next = 0;
      if (lane == 0) next = Scheduler::claim(p.scheduler);
      next = __shfl_sync(0xffffffffu, next, 0);
      if (lane == 0) {
        const TileCoord c{w.block, w.head, w.batch, 0};
        Mainloop::load(p.mainloop, sm, kst, vst, c, it, &w.seq);
      }
      __syncwarp();
      w = Scheduler::decode(p.scheduler, cur, next);
      if (lane == 0) Scheduler::publish(sched, it + 1, w);
      __syncwarp();
    }
  }

  JF_DEVICE static void consumer(const Params& p, const SharedStorage& ss, int wg) {
    const int tid_wg = threadIdx.x % 128;
    const int warp = tid_wg / 32, lane = tid_wg % 32;
    const typename Mainloop::Smem sm = ss.mainloop();
    const typename Epilogue::Smem esm = ss.epilogue();
    const typename Scheduler::Smem sched = ss.scheduler();
    ptx::PipeState<Mainloop::kStages> kst, vst;
    ptx::PipeState<Mainloop::kMaskStages> mst;  // the dropout mask ring: unused (no dropout here)
    const typename Mainloop::Consumer ml{p.mainloop, sm, wg, warp, lane, kst, vst, mst};
    ml.start();
    VarlenTile w = Scheduler::read(sched, 0u);
    for (uint32_t it = 0; w.block >= 0; ++it) {
      ml.set_sequence(w.seq);
      const int m0 = w.block * Mainloop::kBlockM;
      int n_first, n_last;
      ml.mask().BlockMath<MaskInfo>::kv_block_range(m0, Mainloop::kBlockM, Mainloop::kBlockN, n_first, n_last);

      float o[Mainloop::kOR];
      if constexpr (Mainloop::kZeroFillO) {
#pragma unroll
        for (int i = 0; i < Mainloop::kOR; ++i) o[i] = 0.f;
      }
      typename Mainloop::Softmax smx;
      smx.init();
      ml.template mma<Epilogue::kReleasesQ>(o, smx, m0, w.head, w.batch, n_first, n_last, it);
      const VarlenTile next = Scheduler::read(sched, it + 1);
      Epilogue::store(p.epilogue, esm, wg, warp, lane, o, smx, m0, w.head, w.batch, &w.seq, &p.o);
      w = next;
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
      Scheduler::template init_barriers<128 * kConsumerWGs>(ss.scheduler());
      ptx::mbar_fence_init();
      Mainloop::prefetch_descriptors(p.mainloop);
      Epilogue::prefetch_descriptors(p.epilogue);
    }
    __syncthreads();

    if (warp < 4) {  // producer warpgroup
      ptx::setmaxnreg_dec<Layout::kProducerRegs>();
      if (warp == 0) producer(p, ss);
    } else {
      ptx::setmaxnreg_inc<Layout::kConsumerRegs>();
      consumer(p, ss, warp / 4 - 1);
    }
  }
};

// The varlen kernel of one (element type, bucket or head-dim pair, mask kind).
template <typename Element, int kHeadDim, int kHeadDimV, bool kCausalLike>
struct VarlenFwdKernelFor {
  using Mainloop = FwdMainloop<Element, kHeadDim, VarlenFwdTuning<kHeadDim, kHeadDimV, kCausalLike>, Element,
                               kHeadDimV>;
  using Epilogue = FwdEpilogue<Mainloop>;
  using type = VarlenFwdKernel<Mainloop, Epilogue>;
};

}  // namespace jax_flash::sm90
