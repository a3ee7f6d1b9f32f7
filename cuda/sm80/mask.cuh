// The element mask of the sm80 kernels: sets the scores of invisible (query,
// key) pairs in a warp's mma.sync fragments to -inf, from the row bounds of
// the shared BlockInfo (jax_flash/block_info.h, which also gives the block
// ranges and the block_needs_mask test) and the segment ids of MaskInfo
// (jax_flash/mask_info.h). Rows past seqlen_q are never stored (forward) or
// have P = 0 (backward), so they are not masked here.
#pragma once

#include <cstdint>

#include "jax_flash/mask_info.h"
#include "mma.cuh"

namespace jax_flash::sm80 {

// Sets masked entries of a warp's score fragments acc[kMT][kNT][4] to -inf.
// Element (m, n, i) sits at row row0 + m*16 + g + 8*(i/2) and key
// col0 + n*8 + 2t + i%2 (the C layout); row0/col0 are absolute indices.
// Row-outer order: only one row's bounds are live at a time (this runs while
// S and O occupy most of the register file). With segment ids the key's
// segment is re-read per row (L1 hits).
template <int kMT, int kNT>
JF_DEVICE void mask_row(float (&acc)[kMT][kNT][4], int m, int h, int row, int lo, int hi, int c0,
                        const MaskInfo& mi, int batch, bool compare_ids) {
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

template <int kMT, int kNT>
JF_DEVICE void apply_mask(float (&acc)[kMT][kNT][4], const MaskInfo& mi, int batch, int row0,
                          int col0, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const int c0 = col0 + 2 * t;  // this lane's first key
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + m * 16 + g + 8 * h;
      int lo, hi;
      mi.row_bounds(row, lo, hi);
      mask_row(acc, m, h, row, lo, hi, c0, mi, batch, mi.has_seg());
    }
}

// The packed kernels' mask (tile spans present), same fragment layout.
// exact (MaskInfo::rows_exact of the tile's rows): each row sees one interval
// of keys (MaskInfo::row_run, band and shifts included); else the band with
// the row's shift, and the ids are compared.
template <int kMT, int kNT>
JF_DEVICE void apply_mask_packed(float (&acc)[kMT][kNT][4], const MaskInfo& mi, int batch, int row0,
                                 int col0, int lane, bool exact) {
  const int g = lane >> 2, t = lane & 3;
  const int c0 = col0 + 2 * t;  // this lane's first key
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + m * 16 + g + 8 * h;
      int lo, hi;
      if (exact) {
        lo = 0;
        hi = -1;  // rows past seqlen_q: never stored (forward) or P = 0
        if (row < mi.seqlen_q) {
          mi.row_run(batch, row, lo, hi);
          --hi;
        }
      } else {
        mi.row_bounds(row, lo, hi, mi.row_shift(batch, row));
      }
      mask_row(acc, m, h, row, lo, hi, c0, mi, batch, mi.has_seg() && !exact);
    }
}

}  // namespace jax_flash::sm80
