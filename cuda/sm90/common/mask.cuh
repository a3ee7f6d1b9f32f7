// The element mask of the sm90 forward (and of the backward's hdim-256
// consumer, which holds S as the forward does): sets the scores of invisible
// (query, key) pairs in a warpgroup's wgmma fragment to -inf. The rule is
// MaskInfo's (jax_flash/mask_info.h: visible_keys per row, the segment ids
// unless the runs are exact; its block tests say which blocks need this
// mask); this file only walks the fragment.
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

// kPacked, exact: MaskInfo::visible_keys's (exact: the rows' plan_exact or
// rows_exact).
template <bool kPacked, int NR>
JF_DEVICE void apply_mask(float (&s)[NR], const MaskInfo& mi, int batch, int row0, int col0, bool exact) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int lo, hi;
    mi.visible_keys<kPacked>(batch, row0 + 8 * h, exact, lo, hi);
    mask_row_outside(s, h, lo, hi, col0);
  }
  if (mi.has_seg() && !exact) mask_other_segments(s, mi, batch, row0, col0);
}

}  // namespace jax_flash::sm90
