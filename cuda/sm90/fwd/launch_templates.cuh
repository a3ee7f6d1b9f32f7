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
#include "softcap.cuh"
#include "tile_order.cuh"

namespace jax_flash::sm90 {

// Launches Kernel with its Arguments (cudaErrorNotSupported if a tensor map
// cannot be encoded or the scheduler's workspace is missing).
template <typename Kernel>
cudaError_t launch_kernel(const typename Kernel::Arguments& args, int num_sms, const int32_t* tile_counter,
                          cudaStream_t stream) {
  using Scheduler = typename Kernel::Scheduler;
  if (Scheduler::kNeedsWorkspace && tile_counter == nullptr) return cudaErrorNotSupported;
  typename Kernel::Params params;
  std::memset(&params, 0, sizeof(params));
  if (!Kernel::to_params(args, params)) return cudaErrorNotSupported;

  auto kernel = fwd_kernel<Kernel>;
  cudaError_t err = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemAlloc);
  if (err != cudaSuccess) return err;
  const int sms = num_sms > 0 ? num_sms : device_attribute<cudaDevAttrMultiProcessorCount>(1);
  const int grid = Scheduler::grid_size(params.scheduler, sms);
  if (grid <= 0) return cudaSuccess;
  err = Scheduler::prepare(params.scheduler, stream);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Kernel::kThreads, Kernel::kSmemAlloc, stream>>>(params);
  return cudaGetLastError();
}

// The scheduler's Arguments of a forward call; with packed sequences the
// block order is computed on the stream first (tile_order.cuh).
template <typename Kernel>
typename Kernel::Scheduler::Arguments fwd_scheduler_args(const FwdParams& p, const MaskInfo& mask,
                                                         cudaStream_t stream, cudaError_t& err) {
  using Mainloop = typename Kernel::Mainloop;
  const int num_blocks = (p.seqlen_q + Mainloop::kBlockM - 1) / Mainloop::kBlockM;
  const int* perm =
      Mainloop::kPacked ? packed_tile_order(mask, p.sm90_tile_order, num_blocks) : nullptr;
  err = cudaSuccess;
  if (perm != nullptr)
    err = launch_packed_tile_order<Mainloop::kBlockM, Mainloop::kBlockN>(mask, p.batch, num_blocks,
                                                                         p.sm90_tile_order, stream);
  // head_dim: the mean of K's and V's, so that the L2 sections hold a head's K and V.
  return {{p.batch, p.num_heads, p.num_heads / p.num_heads_k, p.seqlen_q, p.seqlen_k,
           (Mainloop::kHeadDim + Mainloop::kHeadDimV) / 2, Mainloop::Traits::kBytes, Mainloop::kBlockM,
           fwd_causal_like(mask.wl, mask.wr), perm},
          p.sm90_tile_counter};
}

// Launches configuration (Element, kHeadDim, Tuning, kHeadDimV) on a call
// that fwd_supported accepted.
template <typename Element, int kHeadDim, typename Tuning, int kHeadDimV = kHeadDim>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using Kernel = typename FwdKernelFor<Element, kHeadDim, Tuning, Element, kHeadDimV>::type;
  const MaskInfo mask = make_mask_info(p);
  const SoftmaxScale sm = make_softmax_scale(p.scale, p.softcap);
  const int heads_per_kv = p.num_heads / p.num_heads_k;
  cudaError_t err;
  constexpr bool kDropout = Kernel::Mainloop::kDropout;
  const float o_scale = kDropout ? dropout_keep_scale(p.dropout) : 1.f;
  const typename Kernel::Arguments args{
      {fwd_q(p), fwd_k(p), fwd_v(p), mask, sm, heads_per_kv, {}, kDropout ? p.dropout : DropoutArgs{}},
      {fwd_o(p), p.lse, sm.scale_eff, nullptr, heads_per_kv, o_scale, p.sinks},
      fwd_scheduler_args<Kernel>(p, mask, stream, err)};
  if (err != cudaSuccess) return err;
  return launch_kernel<Kernel>(args, p.num_sms, p.sm90_tile_counter, stream);
}

// Launches the FP8 configuration (e4m3 inputs, OutElement output) on a call
// that fwd_fp8_supported accepted.
template <typename OutElement, int kHeadDim, typename Tuning>
cudaError_t launch_fwd_fp8(const Fp8FwdParams& p, cudaStream_t stream) {
  using Kernel = typename FwdKernelFor<__nv_fp8_e4m3, kHeadDim, Tuning, OutElement>::type;
  using Mainloop = typename Kernel::Mainloop;
  const MaskInfo mask = make_mask_info(p);
  const SoftmaxScale sm = make_softmax_scale(p.scale, p.softcap);
  const int heads_per_kv = p.num_heads / p.num_heads_k;
  typename Mainloop::Descales descale;
  descale.q = p.q_descale;
  descale.k = p.k_descale;
  descale.q_blocks = (p.seqlen_q + kFp8QBlock - 1) / kFp8QBlock;
  descale.k_blocks = (p.seqlen_k + Mainloop::kBlockN - 1) / Mainloop::kBlockN;
  cudaError_t err;
  const typename Kernel::Arguments args{
      {fwd_q(p), fwd_k(p), fwd_v(p), mask, sm, heads_per_kv, descale},
      {fwd_o(p), p.lse, sm.scale_eff, p.v_descale, heads_per_kv},
      fwd_scheduler_args<Kernel>(p, mask, stream, err)};
  if (err != cudaSuccess) return err;
  return launch_kernel<Kernel>(args, p.num_sms, p.sm90_tile_counter, stream);
}

// The production configuration of (kHeadDim, kHeadDimV) for a mask kind.
template <typename Element, int kHeadDim, int kHeadDimV, bool kCausalLike, bool kPacked, bool kDropout>
cudaError_t launch_fwd_default(const FwdParams& p, cudaStream_t stream) {
  using Tuning = DefaultFwdTuning<kHeadDim, kHeadDimV, kCausalLike, 2, kPacked, kDropout>;
  return launch_fwd<Element, kHeadDim, Tuning, kHeadDimV>(p, stream);
}

// Whether (Element, kHeadDim, kHeadDimV) has softcap kernels (fwd_softcap_tuning).
template <typename Element, int kHeadDim, int kHeadDimV>
constexpr bool fwd_has_softcap_kernels() {
  return std::is_same_v<Element, __nv_bfloat16> && kHeadDimV == kHeadDim &&
         (kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256);
}

// The production forward of one (dtype, bucket or head-dim pair):
// fwd_default_tuning's configuration for the call's mask; softcap calls the
// softcap kernels serve go to them (fwd_softcap_tuning), short causal calls
// at hdim 64 to 128-row tiles (fwd_short_causal_tuning).
template <typename Element, int kHeadDim, int kHeadDimV>
cudaError_t run_fwd_hdim(const FwdParams& p, cudaStream_t stream) {
  const MaskInfo mi = make_mask_info(p);
  const bool causal = fwd_causal_like(mi.wl, mi.wr);
  if (mi.q_span != nullptr) {  // packed sequences
    if (causal) return launch_fwd_default<Element, kHeadDim, kHeadDimV, true, true, false>(p, stream);
    return launch_fwd_default<Element, kHeadDim, kHeadDimV, false, true, false>(p, stream);
  }
  if constexpr (fwd_has_softcap_kernels<Element, kHeadDim, kHeadDimV>()) {
    if (softcap_fixed_max_ok(p.softcap)) {
      if (causal) return launch_fwd<Element, kHeadDim, SoftcapFwdTuning<kHeadDim, true>>(p, stream);
      return launch_fwd<Element, kHeadDim, SoftcapFwdTuning<kHeadDim, false>>(p, stream);
    }
  }
  if constexpr (fwd_short_causal(kHeadDim, kHeadDimV, true, 0)) {
    if (fwd_short_causal(kHeadDim, kHeadDimV, causal, p.seqlen_q))
      return launch_fwd<Element, kHeadDim, ShortCausalFwdTuning<kHeadDim, kHeadDimV>>(p, stream);
  }
  if (causal) return launch_fwd_default<Element, kHeadDim, kHeadDimV, true, false, false>(p, stream);
  return launch_fwd_default<Element, kHeadDim, kHeadDimV, false, false, false>(p, stream);
}

// The production forward with attention dropout of one (dtype, bucket or
// head-dim pair): a launcher (and translation unit) of its own,
// fwd_dropout_<dtype>_hdim<d>_sm90.cu.
template <typename Element, int kHeadDim, int kHeadDimV>
cudaError_t run_fwd_dropout_hdim(const FwdParams& p, cudaStream_t stream) {
  const MaskInfo mi = make_mask_info(p);
  const bool causal = fwd_causal_like(mi.wl, mi.wr);
  if (mi.q_span != nullptr) {  // packed sequences
    if (causal) return launch_fwd_default<Element, kHeadDim, kHeadDimV, true, true, true>(p, stream);
    return launch_fwd_default<Element, kHeadDim, kHeadDimV, false, true, true>(p, stream);
  }
  if (causal) return launch_fwd_default<Element, kHeadDim, kHeadDimV, true, false, true>(p, stream);
  return launch_fwd_default<Element, kHeadDim, kHeadDimV, false, false, true>(p, stream);
}

// The production FP8 forward of one (output dtype, bucket).
template <typename OutElement, int kHeadDim>
cudaError_t run_fwd_fp8_hdim(const Fp8FwdParams& p, cudaStream_t stream) {
  const MaskInfo mi = make_mask_info(p);
  if (fwd_causal_like(mi.wl, mi.wr))
    return launch_fwd_fp8<OutElement, kHeadDim, DefaultFwdTuning<kHeadDim, kHeadDim, true, 1>>(p, stream);
  return launch_fwd_fp8<OutElement, kHeadDim, DefaultFwdTuning<kHeadDim, kHeadDim, false, 1>>(p, stream);
}

}  // namespace jax_flash::sm90
