// Sequence geometry of one batch element: where its query and key rows start
// and how many there are. Shared by every kernel family, forward and backward.
//
// Today every batch element has the same lengths and is addressed through the
// batch stride, so the offsets are 0. A packed variable-length launch
// (cu_seqlens_q / cu_seqlens_k prefix sums) or a KV cache (seqused_k) adds its
// arrays to BatchSeqlens and answers per batch; the code that asks for
// SeqlenInfo(batch) stays the same.
#pragma once

#include "jax_flash/host_device.h"

namespace jax_flash {

struct SeqlenInfo {
  int offset_q;  // first query row of this batch element in the row dimension
  int offset_k;  // first key row
  int seqlen_q;
  int seqlen_k;
};

// The launch-wide source of SeqlenInfo.
struct BatchSeqlens {
  int seqlen_q, seqlen_k;  // the same for every batch element

  JF_HOST_DEVICE SeqlenInfo operator()(int batch) const {
    (void)batch;
    return SeqlenInfo{0, 0, seqlen_q, seqlen_k};
  }
  // Lengths independent of the batch: block ranges can then be resolved once
  // per launch (on the host) instead of once per tile.
  JF_HOST_DEVICE bool uniform() const { return true; }
};

}  // namespace jax_flash
