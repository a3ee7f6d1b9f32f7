// run_fwd / run_bwd: validate the request, pick the (dtype, head-dim bucket)
// instantiation, or the (dtype, head-dim pair) one when v's head dim differs
// from q's and k's (a pair without kernels: cudaErrorNotSupported). Buckets switched off at build time (JAX_FLASH_DISABLE_*)
// answer cudaErrorNotSupported instead of failing to link
// (jax_flash/dispatch.h).
#include <cstdint>

#include "instantiations.h"
#include "jax_flash/dispatch.h"
#include "jax_flash/head_dim.h"
#include "jax_flash/support.h"
#include "launch.h"

namespace jax_flash::sm80 {
namespace {

// The kernels move 16-byte chunks (8 elements) with cp.async: every stride
// must be a multiple of 8 elements and the base pointers 16-byte aligned.
bool strides_ok(int64_t b, int64_t r, int64_t h) { return b % 8 == 0 && r % 8 == 0 && h % 8 == 0; }

cudaError_t validate(const FwdParams& p) {
  if (!problem_ok(p)) return cudaErrorInvalidValue;
  if (p.dropout.enabled() && (p.dropout.words == nullptr || p.dropout.threshold > 255))
    return cudaErrorInvalidValue;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.o))
    return cudaErrorInvalidValue;
  if (!strides_ok(p.q_batch_stride, p.q_row_stride, p.q_head_stride) ||
      !strides_ok(p.k_batch_stride, p.k_row_stride, p.k_head_stride) ||
      !strides_ok(p.v_batch_stride, p.v_row_stride, p.v_head_stride) ||
      !strides_ok(p.o_batch_stride, p.o_row_stride, p.o_head_stride))
    return cudaErrorInvalidValue;
  return cudaSuccess;
}

// The sm80 buckets (rounded_head_dim); the backward's is the dq_accum pitch.
// Two head dims: the pair's kernels (Sm80HeadDimPairs), served exactly.
template <typename Element>
cudaError_t fwd_dtype(const FwdParams& p, cudaStream_t stream) {
  if (p.head_dim_v != p.head_dim)
    return dispatch_head_dim_pair(Sm80HeadDimPairs{}, p.head_dim, p.head_dim_v, cudaErrorNotSupported,
                                  [&](auto pair) {
                                    using P = decltype(pair);
                                    constexpr int kD = P::kHeadDim, kDv = P::kHeadDimV;
                                    return p.dropout.enabled()
                                               ? run_fwd_dropout_hdim<Element, kD, kDv>(p, stream)
                                               : run_fwd_hdim<Element, kD, kDv>(p, stream);
                                  });
  return dispatch_head_dim(Sm80HeadDims{}, rounded_head_dim(p.head_dim), cudaErrorNotSupported,
                           [&](auto d) {
                             constexpr int kD = decltype(d)::value;
                             return p.dropout.enabled() ? run_fwd_dropout_hdim<Element, kD>(p, stream)
                                                        : run_fwd_hdim<Element, kD>(p, stream);
                           });
}

#ifndef JAX_FLASH_DISABLE_BACKWARD
template <typename Element>
cudaError_t bwd_dtype(const BwdParams& p, cudaStream_t stream) {
  if (p.head_dim_v != p.head_dim)
    return dispatch_head_dim_pair(Sm80HeadDimPairs{}, p.head_dim, p.head_dim_v, cudaErrorNotSupported,
                                  [&](auto pair) {
                                    using P = decltype(pair);
                                    constexpr int kD = P::kHeadDim, kDv = P::kHeadDimV;
                                    return p.dropout.enabled()
                                               ? run_bwd_dropout_hdim<Element, kD, kDv>(p, stream)
                                               : run_bwd_hdim<Element, kD, kDv>(p, stream);
                                  });
  return dispatch_head_dim(Sm80HeadDims{}, p.head_dim_rounded, cudaErrorNotSupported,
                           [&](auto d) {
                             constexpr int kD = decltype(d)::value;
                             return p.dropout.enabled() ? run_bwd_dropout_hdim<Element, kD>(p, stream)
                                                        : run_bwd_hdim<Element, kD>(p, stream);
                           });
}
#endif

}  // namespace

cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream) {
  cudaError_t err = validate(p);
  if (err != cudaSuccess) return err;
  if (p.lse == nullptr) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.seqlen_q == 0) return cudaSuccess;  // nothing to write
  return dispatch_dtype(p.dtype, [&](auto e) { return fwd_dtype<typename decltype(e)::type>(p, stream); });
}

#ifdef JAX_FLASH_DISABLE_BACKWARD
cudaError_t run_bwd(const BwdParams&, cudaStream_t) { return cudaErrorNotSupported; }
#else
cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream) {
  cudaError_t err = validate(p);
  if (err != cudaSuccess) return err;
  if (!bwd_buffers_ok(p)) return cudaErrorInvalidValue;
  if (!aligned16(p.dout) || !aligned16(p.dq) || !aligned16(p.dk) || !aligned16(p.dv))
    return cudaErrorInvalidValue;
  // Deterministic mode makes dQ in its own kernel, without the workspace.
  if (!p.deterministic && !dq_accum_ok(p)) return cudaErrorInvalidValue;
  if (p.batch == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto e) { return bwd_dtype<typename decltype(e)::type>(p, stream); });
}
#endif

}  // namespace jax_flash::sm80
