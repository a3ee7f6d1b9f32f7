// Launch of the decoding kernels for one element type (decode_bf16.cu,
// decode_fp16.cu instantiate it).
#pragma once

#include <cuda_runtime.h>

#include "decode/decode_combine.cuh"
#include "decode/decode_combine_cta.cuh"
#include "decode/decode_kernel.cuh"
#include "jax_flash/dispatch.h"
#include "jax_flash/head_dim.h"

namespace jax_flash::decode {

// The dynamic shared memory of one CTA, and the whole of the SM's unified
// L1 / shared memory as shared memory, so that the CTAs per SM that the
// split plan counts (decode_plan.h) do fit.
template <typename Kernel>
inline cudaError_t set_smem(Kernel kernel, int bytes) {
  const void* fn = reinterpret_cast<const void*>(kernel);
  cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         int(cudaSharedmemCarveoutMaxShared));
  if (err != cudaSuccess || bytes <= 48 * 1024) return err;
  return cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// One decode kernel of configuration Cfg (the split kernels only; the
// combine is launch_decode_combine).
template <typename Cfg, typename Kernel>
cudaError_t launch_decode_kernel(Kernel kernel, const DecodeParams& p, cudaStream_t stream) {
  cudaError_t err = set_smem(kernel, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int rows = p.seqlen_q * (p.num_heads / p.num_heads_k);
  const dim3 grid((rows + Cfg::kRows - 1) / Cfg::kRows, p.batch * p.num_heads_k, p.num_splits);
  JF_LAUNCH(kernel, grid, Cfg::kThreads, Cfg::kSmemBytes, stream)(p);
  return cudaGetLastError();
}

template <typename Element, int kHeadDim, int kMT, bool kFp8>
cudaError_t launch_decode_shape(const DecodeParams& p, cudaStream_t stream) {
  using Cfg = DecodeConfig<kHeadDim, kMT, kFp8>;
  auto kernel = p.sm.softcap_pre != 0.f ? decode_kernel<Element, kHeadDim, kMT, true, kFp8>
                                        : decode_kernel<Element, kHeadDim, kMT, false, kFp8>;
  return launch_decode_kernel<Cfg>(kernel, p, stream);
}

// The combine of several splits' partials (nothing for one split), by the
// kernel `kind` names (decode_params.h's decode_combine_kind: the policy).
template <typename Element>
cudaError_t launch_decode_combine(const DecodeParams& p, cudaStream_t stream, CombineKind kind) {
  if (p.num_splits == 1) return cudaSuccess;
  const int64_t rows = int64_t(p.batch) * p.num_heads * p.seqlen_q;
  if (kind == CombineKind::kCtaPerRow) {
    auto combine = decode_combine_cta_kernel<Element>;
    static_assert(decode_combine_cta_smem(256) <= 48 * 1024, "no opt-in shared memory");
    JF_LAUNCH(combine, dim3(unsigned(rows)), kCombineCtaThreads, decode_combine_cta_smem(p.head_dim),
              stream)(p);
    return cudaGetLastError();
  }
  const dim3 grid(unsigned((rows + kCombineWarps - 1) / kCombineWarps));
  auto combine = decode_combine_kernel<Element>;
  JF_LAUNCH(combine, grid, kCombineWarps * 32, 0, stream)(p);
  return cudaGetLastError();
}

template <typename Element, int kHeadDim, bool kFp8>
cudaError_t launch_decode_cache(const DecodeParams& p, cudaStream_t stream) {
  if constexpr (kHeadDim <= 128) {
    if (decode_m_tiles(p.seqlen_q, p.num_heads / p.num_heads_k, kHeadDim) == 2)
      return launch_decode_shape<Element, kHeadDim, 2, kFp8>(p, stream);
  }
  return launch_decode_shape<Element, kHeadDim, 1, kFp8>(p, stream);
}

template <typename Element, int kHeadDim>
cudaError_t launch_decode_hdim(const DecodeParams& p, cudaStream_t stream) {
  if (!p.kv_fp8) return launch_decode_cache<Element, kHeadDim, false>(p, stream);
  // FP8: e4m3 pairs in 32-column blocks (decode_fp8.cuh): no 96 bucket.
  if constexpr (kHeadDim % 64 == 0) return launch_decode_cache<Element, kHeadDim, true>(p, stream);
  return cudaErrorNotSupported;
}

// The split kernel alone (one split: the whole call).
template <typename Element>
cudaError_t launch_decode_split(const DecodeParams& p, cudaStream_t stream) {
  // Decoding runs in the sm80 buckets (kernel_table.h), as the sm80 dispatcher.
  return dispatch_head_dim(
      Sm80HeadDims{}, rounded_head_dim(p.head_dim), cudaErrorNotSupported,
      [&](auto d) { return launch_decode_hdim<Element, decltype(d)::value>(p, stream); });
}

}  // namespace jax_flash::decode
