// Declaration of the per-(dtype, head-dim bucket) sm90 backward launchers,
// defined in bwd_launch_templates.cuh and explicitly instantiated one per file
// under cuda/instantiations/ (bwd_<dtype>_hdim<d>_sm90.cu,
// tools/codegen/gen_instantiations.py). Each runs the tile that bwd_default_tile
// (bwd_policy.h) picks for the case.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "jax_flash/params.h"

namespace jax_flash::sm90 {

// kHeadDimV: a head-dim pair (v, dO, dV of their own head dim,
// bwd_<dtype>_hdim<d>v<d_v>_sm90.cu), served exactly.
template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
cudaError_t run_bwd_hdim(const BwdParams& p, cudaStream_t stream);

// With attention dropout: bwd_dropout_<dtype>_hdim<d>_sm90.cu.
template <typename Element, int kHeadDim>
cudaError_t run_bwd_dropout_hdim(const BwdParams& p, cudaStream_t stream);

// Variable-length sequences, per-sequence tiles: bwd_varlen_<dtype>_hdim<d>_sm90.cu
// (bwd_varlen_launch.cuh).
template <typename Element, int kHeadDim>
cudaError_t run_bwd_varlen_hdim(const VarlenBwdParams& p, cudaStream_t stream);

}  // namespace jax_flash::sm90
