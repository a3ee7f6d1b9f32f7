// The element mask of the sm90 forward: sets the scores of invisible (query,
// key) pairs in a warpgroup's wgmma fragment to -inf, from the row bounds of
// the shared BlockInfo (jax_flash/block_info.h: also the block ranges that
// skip fully masked KV blocks and block_needs_mask, the warpgroup-uniform test
// for the blocks that need this mask) and the segment ids of MaskInfo
// (jax_flash/mask_info.h). MaskInfo and make_mask_info are the shared ones
// (found from this namespace as jax_flash::MaskInfo).
#pragma once

#include <cstdint>

#include "jax_flash/mask_info.h"
#include "sm90/ptx/common.cuh"

namespace jax_flash::sm90 {

// Masks a warpgroup's S fragment (64 x N, wgmma layout, float s[N/2]) with
// -inf. row0: absolute query row of this thread's first row (16*warp + g
// within the WG's 64 rows); col0: absolute key of its first column
// (n0 + 2t). Element s[4j + 2h + e] is row row0 + 8h, key col0 + 8j + e.

// Row row0 + 8h sees the keys [lo, hi] (absolute, inclusive).
template <int NR>
JF_DEVICE void mask_row_outside(float (&s)[NR], int h, int lo, int hi, int col0) {
  lo -= col0;  // key col0 + d visible iff lo <= d <= hi; d is an immediate
  hi -= col0;
#pragma unroll
  for (int j = 0; j < NR / 4; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int d = 8 * j + e;
      if (d < lo || d > hi) s[4 * j + 2 * h + e] = -INFINITY;
    }
}

// Keys whose segment id differs from the row's.
template <int NR>
JF_DEVICE void mask_other_segments(float (&s)[NR], const MaskInfo& mi, int batch, int row0, int col0) {
  const int32_t* kv_seg = mi.kv_seg + int64_t(batch) * mi.seqlen_k;
  const int32_t* q_seg = mi.q_seg + int64_t(batch) * mi.seqlen_q;
  const int qs0 = row0 < mi.seqlen_q ? __ldg(q_seg + row0) : 0;
  const int qs1 = row0 + 8 < mi.seqlen_q ? __ldg(q_seg + row0 + 8) : 0;
#pragma unroll
  for (int j = 0; j < NR / 4; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = col0 + 8 * j + e;
      // Keys past seqlen_k are already -inf (hi); do not read them.
      const int ks = col < mi.seqlen_k ? __ldg(kv_seg + col) : 0;
      if (ks != qs0) s[4 * j + e] = -INFINITY;
      if (ks != qs1) s[4 * j + 2 + e] = -INFINITY;
    }
}

template <int NR>
JF_DEVICE void apply_mask(float (&s)[NR], const MaskInfo& mi, int batch, int row0, int col0) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int lo, hi;
    mi.row_bounds(row0 + 8 * h, lo, hi);
    mask_row_outside(s, h, lo, hi, col0);
  }
  if (mi.has_seg()) mask_other_segments(s, mi, batch, row0, col0);
}

// The packed kernels' mask (tile spans present), same fragment layout.
// exact (MaskInfo::plan_exact of the rows): each row sees one interval of
// keys (MaskInfo::row_run, band and shifts included); else the band with the
// row's shift, and the ids are compared.
template <int NR>
JF_DEVICE void apply_mask_packed(float (&s)[NR], const MaskInfo& mi, int batch, int row0, int col0,
                                 bool exact) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    int lo, hi;
    if (exact) {
      lo = 0;
      hi = -1;  // rows past seqlen_q: never stored
      if (row < mi.seqlen_q) {
        mi.row_run(batch, row, lo, hi);
        --hi;
      }
    } else {
      mi.row_bounds(row, lo, hi, mi.row_shift(batch, row));
    }
    mask_row_outside(s, h, lo, hi, col0);
  }
  if (mi.has_seg() && !exact) mask_other_segments(s, mi, batch, row0, col0);
}

}  // namespace jax_flash::sm90
