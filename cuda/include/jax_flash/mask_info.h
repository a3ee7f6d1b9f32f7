// The launch's mask as the kernels take it: the block geometry (BlockInfo)
// plus the optional segment ids, whose element test is data-dependent. Built
// on the host once per launch from the parameters; the element masks that
// apply it to score fragments are per architecture (sm80/mask.cuh,
// sm90/common/mask.cuh, sm90/bwd/bwd_mask.cuh), because the fragment layouts differ.
#pragma once

#include <cstdint>

#include "jax_flash/block_info.h"
#include "jax_flash/host_device.h"
#include "jax_flash/params.h"
#include "jax_flash/seqlen_info.h"

namespace jax_flash {

// BlockInfo's fields (and its math, BlockMath) plus the segment ids.
struct MaskInfo : BlockMath<MaskInfo> {
  int seqlen_q, seqlen_k;
  int off;     // seqlen_k - seqlen_q
  int wl, wr;  // window sides; -1 = unbounded
  const int32_t* q_seg;   // [batch, seqlen_q], or nullptr
  const int32_t* kv_seg;  // [batch, seqlen_k], or nullptr

  JF_HOST_DEVICE bool has_seg() const { return q_seg != nullptr; }

  // Segment ids make every block need the element mask.
  JF_HOST_DEVICE bool block_needs_mask(int m0, int bm, int n0, int bn) const {
    return BlockMath::block_needs_mask(m0, bm, n0, bn, [this] { return has_seg(); });
  }
};

inline BatchSeqlens batch_seqlens(const FwdParams& p) { return BatchSeqlens{p.seqlen_q, p.seqlen_k}; }

// Segment arrays are [batch, seqlen], contiguous; the element masks offset
// them by the batch index. Both or neither.
inline MaskInfo make_mask_info(const FwdParams& p) {
  const BatchSeqlens seqlens = batch_seqlens(p);
  // uniform(): one BlockInfo serves every batch element.
  const BlockInfo b = make_block_info(seqlens(0), p.window_left, p.window_right);
  MaskInfo mi;
  mi.seqlen_q = b.seqlen_q;
  mi.seqlen_k = b.seqlen_k;
  mi.off = b.off;
  mi.wl = b.wl;
  mi.wr = b.wr;
  mi.q_seg = p.q_segment;
  mi.kv_seg = p.kv_segment;
  if (mi.q_seg == nullptr || mi.kv_seg == nullptr) mi.q_seg = mi.kv_seg = nullptr;
  return mi;
}

}  // namespace jax_flash
