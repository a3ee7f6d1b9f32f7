// The sm90 forward ablations of the hdim-128 bucket (sm90_fwd_ablation.h).
#include "sm90_fwd_ablation_impl.cuh"

namespace jax_flash::sm90::ablation {
FwdAblationBucket fwd_ablation_bucket_128() { return make_bucket<128>(); }
}  // namespace jax_flash::sm90::ablation
