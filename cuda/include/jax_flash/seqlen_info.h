// Sequence geometry of one batch element: where its query and key rows start
// and how many there are. Shared by every kernel family, forward and backward.
//
// BatchSeqlens answers per batch element from, in this order: cumulative
// offsets (a packed variable-length launch: cu_seqlens_q / cu_seqlens_k,
// [batch + 1] prefix sums, rows addressed from the offset), the static
// lengths, and per-element used lengths (seqused_q / seqused_k, [batch]: a
// KV cache's filled keys), clamped to [0, the length before them]. Without
// arrays every element has the static lengths at offset 0 (addressed through
// the batch stride).
#pragma once

#include <cstdint>

#include "jax_flash/host_device.h"

namespace jax_flash {

// A read-only int32 load (through the non-coherent cache on the device).
JF_HOST_DEVICE int load_readonly(const int32_t* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

struct SeqlenInfo {
  int offset_q;  // first query row of this batch element in the row dimension
  int offset_k;  // first key row
  int seqlen_q;
  int seqlen_k;
};

// The launch-wide source of SeqlenInfo; every array optional (nullptr).
struct BatchSeqlens {
  int seqlen_q, seqlen_k;  // static lengths (with used lengths: their caps)
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  const int32_t* seqused_q = nullptr;
  const int32_t* seqused_k = nullptr;

  JF_HOST_DEVICE SeqlenInfo operator()(int batch) const {
    SeqlenInfo s{0, 0, seqlen_q, seqlen_k};
    if (cu_seqlens_q != nullptr) {
      s.offset_q = load_readonly(cu_seqlens_q + batch);
      s.seqlen_q = load_readonly(cu_seqlens_q + batch + 1) - s.offset_q;
    }
    if (cu_seqlens_k != nullptr) {
      s.offset_k = load_readonly(cu_seqlens_k + batch);
      s.seqlen_k = load_readonly(cu_seqlens_k + batch + 1) - s.offset_k;
    }
    if (seqused_q != nullptr) s.seqlen_q = clamp_used(load_readonly(seqused_q + batch), s.seqlen_q);
    if (seqused_k != nullptr) s.seqlen_k = clamp_used(load_readonly(seqused_k + batch), s.seqlen_k);
    return s;
  }
  // Lengths independent of the batch: block ranges can then be resolved once
  // per launch (on the host) instead of once per tile.
  JF_HOST_DEVICE bool uniform() const {
    return cu_seqlens_q == nullptr && cu_seqlens_k == nullptr && seqused_q == nullptr &&
           seqused_k == nullptr;
  }
  JF_HOST_DEVICE static int clamp_used(int used, int cap) {
    const int n = used < cap ? used : cap;
    return n > 0 ? n : 0;
  }
};

}  // namespace jax_flash
