// The element mask of the sm80 kernels (and of the decoding kernel, which
// shares the mma.sync layout): sets the scores of invisible (query, key) pairs
// in a warp's fragments to -inf. The rule is MaskInfo's (jax_flash/mask_info.h:
// visible_keys per row, the segment ids unless the runs are exact); this file
// only walks the fragment.
#pragma once

#include <cstdint>

#include "jax_flash/mask_info.h"
#include "mma.cuh"

namespace jax_flash::sm80 {

// Element (m, n, i) of a warp's score fragments acc[kMT][kNT][4] sits at row
// row0 + m*16 + g + 8*(i/2) and key col0 + n*8 + 2t + i%2 (the C layout);
// c0 = col0 + 2t is the lane's first key.

// Row (m, h) sees the keys [lo, hi] (absolute, inclusive).
template <int kMT, int kNT>
JF_DEVICE void mask_outside(float (&acc)[kMT][kNT][4], int m, int h, int lo, int hi, int c0) {
  // Key c0 + d visible iff lo - c0 <= d <= hi - c0; d is an immediate.
  lo -= c0;
  hi -= c0;
#pragma unroll
  for (int n = 0; n < kNT; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int d = n * 8 + j;
      if (d < lo || d > hi) acc[m][n][2 * h + j] = -INFINITY;
    }
}

// Row (m, h) = `row`: the keys outside [lo, hi] and, with compare_ids, the
// keys whose segment id differs from the row's (the key's id is re-read per
// row: L1 hits).
template <int kMT, int kNT>
JF_DEVICE void mask_row(float (&acc)[kMT][kNT][4], int m, int h, int row, int lo, int hi, int c0,
                        const MaskInfo& mi, int batch, bool compare_ids) {
  mask_outside(acc, m, h, lo, hi, c0);
  if (compare_ids) {
    const int32_t* kv_seg = mi.kv_seg + int64_t(batch) * mi.seqlen_k;
    const int qs = row < mi.seqlen_q ? __ldg(mi.q_seg + int64_t(batch) * mi.seqlen_q + row) : 0;
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = c0 + n * 8 + j;
        // Keys past seqlen_k are already masked by hi; don't read them.
        if (col < mi.seqlen_k && __ldg(kv_seg + col) != qs) acc[m][n][2 * h + j] = -INFINITY;
      }
  }
}

// kPacked, exact: MaskInfo::visible_keys's (exact: rows_exact of the tile's
// rows). Row-outer order: only one row's bounds are live at a time
// (this runs while S and O occupy most of the register file).
template <bool kPacked, int kMT, int kNT>
JF_DEVICE void apply_mask(float (&acc)[kMT][kNT][4], const MaskInfo& mi, int batch, int row0, int col0,
                          int lane, bool exact) {
  const int g = lane >> 2, t = lane & 3;
  const int c0 = col0 + 2 * t;
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + m * 16 + g + 8 * h;
      int lo, hi;
      mi.visible_keys<kPacked>(batch, row, exact, lo, hi);
      mask_row(acc, m, h, row, lo, hi, c0, mi, batch, mi.has_seg() && !exact);
    }
}

}  // namespace jax_flash::sm80
