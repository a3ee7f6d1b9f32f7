// The sm90 forward ablations of the hdim-64 bucket (sm90_fwd_ablation.h).
#include "sm90_fwd_ablation_impl.cuh"

namespace jax_flash::sm90::ablation {
FwdAblationBucket fwd_ablation_bucket_64() { return make_bucket<64>(); }
}  // namespace jax_flash::sm90::ablation
