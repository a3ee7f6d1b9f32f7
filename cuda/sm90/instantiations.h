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

// Variant encoding of FwdParams::sm90_variant: 0 = the default, chosen per
// (head-dim bucket, mask) by default_variant() below; 1 = pingpong + overlap,
// 2 = overlap only, 3 = pingpong only, 4 = neither (all four with the static
// scheduler, the bucket's default tile and its other default flags: Q in
// registers at hdim 128, with the overlap only, i.e. variants 1 and 2). Variants 1-4 other than the
// bucket's default flags exist only in builds with -DJAX_FLASH_SM90_ABLATION
// (the self-test / benchmark).
//
// Tuning variants (>= 5) keep the default schedule flags of their bucket; a
// variant that does not apply to a bucket is not available (fwd_supported
// false) rather than a copy of another one. Ablation builds compile them for
// bf16; every build compiles the ones default_variant() picks.
enum : int {
  kVarDynamic = 5,      // dynamic persistent scheduler (atomic tile counter, LPT order), all buckets
  kVarOInV = 6,         // hdim 256: O staged in the V ring instead of Q (next Q loads during the epilogue)
  kVarDynamicOInV = 7,  // hdim 256: 5 + 6
  kVarN176 = 8,         // hdim 128: 128 x 176 tile (FA3's non-causal), O in the V ring
  kVarN192 = 9,         // hdim 128: 128 x 192 tile, O in the V ring
  kVarN192Q = 10,       // hdim 128: 128 x 192 tile, O in Q (= the -DJAX_FLASH_SM90_BLOCKN_HDIM128=192 build)
  kVarEager = 11,       // hdim 64, 128: O rescaled after every block (kFlagEagerRescale; the
                        // default rescales lazily, softmax.cuh)
  kVarQSmem = 12,       // hdim 128: Q read from shared memory by every QK^T wgmma (SS; the
                        // default before session 5, which keeps Q in registers: kFlagQInRegs)
  kVarBalancedGrid = 13,  // every bucket: the mask's default kernel on the balanced persistent
                          // grid (scheduler.cuh persistent_grid: same rounds, none partly idle)
  kNumVariants = 14,
};

constexpr int kScheduleFlags = 3;  // kFlagPingpong | kFlagOverlap (smem_layout.cuh)
constexpr int variant_flags(int variant, int default_flags) {
  return variant == 0 ? default_flags
                      : (((variant - 1) & 1) ? 0 : 1) | (((variant - 1) & 2) ? 0 : 2) |
                            (default_flags & ~kScheduleFlags);
}

// What variant 0 launches. Measured on the H200 (selftest_sm90 --bench, B=2
// T=S=8192 bf16, benchmarks/results/sm90_variants_h200.txt): for causal-like
// masks (right bound, no left bound) the dynamic scheduler is +13% at hdim 128,
// +3% at 64, and with O staged in the V ring +30% at 256 (the static
// heaviest-first order leaves SMs idle at the end); without such a mask the
// static scheduler and tile stay: 128 x 176/192 tiles were within the noise
// (+1%) and O in the V ring was -8% at hdim 256.
constexpr int default_variant(int hdim_bucket, bool causal_like) {
  if (!causal_like) return 0;
  return hdim_bucket == 256 ? kVarDynamicOInV : kVarDynamic;
}

// The variant actually launched (variant 0 resolved for the mask; 0 is then
// the static default). kVarBalancedGrid launches the mask's default kernel
// (only its grid differs), so it resolves like variant 0.
constexpr int resolved_variant(int variant, int hdim_bucket, bool causal_like) {
  return variant == 0 || variant == kVarBalancedGrid ? default_variant(hdim_bucket, causal_like)
                                                     : variant;
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
    case kVarEager: return hdim_bucket == 64 || hdim_bucket == 128;
    case kVarQSmem: return hdim_bucket == 128;
    case kVarBalancedGrid: return true;
    default: return false;
  }
#else
  (void)hdim_bucket;
  (void)bf16;
  return variant >= 0 && variant < 5 && variant_flags(variant, default_flags) == default_flags;
#endif
}

// Whether the launched variant uses the dynamic scheduler (kFlagDynamic), i.e.
// needs FwdParams::sm90_tile_counter.
constexpr bool variant_uses_dynamic(int variant, int hdim_bucket, bool causal_like) {
  const int v = resolved_variant(variant, hdim_bucket, causal_like);
  return v == kVarDynamic || v == kVarDynamicOInV;
}

}  // namespace jax_flash::sm90
