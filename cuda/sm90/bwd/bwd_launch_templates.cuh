// Host side of the sm90 backward: the kernel's Arguments from BwdParams, the
// dq_accum (and semaphore) zeroing, the main kernel and the dq_convert
// post-pass shared with the sm80 family (jax_flash/dq_convert.cuh: dq =
// scale * dq_accum -> input dtype).
// Included only by the generated files cuda/instantiations/bwd_*_sm90.cu (and
// the backward's test targets under cuda/tests/).
#pragma once

#include <cuda_runtime.h>

#include <cstring>

#include "bwd_instantiations.h"
#include "bwd_kernel.cuh"
#include "bwd_policy.h"
#include "sm90/common/tma_desc.h"  // GmemTensor, fwd_q / fwd_k / fwd_v
#include "jax_flash/dq_convert.cuh"

namespace jax_flash::sm90 {

// dq = scale * dq_accum ([b, h, seqlen_q_rounded, kPitch] fp32) in q's layout.
template <typename Element, int kPitch>
cudaError_t launch_dq_convert(const BwdParams& p, cudaStream_t stream) {
  dq_convert_kernel<Element, kPitch><<<dq_convert_grid(p, kPitch), kDqConvertThreads, 0, stream>>>(
      DqConvertArgs{p});
  return cudaGetLastError();
}

// The Arguments of a backward call for Kernel (every variant of one config
// and kDet takes the same). mask: the call's, as the kernel sees it.
template <typename Kernel>
typename Kernel::Arguments bwd_arguments(const BwdParams& p, const MaskInfo& mask) {
  using Cfg = typename Kernel::Cfg;
  constexpr bool kDet = Kernel::Scheduler::kNeedsWorkspace;  // the claimed scheduler: deterministic kernels
  const int group = p.num_heads / p.num_heads_k;
  // dO has O's layout, dK / dV those of K / V (dO, dV: head_dim_v columns).
  const GmemTensor dout{p.dout, p.head_dim_v, p.seqlen_q, p.num_heads, p.batch,
                        p.o_row_stride, p.o_head_stride, p.o_batch_stride};
  const GmemTensor dk{p.dk, p.head_dim, p.seqlen_k, p.num_heads_k, p.batch,
                      p.k_row_stride, p.k_head_stride, p.k_batch_stride};
  const GmemTensor dv{p.dv, p.head_dim_v, p.seqlen_k, p.num_heads_k, p.batch,
                      p.v_row_stride, p.v_head_stride, p.v_batch_stride};
  // Deterministic kernels: the scheduler's claim counter is the workspace's
  // first int, the semaphores per (batch, q head, query block) follow
  // (bwd_supported: the workspace is set).
  const int sem_m_blocks = kDet ? (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM : 0;
  int* const sem = kDet ? p.sm90_dq_semaphore + 1 : nullptr;  // 1 + its ints <= sm90_bwd_semaphore_ints
  const BwdTileOrderArguments order{p.batch,       p.num_heads_k, group,
                                    p.seqlen_k,    p.seqlen_q,    Cfg::kHeadDim,
                                    int(sizeof(typename Kernel::Mainloop::Element)), Cfg::kBlockN,
                                    mask.causal_like()};
  return {{fwd_q(p), fwd_k(p), fwd_v(p), dout, mask, make_softmax_scale(p.scale, p.softcap), p.lse, p.delta,
           group,
           {p.dq_accum, p.head_dim, p.seqlen_q, p.seqlen_q_rounded, p.head_dim_rounded, p.num_heads, p.batch,
            sem, sem_m_blocks},
           Cfg::kDropout ? p.dropout : DropoutArgs{}},
          {dk, dv, p.scale},
          {order, kDet ? p.sm90_dq_semaphore : nullptr}};
}

// The kernels of a call, for one config and dQ order (kDet): the Params
// (one for all variants: they differ in their code only), the workspaces
// zeroed, the main kernel of the call's softcap / packing, then dq_convert.
template <typename Element, typename Cfg, bool kDqTensor, bool kDet>
cudaError_t launch_bwd_kernels(const BwdParams& p, const MaskInfo& mask, cudaStream_t stream) {
  using Plain = typename BwdKernelFor<Element, Cfg, false, kDqTensor, kDet, false>::type;
  using Scheduler = typename Plain::Scheduler;
  typename Plain::Params params;
  std::memset(&params, 0, sizeof(params));
  if (!Plain::to_params(bwd_arguments<Plain>(p, mask), params)) return cudaErrorNotSupported;

  cudaError_t err;
  if (p.seqlen_q > 0) {  // dq_accum is uninitialised on entry
    const size_t bytes =
        size_t(p.batch) * p.num_heads * size_t(p.seqlen_q_rounded) * p.head_dim_rounded * sizeof(float);
    err = cudaMemsetAsync(p.dq_accum, 0, bytes, stream);
    if (err != cudaSuccess) return err;
  }
  if constexpr (kDet) {
    if (p.seqlen_k > 0) {  // else no kernel, no semaphores to reset
      const size_t sem_ints = size_t(p.batch) * p.num_heads * params.args.sem_m_blocks;
      err = cudaMemsetAsync(params.args.dq_sem, 0, sem_ints * sizeof(int32_t), stream);
      if (err != cudaSuccess) return err;
    }
  }

  const int grid = Scheduler::grid_size(params.scheduler, 0);
  // Every KV block runs, also those no query sees (dK = dV = 0); no KV block: dq = 0.
  if (grid > 0) {
    err = Scheduler::prepare(params.scheduler, stream);
    if (err != cudaSuccess) return err;
    const bool packed = mask.q_span != nullptr;  // packed sequences: their own kernels
    // (Dropout configs: no softcap kernels; bwd_supported sends softcap with
    // dropout to the sm80 backward.)
    constexpr bool kSoftcapKernels = !Cfg::kDropout;
    auto kernel = kSoftcapKernels && p.softcap > 0.f
                      ? (packed ? bwd_kernel<Element, Cfg, kSoftcapKernels, kDqTensor, kDet, true>
                                : bwd_kernel<Element, Cfg, kSoftcapKernels, kDqTensor, kDet, false>)
                      : (packed ? bwd_kernel<Element, Cfg, false, kDqTensor, kDet, true>
                                : bwd_kernel<Element, Cfg, false, kDqTensor, kDet, false>);
    err = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                               cudaFuncAttributeMaxDynamicSharedMemorySize, Plain::kSmemAlloc);
    if (err != cudaSuccess) return err;
    kernel<<<grid, Plain::kThreads, Plain::kSmemAlloc, stream>>>(params);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (p.seqlen_q == 0) return cudaSuccess;
  // The dq_accum row pitch is the workspace's head_dim_rounded (96 for head
  // dims 65..96, which this kernel runs in the 128 bucket; 256 for 129..256;
  // a head-dim pair's own head dim).
  if constexpr (Cfg::kPair) {
    if (p.head_dim_rounded == Cfg::kHeadDim) return launch_dq_convert<Element, Cfg::kHeadDim>(p, stream);
  } else if constexpr (Cfg::kHeadDim == 64) {
    if (p.head_dim_rounded == 64) return launch_dq_convert<Element, 64>(p, stream);
  } else if constexpr (Cfg::kHeadDim == 128) {
    if (p.head_dim_rounded == 96) return launch_dq_convert<Element, 96>(p, stream);
    if (p.head_dim_rounded == 128) return launch_dq_convert<Element, 128>(p, stream);
  } else {
    if (p.head_dim_rounded == 256) return launch_dq_convert<Element, 256>(p, stream);
  }
  return cudaErrorNotSupported;  // unreachable: bwd_supported checks the pitch
}

// One tile: the config Cfg, and how dQ reaches dq_accum: kDqTensor, by TMA
// tensor reductions of each staged tile (production); else by one bulk
// reduction per row (kept for measurements only, cuda/tests/sm90_bwd_tuning.h).
template <typename Element, typename Cfg, bool kDqTensor = true>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
  // Deterministic kernels: the bucket tiles (bwd_default_tile; the dQ_swapAB
  // tile has none) with tensor reductions, with the semaphore workspace.
  if (p.deterministic && (!kDqTensor || Cfg::kDqSwapAB || p.sm90_dq_semaphore == nullptr))
    return cudaErrorNotSupported;
  MaskInfo mask = make_mask_info(p);
  // The deterministic dQ order (bwd_mask.cuh dq_pred_range) needs the
  // positional query-block ranges, monotone in the KV block: the kv spans
  // must not narrow them (the q spans still spare interior blocks the mask).
  if (p.deterministic) mask.kv_span = nullptr;
  // kBlockM 80 (FA3's non-causal tile) only without a causal / local bound.
  if (Cfg::kDqSwapAB && mask.bounded()) return cudaErrorNotSupported;
  if constexpr (!Cfg::kDqSwapAB && kDqTensor) {
    if (p.deterministic) return launch_bwd_kernels<Element, Cfg, true, true>(p, mask, stream);
  }
  return launch_bwd_kernels<Element, Cfg, kDqTensor, false>(p, mask, stream);
}

// With attention dropout: the bucket's tile with the mask's buffers
// (BwdDropoutConfig; masks drawn where bwd_dropout_producer_mask says), in
// translation units of its own (bwd_dropout_<dtype>_hdim<d>_sm90.cu).
template <typename Element, int kHeadDim>
cudaError_t run_bwd_dropout_hdim(const BwdParams& p, cudaStream_t stream) {
  return launch_bwd<Element, BwdDropoutConfig<typename BwdConfigFor<kHeadDim>::type,
                                              bwd_dropout_producer_mask(kHeadDim)>>(p, stream);
}

template <typename Element, int kHeadDim, int kHeadDimV>
cudaError_t run_bwd_hdim(const BwdParams& p, cudaStream_t stream) {
  if constexpr (kHeadDimV != kHeadDim) {  // a head-dim pair: its own tile
    return launch_bwd<Element, typename BwdPairConfigFor<kHeadDim, kHeadDimV>::type>(p, stream);
  } else {
    if constexpr (kHeadDim == 128) {
      if (bwd_default_tile(kHeadDim, make_mask_info(p).bounded(), p.deterministic) == BwdTileChoice::kBlockM80)
        return launch_bwd<Element, BwdConfigHd128Bm80>(p, stream);
    }
    return launch_bwd<Element, typename BwdConfigFor<kHeadDim>::type>(p, stream);
  }
}

}  // namespace jax_flash::sm90
