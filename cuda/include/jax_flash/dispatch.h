// From a request to the compiled instantiation: the element type and the
// head-dim bucket as C++ types / constants, the same way in every family.
// Pieces left out of a build (-DJAX_FLASH_DISABLE_FP16, _HDIM64 ... _HDIM256)
// answer cudaErrorNotSupported instead of failing to link.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "jax_flash/params.h"

namespace jax_flash {

template <typename T>
struct ElementTag {
  using type = T;
};

// run(ElementTag<Element>{}) for the dtype; cudaErrorNotSupported if it is
// not compiled in.
template <typename Run>
cudaError_t dispatch_dtype(DType dtype, Run&& run) {
  switch (dtype) {
    case DType::kBFloat16: return run(ElementTag<__nv_bfloat16>{});
#ifndef JAX_FLASH_DISABLE_FP16
    case DType::kFloat16: return run(ElementTag<__half>{});
#endif
    default: return cudaErrorNotSupported;
  }
}

// Buckets left out of a build (-DJAX_FLASH_DISABLE_HDIM64 ... 256): their
// requests answer cudaErrorNotSupported instead of failing to link.
constexpr bool head_dim_bucket_compiled(int bucket) {
#ifdef JAX_FLASH_DISABLE_HDIM64
  if (bucket == 64) return false;
#endif
#ifdef JAX_FLASH_DISABLE_HDIM96
  if (bucket == 96) return false;
#endif
#ifdef JAX_FLASH_DISABLE_HDIM128
  if (bucket == 128) return false;
#endif
#ifdef JAX_FLASH_DISABLE_HDIM256
  if (bucket == 256) return false;
#endif
  return bucket > 0;
}

// run(std::integral_constant<int, kBucket>{}) for the family's bucket
// kBucket == bucket (one of kBuckets, compiled in); else cudaErrorNotSupported.
template <int... kBuckets, typename Run>
cudaError_t dispatch_head_dim(int bucket, Run&& run) {
  cudaError_t result = cudaErrorNotSupported;
  const auto one = [&](auto b) {
    if constexpr (head_dim_bucket_compiled(decltype(b)::value)) result = run(b);
    return true;
  };
  ((bucket == kBuckets && one(std::integral_constant<int, kBuckets>{})) || ...);
  return result;
}

}  // namespace jax_flash
