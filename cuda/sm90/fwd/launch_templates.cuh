// Host side of the sm90 forward: from FwdParams to a kernel launch.
// Included by the generated files in cuda/instantiations/fwd_*_sm90.cu (the
// production configurations, run_fwd_hdim) and by the tuning / ablation
// target (cuda/tests/sm90_fwd_ablation.cu: launch_fwd with its own
// configurations).
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <type_traits>

#include "fwd_kernel.cuh"
#include "fwd_tuning.h"
#include "instantiations.h"
#include "jax_flash/device_attribute.h"
#include "sm90/common/tma_desc.h"

namespace jax_flash::sm90 {

// Launches configuration (Element, kHeadDim, Tuning) on a call that
// fwd_supported accepted (cudaErrorNotSupported if a tensor map cannot be
// encoded or the scheduler's workspace is missing).
template <typename Element, int kHeadDim, typename Tuning>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using Kernel = typename FwdKernelFor<Element, kHeadDim, Tuning>::type;
  using Mainloop = typename Kernel::Mainloop;
  using Scheduler = typename Kernel::Scheduler;
  const MaskInfo mask = make_mask_info(p);
  const SoftmaxScale sm = make_softmax_scale(p.scale, p.softcap);
  const int heads_per_kv = p.num_heads / p.num_heads_k;
  const typename Kernel::Arguments args{
      {fwd_q(p), fwd_k(p), fwd_v(p), mask, sm, heads_per_kv},
      {fwd_o(p), p.lse, sm},
      {{p.batch, p.num_heads, heads_per_kv, p.seqlen_q, p.seqlen_k, kHeadDim,
        Mainloop::Traits::kBytes, Mainloop::kBlockM, fwd_causal_like(mask.wl, mask.wr)},
       p.sm90_tile_counter}};
  if (Scheduler::kNeedsWorkspace && p.sm90_tile_counter == nullptr) return cudaErrorNotSupported;
  typename Kernel::Params params;
  std::memset(&params, 0, sizeof(params));
  if (!Kernel::to_params(args, params)) return cudaErrorNotSupported;

  auto kernel = fwd_kernel<Kernel>;
  cudaError_t err = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemAlloc);
  if (err != cudaSuccess) return err;
  const int sms = p.num_sms > 0 ? p.num_sms : device_attribute<cudaDevAttrMultiProcessorCount>(1);
  const int grid = Scheduler::grid_size(params.scheduler, sms);
  if (grid <= 0) return cudaSuccess;
  err = Scheduler::prepare(params.scheduler, stream);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Kernel::kThreads, Kernel::kSmemAlloc, stream>>>(params);
  return cudaGetLastError();
}

// The production forward of one (dtype, bucket): fwd_default_tuning's
// configuration for the call's mask.
template <typename Element, int kHeadDim>
cudaError_t run_fwd_hdim(const FwdParams& p, cudaStream_t stream) {
  const MaskInfo mi = make_mask_info(p);
  if (fwd_causal_like(mi.wl, mi.wr))
    return launch_fwd<Element, kHeadDim, DefaultFwdTuning<kHeadDim, true>>(p, stream);
  return launch_fwd<Element, kHeadDim, DefaultFwdTuning<kHeadDim, false>>(p, stream);
}

}  // namespace jax_flash::sm90
