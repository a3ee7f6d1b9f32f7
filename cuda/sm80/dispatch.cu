// run_fwd / run_bwd: validate the request, pick the (dtype, head-dim bucket)
// instantiation. Buckets switched off at build time (JAX_FLASH_DISABLE_*)
// answer cudaErrorNotSupported instead of failing to link.
#include <cstdint>

#include "instantiations.h"
#include "jax_flash/support.h"
#include "launch.h"

namespace jax_flash::sm80 {
namespace {

// The kernels move 16-byte chunks (8 elements) with cp.async: every stride
// must be a multiple of 8 elements and the base pointers 16-byte aligned.
bool strides_ok(int64_t b, int64_t r, int64_t h) { return b % 8 == 0 && r % 8 == 0 && h % 8 == 0; }

cudaError_t validate(const FwdParams& p) {
  if (!problem_ok(p)) return cudaErrorInvalidValue;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.o))
    return cudaErrorInvalidValue;
  if (!strides_ok(p.q_batch_stride, p.q_row_stride, p.q_head_stride) ||
      !strides_ok(p.k_batch_stride, p.k_row_stride, p.k_head_stride) ||
      !strides_ok(p.v_batch_stride, p.v_row_stride, p.v_head_stride) ||
      !strides_ok(p.o_batch_stride, p.o_row_stride, p.o_head_stride))
    return cudaErrorInvalidValue;
  return cudaSuccess;
}

template <typename Element>
cudaError_t fwd_dtype(const FwdParams& p, cudaStream_t stream) {
  const int d = rounded_head_dim(p.head_dim);
  switch (d) {
#ifndef JAX_FLASH_DISABLE_HDIM64
    case 64: return run_fwd_hdim<Element, 64>(p, stream);
#endif
#ifndef JAX_FLASH_DISABLE_HDIM96
    case 96: return run_fwd_hdim<Element, 96>(p, stream);
#endif
#ifndef JAX_FLASH_DISABLE_HDIM128
    case 128: return run_fwd_hdim<Element, 128>(p, stream);
#endif
#ifndef JAX_FLASH_DISABLE_HDIM256
    case 256: return run_fwd_hdim<Element, 256>(p, stream);
#endif
    default: return cudaErrorNotSupported;
  }
}

#ifndef JAX_FLASH_DISABLE_BACKWARD
template <typename Element>
cudaError_t bwd_dtype(const BwdParams& p, cudaStream_t stream) {
  switch (p.head_dim_rounded) {
#ifndef JAX_FLASH_DISABLE_HDIM64
    case 64: return run_bwd_hdim<Element, 64>(p, stream);
#endif
#ifndef JAX_FLASH_DISABLE_HDIM96
    case 96: return run_bwd_hdim<Element, 96>(p, stream);
#endif
#ifndef JAX_FLASH_DISABLE_HDIM128
    case 128: return run_bwd_hdim<Element, 128>(p, stream);
#endif
#ifndef JAX_FLASH_DISABLE_HDIM256
    case 256: return run_bwd_hdim<Element, 256>(p, stream);
#endif
    default: return cudaErrorNotSupported;
  }
}
#endif

}  // namespace

cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream) {
  cudaError_t err = validate(p);
  if (err != cudaSuccess) return err;
  if (p.lse == nullptr) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.seqlen_q == 0) return cudaSuccess;  // nothing to write
  switch (p.dtype) {
    case DType::kBFloat16: return fwd_dtype<__nv_bfloat16>(p, stream);
#ifndef JAX_FLASH_DISABLE_FP16
    case DType::kFloat16: return fwd_dtype<__half>(p, stream);
#endif
    default: return cudaErrorNotSupported;
  }
}

cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream) {
#ifdef JAX_FLASH_DISABLE_BACKWARD
  (void)p;
  (void)stream;
  return cudaErrorNotSupported;
#else
  cudaError_t err = validate(p);
  if (err != cudaSuccess) return err;
  if (!bwd_buffers_ok(p)) return cudaErrorInvalidValue;
  if (!aligned16(p.dout) || !aligned16(p.dq) || !aligned16(p.dk) || !aligned16(p.dv))
    return cudaErrorInvalidValue;
  // Deterministic mode makes dQ in its own kernel, without the workspace.
  if (!p.deterministic && !dq_accum_ok(p)) return cudaErrorInvalidValue;
  if (p.batch == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kBFloat16: return bwd_dtype<__nv_bfloat16>(p, stream);
#ifndef JAX_FLASH_DISABLE_FP16
    case DType::kFloat16: return bwd_dtype<__half>(p, stream);
#endif
    default: return cudaErrorNotSupported;
  }
#endif
}

}  // namespace jax_flash::sm80
