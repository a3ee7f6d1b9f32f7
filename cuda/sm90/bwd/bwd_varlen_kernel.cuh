// The variable-length (cu_seqlens) sm90 backward: the backward's mainloop
// and epilogue (their BwdVarlenConfig configuration) with one CTA per
// (sequence, KV block of that sequence's own length, kv head), the order of
// jax_flash/varlen_bwd_order.h (heaviest first; no tile straddles two
// sequences), decoded from the offsets by one warp of the CTA (no pre-pass):
//   - positions (KV block, query blocks, mask) count from the sequence's
//     start; causal and windows are bottom-right per sequence
//     (MaskInfo::for_sequence); Q, dO, K and V are loaded by TMA at the
//     sequence's rows, the LSE and delta per sequence row;
//   - rows past the sequence's end (the next tokens of the packed tensors,
//     which may hold NaN) are zeroed in shared memory before any GEMM reads
//     them (BwdMainloop::zero_kv_tail, zero_q_do_tail);
//   - dQ is added into the dq_accum rows of the sequence only (tensor
//     reductions for tiles inside it, 16-byte bulk reductions of the rows
//     inside it for the tile at its end), dK / dV stored by TMA for 64-row
//     parts inside the sequence, by guarded row stores at its end.
// Roles, barriers and register budgets as BwdKernel (bwd_kernel.cuh). Not
// deterministic (the semaphores are per packed query block of the dense
// layout); deterministic calls take the packed backward.
#pragma once

#include "bwd_epilogue.cuh"
#include "bwd_mainloop.cuh"
#include "jax_flash/varlen_bwd_order.h"
#include "sm90/ptx/barrier.cuh"

namespace jax_flash::sm90 {

// The kernel's parameters: the backward's own block (the same fields as the
// dense kernels'), the order, and dK / dV for the guarded row stores.
struct VarlenBwdKernelParams {
  BwdKernelArgs args;
  VarlenBwdOrder order;
  GmemTensor dk, dv;
  int grid;
};

template <typename Mainloop_, typename Epilogue_>
struct VarlenBwdKernel {
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  using Cfg = typename Mainloop::Cfg;
  static_assert(Cfg::kVarlen, "the backward's varlen configuration (BwdVarlenConfig)");
  static constexpr int kThreads = Cfg::kThreads;
  static constexpr int kSmemAlloc = Cfg::kSmemAlloc;

  struct Arguments {
    typename Mainloop::Arguments mainloop;
    typename Epilogue::Arguments epilogue;
    VarlenBwdOrder order;
    int64_t max_tiles;  // VarlenBwdOrder::max_tiles: the grid
  };
  using Params = VarlenBwdKernelParams;
  static bool to_params(const Arguments& a, Params& p) {
    if (!Mainloop::to_params(a.mainloop, p.args)) return false;
    if (!Epilogue::to_params(a.epilogue, p.args)) return false;
    if (a.max_tiles > int64_t(0x7fffffff)) return false;
    p.order = a.order;
    p.dk = a.epilogue.dk;
    p.dv = a.epilogue.dv;
    p.grid = int(a.max_tiles);
    return true;
  }

  JF_DEVICE static void run(const Params& params, char* smem_raw) {
    const BwdKernelArgs& args = params.args;
    BwdSmem<Cfg> sm;
    sm.base = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;
    const int warp = ptx::warp_id_uniform();
    if (threadIdx.x == 0) {
      Mainloop::init_barriers(sm);
      ptx::mbar_fence_init();
      Mainloop::prefetch_descriptors(args);
    }
    // Warp 1 decodes the CTA's tile (ballots over the sequences' level
    // ranges, VarlenBwdOrder::decode_one) while thread 0 sets up the
    // barriers; lane 0 publishes it before the barrier.
    if (warp == 1) {
      const VarlenTile t = params.order.decode_one(int(blockIdx.x));
      if (ptx::lane_id() == 0) {
        const int v[Cfg::kVarlenSlotInts] = {t.block, t.head, t.batch, t.seq.offset_q, t.seq.len_q,
                                             t.seq.offset_k, t.seq.len_k};
#pragma unroll
        for (int i = 0; i < Cfg::kVarlenSlotInts; ++i) ptx::st_shared_b32(sm.varlen_slot(i), uint32_t(v[i]));
      }
    }
    __syncthreads();
    const int block = ld_shared_s32(sm.varlen_slot(0));
    if (block < 0) return;  // past the last tile (the grid is an upper bound): the whole CTA
    const VarlenSeq seq{ld_shared_s32(sm.varlen_slot(3)), ld_shared_s32(sm.varlen_slot(4)),
                        ld_shared_s32(sm.varlen_slot(5)), ld_shared_s32(sm.varlen_slot(6))};
    BwdVarlenTile tile = make_bwd_varlen_tile<Cfg>(args, block, ld_shared_s32(sm.varlen_slot(1)),
                                                   ld_shared_s32(sm.varlen_slot(2)), seq);
    tile.dk = &params.dk;
    tile.dv = &params.dv;
    if (warp < 4) {  // producer warpgroup
      ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
      if (warp == 0) {
        Mainloop::load(args, sm, tile);
      } else if (warp == 1) {
        Mainloop::store_dq(args, sm, tile);
      }
    } else {
      ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
      const int tid_wg = threadIdx.x % 128;
      Mainloop::template consume<Epilogue>({args, sm, warp / 4 - 1, tid_wg / 32, tid_wg % 32}, tile);
    }
  }
};

// The varlen kernel of one (element type, base config, softcap).
template <typename Element, typename BaseCfg, bool kSoftcap>
struct VarlenBwdKernelFor {
  using Cfg = BwdVarlenConfig<BaseCfg>;
  using Mainloop = BwdMainloop<Element, Cfg, kSoftcap, /*kDqTensor=*/true, /*kDet=*/false, /*kPacked=*/false>;
  using type = VarlenBwdKernel<Mainloop, BwdEpilogue<Mainloop>>;
};

template <typename Element, typename BaseCfg, bool kSoftcap>
__global__ void __launch_bounds__(BaseCfg::kThreads, 1)
    bwd_varlen_kernel(const __grid_constant__ VarlenBwdKernelParams params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  VarlenBwdKernelFor<Element, BaseCfg, kSoftcap>::type::run(params, smem_raw);
#else
  __trap();
#endif
}

}  // namespace jax_flash::sm90
