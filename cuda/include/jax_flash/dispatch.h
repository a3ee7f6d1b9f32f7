// From a request to the compiled instantiation: the element type and the
// head-dim bucket as C++ types / constants, the same way in every family.
// Pieces left out of a build (-DJAX_FLASH_DISABLE_FP16, _HDIM<d>)
// answer cudaErrorNotSupported instead of failing to link.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "jax_flash/head_dim.h"
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

// run(std::integral_constant<int, kBucket>{}) for the family's bucket
// kBucket == bucket if this build compiles it (head_dim_bucket_compiled,
// kernel_table.h); else `otherwise`.
template <int... kBuckets, typename Result, typename Run>
Result dispatch_head_dim(HeadDimBuckets<kBuckets...>, int bucket, Result otherwise, Run&& run) {
  Result result = otherwise;
  const auto one = [&](auto b) {
    if constexpr (head_dim_bucket_compiled(decltype(b)::value)) result = run(b);
    return true;
  };
  ((bucket == kBuckets && one(std::integral_constant<int, kBuckets>{})) || ...);
  return result;
}

// run(HeadDimPair<kD, kDv>{}) for the family's pair (d, dv) if this build
// compiles it (head_dim_pair_compiled, kernel_table.h); else `otherwise`.
template <typename... Pairs, typename Result, typename Run>
Result dispatch_head_dim_pair(HeadDimPairs<Pairs...>, int d, int dv, Result otherwise, Run&& run) {
  Result result = otherwise;
  const auto one = [&](auto pair) {
    using P = decltype(pair);
    if constexpr (head_dim_pair_compiled(P::kHeadDim, P::kHeadDimV)) result = run(pair);
    return true;
  };
  ((d == Pairs::kHeadDim && dv == Pairs::kHeadDimV && one(Pairs{})) || ...);
  return result;
}

}  // namespace jax_flash
