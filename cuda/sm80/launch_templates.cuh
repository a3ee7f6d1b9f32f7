// Host-side launch of one (dtype, head-dim bucket or pair): grid shapes, dynamic
// shared memory opt-in, workspace zeroing, error checks. Included only by the
// generated files in cuda/instantiations/ (one explicit instantiation each).
#pragma once

#include <cuda_runtime.h>

#include "bwd_dq_kernel.cuh"
#include "bwd_kernel.cuh"
#include "fwd_kernel.cuh"
#include "jax_flash/device_attribute.h"
#include "jax_flash/dq_convert.cuh"
#include "instantiations.h"
#include "kernel_traits.cuh"

namespace jax_flash::sm80 {

// Opt in to more than 48 KB of dynamic shared memory (needed once per
// function and device; cheap enough to repeat on every launch).
template <typename Kernel>
inline cudaError_t set_smem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                              cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// Opt-in shared memory per block of the current device.
inline int max_smem_optin() {
  return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(48 * 1024);
}

// Dynamic shared memory of the forward (dropout: the key words and each
// thread's keep bits, fwd_kernel.cuh).
template <typename Cfg, bool kDropout>
constexpr int fwd_smem_bytes() {
  using Keep = FragKeep<Cfg::kMT, Cfg::kNT_S>;
  constexpr int kDropoutBytes = kDropoutSmemBytes + Cfg::kThreads * Keep::kBytesPerThread;
  return Cfg::kSmemBytes + (kDropout ? kDropoutBytes : 0);
}

// kDropout: the dropout kernels (instantiated in files of their own,
// run_*_dropout_hdim; dispatch.cu picks them when p.dropout.enabled()).
template <typename Element, typename Cfg, bool kDropout = false>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
  const FwdKernelArgs args{p, make_mask_info(p), make_softmax_scale(p.scale, p.softcap)};
  const bool packed = args.mask.q_span != nullptr;  // packed sequences: their own kernels
  auto kernel = p.softcap > 0.f ? (packed ? fwd_kernel<Element, Cfg, true, true, kDropout>
                                          : fwd_kernel<Element, Cfg, true, false, kDropout>)
                                : (packed ? fwd_kernel<Element, Cfg, false, true, kDropout>
                                          : fwd_kernel<Element, Cfg, false, false, kDropout>);
  constexpr int kSmem = fwd_smem_bytes<Cfg, kDropout>();
  cudaError_t err = set_smem(kernel, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, p.num_heads, p.batch);
  JF_LAUNCH(kernel, grid, Cfg::kThreads, kSmem, stream)(args);
  return cudaGetLastError();
}

template <typename Element, int kHeadDim, int kHeadDimV, bool kDropout>
cudaError_t run_fwd_impl(const FwdParams& p, cudaStream_t stream) {
  using Pref = typename FwdConfigFor<kHeadDim, kHeadDimV>::type;
  using Small = typename FwdConfigSmallFor<kHeadDim, kHeadDimV>::type;
  const int optin = max_smem_optin();
  if (fwd_smem_bytes<Pref, kDropout>() <= optin)
    return launch_fwd<Element, Pref, kDropout>(p, stream);
  if (fwd_smem_bytes<Small, kDropout>() <= optin)
    return launch_fwd<Element, Small, kDropout>(p, stream);
  return cudaErrorNotSupported;  // not enough shared memory on this GPU
}

template <typename Element, int kHeadDim, int kHeadDimV>
cudaError_t run_fwd_hdim(const FwdParams& p, cudaStream_t stream) {
  return run_fwd_impl<Element, kHeadDim, kHeadDimV, false>(p, stream);
}
template <typename Element, int kHeadDim, int kHeadDimV>
cudaError_t run_fwd_dropout_hdim(const FwdParams& p, cudaStream_t stream) {
  return run_fwd_impl<Element, kHeadDim, kHeadDimV, true>(p, stream);
}

// Dynamic shared memory of the backward's main kernel (dropout: the keep
// table, bwd_kernel.cuh; it never takes the bulk dQ tile).
template <typename Cfg, bool kBulkDq, bool kDropout>
constexpr int bwd_smem_bytes() {
  if constexpr (kDropout)
    return Cfg::kSmemBytes + KeepTable<Cfg::kBlockM, Cfg::kBlockN, Cfg::kThreads>::kBytes;
  return kBulkDq ? Cfg::kSmemBytesBulkDq : Cfg::kSmemBytes;
}

template <typename Element, typename Cfg, bool kBulkDq, bool kDropout>
cudaError_t launch_bwd_main(const BwdKernelArgs& args, cudaStream_t stream) {
  const BwdParams& p = args.p;
  constexpr int kSmem = bwd_smem_bytes<Cfg, kBulkDq, kDropout>();
  auto kernel = args.mask.q_span != nullptr ? bwd_kernel<Element, Cfg, kBulkDq, true, kDropout>
                                            : bwd_kernel<Element, Cfg, kBulkDq, false, kDropout>;
  cudaError_t err = set_smem(kernel, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN, p.num_heads_k, p.batch);
  JF_LAUNCH(kernel, grid, Cfg::kThreads, kSmem, stream)(args);
  return cudaGetLastError();
}

// The dropout kernels always take the float2 atomics for dQ (half the
// variants; the bulk reductions are an sm90 refinement of a family that sm90
// serves with its own kernels).
template <typename Element, int kHeadDim, typename Cfg, typename DqCfg, bool kDropout>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
  const BwdKernelArgs args{p, make_mask_info(p), make_softmax_scale(p.scale, p.softcap)};
  cudaError_t err;

  if (!p.deterministic) {  // dq_accum is uninitialised on entry
    const size_t bytes = size_t(p.batch) * p.num_heads * p.seqlen_q_rounded * kHeadDim * sizeof(float);
    err = cudaMemsetAsync(p.dq_accum, 0, bytes, stream);
    if (err != cudaSuccess) return err;
  }

  if (p.seqlen_k > 0) {  // dK, dV (and dQ in fast mode)
    // sm90: dQ by bulk reductions from shared memory where the staging tile fits.
    if constexpr (kDropout) {
      err = launch_bwd_main<Element, Cfg, false, true>(args, stream);
    } else {
      const bool bulk_dq = !p.deterministic &&
                           device_attribute<cudaDevAttrComputeCapabilityMajor>(0) >= 9 &&
                           Cfg::kSmemBytesBulkDq <= max_smem_optin();
      err = bulk_dq ? launch_bwd_main<Element, Cfg, true, false>(args, stream)
                    : launch_bwd_main<Element, Cfg, false, false>(args, stream);
    }
    if (err != cudaSuccess) return err;
  }

  if (p.seqlen_q == 0) return cudaSuccess;  // no dQ rows
  if (p.deterministic) {  // dQ by its own sweep over KV blocks
    auto kernel = args.mask.q_span != nullptr ? bwd_dq_kernel<Element, DqCfg, true, kDropout>
                                              : bwd_dq_kernel<Element, DqCfg, false, kDropout>;
    err = set_smem(kernel, DqCfg::kSmemBytes);
    if (err != cudaSuccess) return err;
    const dim3 grid((p.seqlen_q + DqCfg::kBlockM - 1) / DqCfg::kBlockM, p.num_heads, p.batch);
    JF_LAUNCH(kernel, grid, DqCfg::kThreads, DqCfg::kSmemBytes, stream)(args);
  } else {  // dq = scale * dq_accum (dropout: times keep_scale, see bwd_kernel.cuh)
    auto kernel = dq_convert_kernel<Element, kHeadDim>;
    DqConvertArgs conv{p};
    if constexpr (kDropout) conv.p.scale *= dropout_keep_scale(p.dropout);
    JF_LAUNCH(kernel, dq_convert_grid(p, kHeadDim), kDqConvertThreads, 0, stream)(conv);
  }
  return cudaGetLastError();
}

// dq_accum's rows are kHeadDim wide (head_dim_rounded: the bucket, or a
// pair's query/key head dim).
template <typename Element, int kHeadDim, int kHeadDimV, bool kDropout>
cudaError_t run_bwd_impl(const BwdParams& p, cudaStream_t stream) {
  using Pref = typename BwdConfigFor<kHeadDim, kHeadDimV>::type;
  using Small = typename BwdConfigSmallFor<kHeadDim, kHeadDimV>::type;
  using DqPref = typename DqConfigFor<kHeadDim, kHeadDimV>::type;
  using DqSmall = typename DqConfigSmallFor<kHeadDim, kHeadDimV>::type;
  const int optin = max_smem_optin();
  if (bwd_smem_bytes<Pref, false, kDropout>() <= optin && DqPref::kSmemBytes <= optin)
    return launch_bwd<Element, kHeadDim, Pref, DqPref, kDropout>(p, stream);
  if (bwd_smem_bytes<Small, false, kDropout>() <= optin && DqSmall::kSmemBytes <= optin)
    return launch_bwd<Element, kHeadDim, Small, DqSmall, kDropout>(p, stream);
  return cudaErrorNotSupported;  // not enough shared memory on this GPU
}

template <typename Element, int kHeadDim, int kHeadDimV>
cudaError_t run_bwd_hdim(const BwdParams& p, cudaStream_t stream) {
  return run_bwd_impl<Element, kHeadDim, kHeadDimV, false>(p, stream);
}
template <typename Element, int kHeadDim, int kHeadDimV>
cudaError_t run_bwd_dropout_hdim(const BwdParams& p, cudaStream_t stream) {
  return run_bwd_impl<Element, kHeadDim, kHeadDimV, true>(p, stream);
}

}  // namespace jax_flash::sm80
