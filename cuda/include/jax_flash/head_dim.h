// Head-dim buckets: a head dim is served by the kernel of the next bucket up.
// The padding columns are zero-filled by the kernels' loads, so they do not
// change the result.
#pragma once

#include "jax_flash/host_device.h"

namespace jax_flash {

// The sm80 kernels' buckets, and the row pitch of the dq_accum workspace of
// both backward families (BwdParams::head_dim_rounded): 64, 96, 128, 256.
// Python mirrors it (jax_flash/_src/cuda_backend.py) to size the workspace.
JF_HOST_DEVICE constexpr int rounded_head_dim(int d) {
  return d <= 64 ? 64 : d <= 96 ? 96 : d <= 128 ? 128 : 256;
}

// The sm90 kernels' buckets: TMA boxes and wgmma tiles come in 64-column
// blocks, so 96 runs in 128. 0: not served (above 256).
JF_HOST_DEVICE constexpr int sm90_head_dim_bucket(int d) {
  return d <= 64 ? 64 : d <= 128 ? 128 : d <= 256 ? 256 : 0;
}

}  // namespace jax_flash
