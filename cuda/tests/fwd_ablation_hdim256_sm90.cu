// The sm90 forward ablations of the hdim-256 bucket (sm90_fwd_ablation.h).
#include "sm90_fwd_ablation_impl.cuh"

namespace jax_flash::sm90::ablation {
FwdAblationBucket fwd_ablation_bucket_256() { return make_bucket<256>(); }
}  // namespace jax_flash::sm90::ablation
