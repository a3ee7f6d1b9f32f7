// The launchers of the sm90 forward ablations (sm90_fwd_ablation.h) for one
// head-dim bucket or pair; included by fwd_ablation_hdim<d>_sm90.cu, one
// translation unit per bucket or pair so that the build compiles them in
// parallel.
#pragma once

#include <utility>

#include "sm90/fwd/launch_templates.cuh"
#include "sm90_fwd_ablation.h"

namespace jax_flash::sm90::ablation {

// Ablation kAblation of the production configuration of (kHeadDim,
// kHeadDimV, kCausalLike), with dropout for a dropout ablation.
template <int kAblation, int kHeadDim, int kHeadDimV, bool kCausalLike>
struct AblationTuning {
  static constexpr FwdTuning value = kFwdAblations[kAblation].modify(
      fwd_default_tuning(kHeadDim, kHeadDimV, kCausalLike, 2, false, kFwdAblations[kAblation].dropout),
      kHeadDim);
};

// Whether ablation kAblation gives the configuration of an earlier one or of
// the default (for a dropout ablation the default dropout kernel), e.g.
// "neither" at hdim 256, which has no pingpong anyway.
template <int kAblation, int kHeadDim, int kHeadDimV, bool kCausalLike, int... kEarlier>
constexpr bool repeats_earlier(std::integer_sequence<int, kEarlier...>) {
  constexpr FwdTuning t = AblationTuning<kAblation, kHeadDim, kHeadDimV, kCausalLike>::value;
  return same_tuning(t, fwd_default_tuning(kHeadDim, kHeadDimV, kCausalLike, 2, false,
                                           kFwdAblations[kAblation].dropout)) ||
         (same_tuning(t, AblationTuning<kEarlier, kHeadDim, kHeadDimV, kCausalLike>::value) || ...);
}

template <int kAblation, int kHeadDim, int kHeadDimV, bool kCausalLike>
FwdLaunch ablation_launcher() {
  using T = AblationTuning<kAblation, kHeadDim, kHeadDimV, kCausalLike>;
  if constexpr (kFwdAblations[kAblation].softcap_branch) {
    // The default's tuning, launched directly (run_fwd sends these calls to the softcap kernels).
    if constexpr (fwd_has_softcap_kernels<__nv_bfloat16, kHeadDim, kHeadDimV>()) {
      return &launch_fwd<__nv_bfloat16, kHeadDim, AblationTuning<0, kHeadDim, kHeadDimV, kCausalLike>, kHeadDimV>;
    } else {
      return nullptr;
    }
  } else if constexpr (kAblation == 0 || repeats_earlier<kAblation, kHeadDim, kHeadDimV, kCausalLike>(
                                             std::make_integer_sequence<int, kAblation>{})) {
    return nullptr;  // index 0 is run_fwd; a configuration is compiled once
  } else {
    return &launch_fwd<__nv_bfloat16, kHeadDim, T, kHeadDimV>;
  }
}

template <int kHeadDim, int kHeadDimV, int... kI>
FwdAblationBucket make_bucket(std::integer_sequence<int, kI...>) {
  FwdAblationBucket b{};
  ((b.launch[kI][0] = ablation_launcher<kI, kHeadDim, kHeadDimV, false>(),
    b.launch[kI][1] = ablation_launcher<kI, kHeadDim, kHeadDimV, true>()),
   ...);
  return b;
}

// A bucket (kHeadDimV = kHeadDim) or a head-dim pair.
template <int kHeadDim, int kHeadDimV = kHeadDim>
FwdAblationBucket make_bucket() {
  return make_bucket<kHeadDim, kHeadDimV>(std::make_integer_sequence<int, kNumFwdAblations>{});
}

}  // namespace jax_flash::sm90::ablation
