// Declaration of the per-(dtype, head-dim bucket) sm90 backward launchers,
// defined in bwd_launch_templates.cuh and explicitly instantiated one per file
// under cuda/instantiations/ (bwd_<dtype>_hdim<d>_sm90.cu,
// tools/gen_instantiations.py), and the backward's schedule variants.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "jax_flash/params.h"

namespace jax_flash::sm90 {

// BwdParams::sm90_bwd_variant: 0 = the default, resolved per case by
// resolved_bwd_variant; 1 = the bucket's tile with one bulk reduction per dQ
// row (ablation builds, -DJAX_FLASH_SM90_ABLATION, only); 2 = kBlockM 80
// (hdim-128 bucket, no causal / local bound, not deterministic); 3 = the
// bucket's tile with TMA tensor reductions of dQ (BwdConfigFor).
enum : int { kBwdVarDefault = 0, kBwdVarRowReduce = 1, kBwdVarBm80 = 2, kBwdVarTensor = 3, kBwdNumVariants = 4 };

// What variant 0 runs. The 80-row tile has no deterministic kernel (its
// dQ tiles would need their own semaphore layout) and no mask-bound block
// skipping; everything else takes the bucket's 64-row tile (128 at hdim 64).
constexpr int resolved_bwd_variant(int variant, int hdim_bucket, bool mask_bounded, bool deterministic) {
  if (variant != kBwdVarDefault) return variant;
  return hdim_bucket == 128 && !mask_bounded && !deterministic ? kBwdVarBm80 : kBwdVarTensor;
}

template <typename Element, int kHeadDim>
cudaError_t run_bwd_hdim(const BwdParams& p, cudaStream_t stream);

}  // namespace jax_flash::sm90
