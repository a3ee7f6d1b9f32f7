// Declarations of the per-(dtype, head-dim bucket) launchers, and of the
// per-(dtype, head-dim pair) ones (kHeadDimV != kHeadDim: v and o have a head
// dim of their own; kHeadDimV defaults to the bucket's). Each one is
// defined in launch_templates.cuh and explicitly instantiated in exactly one
// generated file under cuda/instantiations/ (tools/codegen/gen_instantiations.py), so
// the dispatcher compiles in seconds and a build can leave buckets out with
// -DJAX_FLASH_DISABLE_{HDIM64,HDIM96,HDIM128,HDIM256,HDIM192V128,FP16,BACKWARD}.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "jax_flash/params.h"

namespace jax_flash::sm80 {

template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
cudaError_t run_fwd_hdim(const FwdParams& p, cudaStream_t stream);

template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
cudaError_t run_bwd_hdim(const BwdParams& p, cudaStream_t stream);

// The same with attention dropout (p.dropout.enabled()): kernels of their own,
// in files of their own.
template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
cudaError_t run_fwd_dropout_hdim(const FwdParams& p, cudaStream_t stream);

template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
cudaError_t run_bwd_dropout_hdim(const BwdParams& p, cudaStream_t stream);

}  // namespace jax_flash::sm80
