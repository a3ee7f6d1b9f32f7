// Declarations of the per-(dtype, head-dim bucket) sm90 forward launchers and
// of the per-(dtype, head-dim pair) ones (kHeadDimV != kHeadDim: v and o have
// a head dim of their own; kHeadDimV defaults to the bucket's), defined in
// launch_templates.cuh and explicitly instantiated one per file under
// cuda/instantiations/ (fwd_<dtype>_hdim<d>_sm90.cu, a pair tagged
// hdim<d>v<d_v>; tools/codegen/gen_instantiations.py). Each runs the
// production configuration of its shape (fwd_tuning.h fwd_default_tuning) for
// the call's mask.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "jax_flash/params.h"

namespace jax_flash::sm90 {

template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
cudaError_t run_fwd_hdim(const FwdParams& p, cudaStream_t stream);

// With attention dropout: fwd_dropout_<dtype>_hdim<d>_sm90.cu.
template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
cudaError_t run_fwd_dropout_hdim(const FwdParams& p, cudaStream_t stream);

// Variable-length sequences (VarlenFwdParams):
// fwd_varlen_<dtype>_hdim<d>_sm90.cu (varlen_launch.cuh).
template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
cudaError_t run_fwd_varlen_hdim(const VarlenFwdParams& p, cudaStream_t stream);

// The FP8 forward (e4m3 inputs) writing O as OutElement (bf16 / fp16):
// fwd_e4m3_<out>_hdim<d>_sm90.cu.
template <typename OutElement, int kHeadDim>
cudaError_t run_fwd_fp8_hdim(const Fp8FwdParams& p, cudaStream_t stream);

}  // namespace jax_flash::sm90
