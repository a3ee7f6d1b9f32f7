// Which tile of the sm90 backward serves a case: the one policy of the
// production build (host only). The alternatives kept for measurements are
// selected by the backward's self-test / benchmark target from its own table
// (cuda/tests/sm90_bwd_tuning.h), never through BwdParams.
#pragma once

namespace jax_flash::sm90 {

enum class BwdTileChoice {
  kBucket,    // the head-dim bucket's own tile (BwdConfigFor, bwd_config.cuh)
  kBlockM80,  // hdim-128 bucket: kBlockM 80 with dQ_swapAB (BwdConfigHd128Bm80)
};

// kBlockM 80 (FA3's non-causal hdim-128 tile; +4% at T = S = 8192 on the
// H200, benchmarks/NOTES.md) where it applies: it has no deterministic kernel
// (its dQ tiles would need their own semaphore layout) and no block skipping
// for a causal / local bound. Everything else takes the bucket's tile.
constexpr BwdTileChoice bwd_default_tile(int hdim_bucket, bool mask_bounded, bool deterministic) {
  return hdim_bucket == 128 && !mask_bounded && !deterministic ? BwdTileChoice::kBlockM80 : BwdTileChoice::kBucket;
}

// Dropout: whether the keep masks of the bucket's kernels are drawn by the
// producer warpgroup's idle warps (BwdDropoutConfig kDropProducer; the key
// split's buckets, hdim 64 and 128) instead of by each consumer warpgroup
// under its step's GEMMs. The other choice is the self-test's variant
// kDropAlt (cuda/tests/sm90_bwd_tuning.h).
constexpr bool kBwdDropoutProducerMask = false;
constexpr bool bwd_dropout_producer_mask(int hdim_bucket) { return kBwdDropoutProducerMask && hdim_bucket <= 128; }

}  // namespace jax_flash::sm90
