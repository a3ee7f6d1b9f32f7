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
//
// Tuning variants (>= 5): candidates for a new default, compiled only with
// -DJAX_FLASH_SM90_ABLATION and only for bf16; a variant that does not apply
// to a head-dim bucket is not available (fwd_supported false) rather than a
// copy of another one. Each keeps the default schedule flags of its bucket.
enum : int {
  kVarDynamic = 5,      // dynamic persistent scheduler (atomic tile counter, LPT order), all buckets
  kVarOInV = 6,         // hdim 256: O staged in the V ring instead of Q (next Q loads during the epilogue)
  kVarDynamicOInV = 7,  // hdim 256: 5 + 6
  kVarN176 = 8,         // hdim 128: 128 x 176 tile (FA3's non-causal), O in the V ring
  kVarN192 = 9,         // hdim 128: 128 x 192 tile, O in the V ring
  kVarN192Q = 10,       // hdim 128: 128 x 192 tile, O in Q (= the -DJAX_FLASH_SM90_BLOCKN_HDIM128=192 build)
  kVarTuned = 11,       // proposal, per mask: tuned_variant() below
  kNumVariants = 12,
};

constexpr int variant_flags(int variant, int default_flags) {
  return variant == 0 ? default_flags
                      : (((variant - 1) & 1) ? 0 : 1) | (((variant - 1) & 2) ? 0 : 2);
}

// The proposed per-(bucket, mask) choice behind kVarTuned (to become variant
// 0 once measured): causal-like masks (right bound, no left bound) take the
// dynamic scheduler (FA3 does for causal and local), hdim 256 with O in the
// V ring; without such a mask hdim 128 takes the 128 x 192 tile (FA3: 176,
// 192 "quite good too"; measured +4% at kernel level with O in Q) and hdim
// 256 O in V; hdim 64 stays as it is.
constexpr int tuned_variant(int hdim_bucket, bool causal_like) {
  if (causal_like) return hdim_bucket == 256 ? kVarDynamicOInV : kVarDynamic;
  return hdim_bucket == 128 ? kVarN192 : hdim_bucket == 256 ? kVarOInV : 0;
}

// Whether variant `variant` is compiled for (bucket, bf16 or not); without
// -DJAX_FLASH_SM90_ABLATION: 0 and the schedule variants equal to the default.
constexpr bool variant_available(int variant, int hdim_bucket, bool bf16, int default_flags) {
#ifdef JAX_FLASH_SM90_ABLATION
  (void)default_flags;
  if (variant >= 0 && variant < 5) return true;
  if (!bf16) return false;
  switch (variant) {
    case kVarDynamic: return true;
    case kVarOInV:
    case kVarDynamicOInV: return hdim_bucket == 256;
    case kVarN176:
    case kVarN192:
    case kVarN192Q: return hdim_bucket == 128;
    case kVarTuned: return true;
    default: return false;
  }
#else
  (void)hdim_bucket;
  (void)bf16;
  return variant >= 0 && variant < 5 && variant_flags(variant, default_flags) == default_flags;
#endif
}

// The variant actually launched (kVarTuned resolved for the mask).
constexpr int resolved_variant(int variant, int hdim_bucket, bool causal_like) {
  return variant == kVarTuned ? tuned_variant(hdim_bucket, causal_like) : variant;
}

// Whether the launched variant uses the dynamic scheduler (kFlagDynamic), i.e.
// needs FwdParams::sm90_tile_counter.
constexpr bool variant_uses_dynamic(int variant, int hdim_bucket, bool causal_like) {
  const int v = resolved_variant(variant, hdim_bucket, causal_like);
  return v == kVarDynamic || v == kVarDynamicOInV;
}

}  // namespace jax_flash::sm90
