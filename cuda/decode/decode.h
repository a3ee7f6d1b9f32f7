// Host API of the decoding kernels (decode_kernel.cuh, decode_combine.cuh).
#pragma once

#include <cuda_runtime.h>

#include "decode/decode_params.h"

namespace jax_flash::decode {

// The request checks of the decoding kernels: bf16 / fp16, head_dim a
// multiple of 8 up to 256, num_heads % num_heads_k == 0, 1 <= num_splits <=
// kDecodeMaxSplits with the partials given when num_splits > 1, grids within
// CUDA's limits. An empty batch, zero new tokens or an empty cache are
// well-formed.
bool decode_supported(const DecodeParams& p);

// The split kernel, then (num_splits > 1) the combine kernel, on `stream`.
cudaError_t run_decode(const DecodeParams& p, cudaStream_t stream);

// run_decode's two launches apart (the self-test's benchmark times the
// combine kernels against each other): the split kernel, then the combine
// by the kernel `kind` (nothing for one split).
cudaError_t run_decode_split(const DecodeParams& p, cudaStream_t stream);
cudaError_t run_decode_combine(const DecodeParams& p, CombineKind kind, cudaStream_t stream);

}  // namespace jax_flash::decode
