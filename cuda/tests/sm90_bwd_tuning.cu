// The tuning table of the sm90 backward (sm90_bwd_tuning.h): each variant is
// a typed tile choice (config + dQ reduction) launched through the production
// launcher, launch_bwd in cuda/sm90/bwd/bwd_launch_templates.cuh.
#include "sm90_bwd_tuning.h"

#include "jax_flash/head_dim.h"
#include "jax_flash/mask_info.h"
#include "sm90/bwd/bwd_launch_templates.cuh"
#include "sm90/launch.h"

namespace jax_flash::sm90::tuning {
namespace {

// A tile: the shared-memory / work-split config and how dQ reaches dq_accum.
template <typename Cfg_, bool kDqTensor_>
struct BwdTuning {
  using Cfg = Cfg_;
  static constexpr bool kDqTensor = kDqTensor_;
};
template <int kHeadDim>
using BucketTile = BwdTuning<typename BwdConfigFor<kHeadDim>::type, true>;
template <int kHeadDim>
using RowReduceTile = BwdTuning<typename BwdConfigFor<kHeadDim>::type, false>;
template <int kHeadDim>
using BlockM80Tile = BwdTuning<BwdConfigHd128Bm80, true>;  // kHeadDim == 128 only
template <int kHeadDim>
using SoftcapExpBucketTile = BwdTuning<BwdSoftcapExpConfig<typename BwdConfigFor<kHeadDim>::type>, true>;
using SoftcapExpBlockM80Tile = BwdTuning<BwdSoftcapExpConfig<BwdConfigHd128Bm80>, true>;

// The default's tile choice (bwd_policy.h) for the case.
bool default_is_bm80(const BwdParams& p) {
  return bwd_default_tile(Sm90BwdHeadDims::bucket(p.head_dim), make_mask_info(p).bounded(), p.deterministic) ==
         BwdTileChoice::kBlockM80;
}
// The dropout kernels with the keep masks drawn the other way (kHeadDim 64, 128).
template <int kHeadDim>
using DropAltTile =
    BwdTuning<BwdDropoutConfig<typename BwdConfigFor<kHeadDim>::type, !bwd_dropout_producer_mask(kHeadDim)>,
              true>;

template <typename T>
cudaError_t launch(const BwdParams& p, cudaStream_t stream) {
  return launch_bwd<__nv_bfloat16, typename T::Cfg, T::kDqTensor>(p, stream);
}

template <template <int> class Tile>
cudaError_t launch_bucket(const BwdParams& p, cudaStream_t stream) {
  switch (Sm90BwdHeadDims::bucket(p.head_dim)) {
    case 64: return launch<Tile<64>>(p, stream);
    case 128: return launch<Tile<128>>(p, stream);
    case 256: return launch<Tile<256>>(p, stream);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace

bool variant_applies(const BwdParams& p, int variant) {
  if (!bwd_supported(p)) return false;
  if (variant == kDefault) return true;
  if (p.dtype != DType::kBFloat16) return false;
  // The head-dim pair 192 / 128: variant 3 is its 64 x 64 column split.
  if (p.head_dim_v != p.head_dim)
    return variant == kBucket && p.head_dim == 192 && p.head_dim_v == 128 && !p.dropout.enabled();
  if (variant == kDropAlt) return p.dropout.enabled() && Sm90BwdHeadDims::bucket(p.head_dim) <= 128;
  // The other variants are bucket tiles without dropout's mask (dropout and
  // the head-dim pairs: their own tile, the default, only).
  if (p.dropout.enabled()) return false;
  switch (variant) {
    case kRowReduce: return !p.deterministic;
    case kBlockM80:
      return Sm90BwdHeadDims::bucket(p.head_dim) == 128 && !make_mask_info(p).bounded() && !p.deterministic;
    case kBucket: return true;
    case kSoftcapExp: return p.softcap > 0.f;
    default: return false;
  }
}

cudaError_t run_variant(const BwdParams& p, int variant, cudaStream_t stream) {
  if (!variant_applies(p, variant)) return cudaErrorNotSupported;
  switch (variant) {
    case kDefault: return run_bwd(p, stream);
    case kRowReduce: return launch_bucket<RowReduceTile>(p, stream);
    case kBlockM80: return launch<BlockM80Tile<128>>(p, stream);
    case kBucket:
      return p.head_dim_v != p.head_dim ? launch<BwdTuning<BwdPairConfig64, true>>(p, stream)
                                        : launch_bucket<BucketTile>(p, stream);
    case kSoftcapExp:
      return default_is_bm80(p) ? launch<SoftcapExpBlockM80Tile>(p, stream)
                                : launch_bucket<SoftcapExpBucketTile>(p, stream);
    case kDropAlt:
      return Sm90BwdHeadDims::bucket(p.head_dim) == 64 ? launch<DropAltTile<64>>(p, stream)
                                                       : launch<DropAltTile<128>>(p, stream);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace jax_flash::sm90::tuning
