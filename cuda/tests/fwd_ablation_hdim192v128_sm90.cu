// The sm90 forward ablations of the head-dim pair 192 / 128 (DeepSeek MLA;
// sm90_fwd_ablation.h).
#include "sm90_fwd_ablation_impl.cuh"

namespace jax_flash::sm90::ablation {
FwdAblationBucket fwd_ablation_pair_192_128() { return make_bucket<192, 128>(); }
}  // namespace jax_flash::sm90::ablation
