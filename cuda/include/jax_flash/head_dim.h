// Head-dim buckets: a head dim is served by the kernel of the next bucket up
// of its family. The padding columns are zero-filled by the kernels' loads, so
// they do not change the result. The buckets of every family come from the
// kernel table (jax_flash/_src/backends/kernel_table.py, generated into kernel_table.h).
// A value head dim other than the query/key one (v and o [.., head_dim_v])
// runs in the kernels of a head-dim pair, served exactly.
#pragma once

#include "jax_flash/host_device.h"
#include "jax_flash/kernel_table.h"

namespace jax_flash {

// One family's buckets, ascending.
template <int... kBuckets>
struct HeadDimBuckets {
  static_assert(sizeof...(kBuckets) > 0, "a family has at least one bucket");

  // The smallest bucket >= d; 0 past the largest (not served).
  JF_HOST_DEVICE static constexpr int bucket(int d) {
    int b = 0;
    (void)((d <= kBuckets ? (b = kBuckets, true) : false) || ...);
    return b;
  }
  JF_HOST_DEVICE static constexpr bool contains(int d) { return ((d == kBuckets) || ...); }
  JF_HOST_DEVICE static constexpr int largest() {
    int b = 0;
    ((b = kBuckets), ...);
    return b;
  }
};

// One (query/key, value) head-dim pair with kernels of its own.
template <int kHeadDim_, int kHeadDimV_>
struct HeadDimPair {
  static_assert(kHeadDim_ != kHeadDimV_, "equal head dims are a bucket");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
};

// One family's head-dim pairs.
template <typename... Pairs>
struct HeadDimPairs {
  JF_HOST_DEVICE static constexpr bool contains(int d, int dv) {
    return ((d == Pairs::kHeadDim && dv == Pairs::kHeadDimV) || ...);
  }
};

using Sm80HeadDims = HeadDimBuckets<JAX_FLASH_SM80_HEAD_DIMS>;
using Sm80HeadDimPairs = HeadDimPairs<JAX_FLASH_SM80_HEAD_DIM_PAIRS>;
using Sm90FwdHeadDims = HeadDimBuckets<JAX_FLASH_SM90_FWD_HEAD_DIMS>;
using Sm90FwdHeadDimPairs = HeadDimPairs<JAX_FLASH_SM90_FWD_HEAD_DIM_PAIRS>;
using Sm90BwdHeadDims = HeadDimBuckets<JAX_FLASH_SM90_BWD_HEAD_DIMS>;
using Sm90BwdHeadDimPairs = HeadDimPairs<JAX_FLASH_SM90_BWD_HEAD_DIM_PAIRS>;
using Sm90BwdDropoutHeadDims = HeadDimBuckets<JAX_FLASH_SM90_BWD_DROPOUT_HEAD_DIMS>;
using Sm90BwdVarlenHeadDims = HeadDimBuckets<JAX_FLASH_SM90_BWD_VARLEN_HEAD_DIMS>;
using Sm90Fp8HeadDims = HeadDimBuckets<JAX_FLASH_SM90_FP8_HEAD_DIMS>;

// The sm80 kernels' bucket (callers check the maximum head dim first; past it
// the largest bucket), and the row pitch of the dq_accum workspace of both
// backward families (BwdParams::head_dim_rounded). Python mirrors it
// (jax_flash/_src/cuda_backend.py) to size the workspace.
JF_HOST_DEVICE constexpr int rounded_head_dim(int d) {
  return Sm80HeadDims::bucket(d < Sm80HeadDims::largest() ? d : Sm80HeadDims::largest());
}

// The same for a value head dim dv: rounded_head_dim(d) when dv == d, the
// pair's own query/key head dim d for a pair of the sm80 kernels (served
// exactly; its dq_accum rows are d wide), 0 for a pair without kernels.
// Python mirrors it (cuda_backend.py dq_accum_pitch).
JF_HOST_DEVICE constexpr int rounded_head_dim(int d, int dv) {
  return d == dv ? rounded_head_dim(d) : Sm80HeadDimPairs::contains(d, dv) ? d : 0;
}

}  // namespace jax_flash
