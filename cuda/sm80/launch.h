// Entry points of the FA2-style sm80 kernel family (also runs on sm90).
#pragma once

#include <cuda_runtime.h>

#include "jax_flash/params.h"

namespace jax_flash::sm80 {

// Launch on `stream`; return the launch error (cudaGetLastError) or cudaSuccess.
// Head dims up to 256 (bucketed to 64/96/128/256), and the head-dim pairs of
// head_dim.h where v and o have their own head dim (head_dim_v: 192 / 128),
// fp16 and bf16.
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream);
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream);

}  // namespace jax_flash::sm80
