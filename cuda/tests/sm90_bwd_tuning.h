// The sm90 backward's tunings kept for measurements, next to the production
// default (cuda/sm90/bwd/bwd_policy.h). Compiled only into the backward's
// self-test / benchmark (tools/build/build_sm90_bwd_tests.sh: cuda/tests/
// sm90_bwd_tuning.cu), never into the extension; selected by this table,
// never through BwdParams.
#pragma once

#include <cuda_runtime.h>

#include "jax_flash/params.h"

namespace jax_flash::sm90::tuning {

// Numbered as the self-test's --variant=N and its "v1".."v3" columns.
enum BwdVariant : int {
  kDefault = 0,    // sm90::run_bwd: the tile bwd_default_tile picks
  kRowReduce = 1,  // the bucket's tile, dQ by one bulk reduction per row
                   // (instead of TMA tensor reductions of the staged tile)
  kBlockM80 = 2,   // hdim-128 bucket: kBlockM 80 with dQ_swapAB (no causal /
                   // local bound, not deterministic; the default there)
  kBucket = 3,     // the bucket's tile with tensor reductions (the default
                   // elsewhere); the head-dim pair 192 / 128: its 64 x 64
                   // column split (BwdPairConfig64) instead of the default's
                   // 64 x 96 dKV_swapAB tile
  kSoftcapExp = 4,  // softcap calls: the default's tile with softcap's tanh as
                    // 1 - 2 / (1 + e^{2y}) (BwdSoftcapExpConfig) instead of
                    // the rational
  kDropAlt = 5,    // dropout calls, hdim-64 / 128 buckets: the keep masks
                   // drawn the other way (producer warpgroup <-> consumer
                   // warpgroups; bwd_policy.h bwd_dropout_producer_mask)
  kNumVariants = 6,
};

// Whether `variant` can run the case: sm90::bwd_supported and the variant's
// own limits. The non-default variants are built for bf16 only; variants 1-4
// without attention dropout (4: softcap calls only), 5 with it only; the
// head-dim pair runs the default and variant 3 only.
bool variant_applies(const BwdParams& p, int variant);

// Runs `variant` (cudaErrorNotSupported where it does not apply).
cudaError_t run_variant(const BwdParams& p, int variant, cudaStream_t stream);

}  // namespace jax_flash::sm90::tuning
