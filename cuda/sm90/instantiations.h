// Declarations of the per-(dtype, head-dim bucket) sm90 launchers, defined in
// launch_templates.cuh and explicitly instantiated one per file under
// cuda/instantiations/ (fwd_<dtype>_hdim<d>_sm90.cu, tools/gen_instantiations.py).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "jax_flash/params.h"

namespace jax_flash::sm90 {

template <typename Element, int kHeadDim>
cudaError_t run_fwd_hdim(const FwdParams& p, cudaStream_t stream);

// Variant encoding of FwdParams::sm90_variant: 0 = the default for the head
// dim (FA3's choice); 1 = pingpong + overlap, 2 = overlap only, 3 = pingpong
// only, 4 = neither. Non-default variants exist only in builds with
// -DJAX_FLASH_SM90_ABLATION (the self-test / benchmark).
constexpr int kNumVariants = 5;
constexpr int variant_flags(int variant, int default_flags) {
  return variant == 0 ? default_flags
                      : (((variant - 1) & 1) ? 0 : 1) | (((variant - 1) & 2) ? 0 : 2);
}
constexpr bool variant_compiled(int variant, int default_flags) {
#ifdef JAX_FLASH_SM90_ABLATION
  (void)default_flags;
  return variant >= 0 && variant < kNumVariants;
#else
  return variant >= 0 && variant < kNumVariants &&
         variant_flags(variant, default_flags) == default_flags;
#endif
}

}  // namespace jax_flash::sm90
