// Entry points of the FA3-style Hopper forward (sm_90a only).
#pragma once

#include <cuda_runtime.h>

#include "jax_flash/params.h"

namespace jax_flash::sm90 {

// True when run_fwd can serve `params` on the current device: an sm_90 GPU
// (the code is built for sm_90a), bf16/fp16 (if compiled), head_dim a multiple
// of 8 up to 256 (buckets 64 / 128 / 256, zero-padded), 16-byte aligned base
// pointers, strides that are multiples of 8 elements (TMA: 16-byte strides),
// enough opt-in shared memory, a compiled sm90_variant. Everything else
// (causal, windows, GQA/MQA, segment ids, softcap, any seqlen) is supported.
bool fwd_supported(const FwdParams& params);

// Launches on `stream`; cudaErrorNotSupported when !fwd_supported(params)
// (callers fall back to jax_flash::sm80::run_fwd), else the launch error.
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream);

}  // namespace jax_flash::sm90
