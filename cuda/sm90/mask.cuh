// Which (query, key) pairs are visible, for the sm90 forward. Same rules as
// cuda/sm80/mask.cuh and jax_flash/_src/masking.py (bottom-right aligned):
//   query row i sits at absolute position i + off, off = seqlen_k - seqlen_q;
//   key j visible iff j < seqlen_k
//                  && (wl < 0 || j >= i + off - wl)
//                  && (wr < 0 || j <= i + off + wr)   (causal: wr = 0)
//                  && (no segment ids || q_seg[i] == kv_seg[j]).
// Block ranges skip fully masked KV blocks; the element mask runs only on the
// blocks that need it (block_needs_mask, a warpgroup-uniform test).
#pragma once

#include <cstdint>

#include "jax_flash/params.h"
#include "ptx/common.cuh"

namespace jax_flash::sm90 {

JF_DEVICE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
JF_DEVICE int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

struct MaskInfo {
  int seqlen_q, seqlen_k;
  int off;     // seqlen_k - seqlen_q
  int wl, wr;  // -1 = unbounded
  const int32_t* q_seg;   // [batch, seqlen_q] or nullptr
  const int32_t* kv_seg;  // [batch, seqlen_k] or nullptr

  JF_DEVICE bool has_seg() const { return q_seg != nullptr; }

  // [first, last) KV blocks holding a visible key for some row of
  // [m0, m0 + bm) (rows clamped to seqlen_q).
  JF_DEVICE void kv_block_range(int m0, int bm, int bn, int& first, int& last) const {
    const int n_blocks = (seqlen_k + bn - 1) / bn;
    first = 0;
    last = n_blocks;
    if (wr >= 0) {
      const int64_t hi = int64_t(min(m0 + bm, seqlen_q) - 1) + off + wr;
      last = hi < 0 ? 0 : int(min64(hi / bn + 1, n_blocks));
    }
    if (wl >= 0) {
      const int64_t lo = int64_t(m0) + off - wl;
      first = lo <= 0 ? 0 : int(min64(lo / bn, n_blocks));
    }
    if (last < first) last = first;
  }

  // False only if every (row < seqlen_q, key) pair of the block is visible.
  JF_DEVICE bool block_needs_mask(int m0, int bm, int n0, int bn) const {
    if (n0 + bn > seqlen_k || has_seg()) return true;
    const int64_t m_last = int64_t(min(m0 + bm, seqlen_q) - 1);
    if (wr >= 0 && int64_t(n0 + bn - 1) > int64_t(m0) + off + wr) return true;
    if (wl >= 0 && int64_t(n0) < m_last + off - wl) return true;
    return false;
  }

  // Visible key interval [lo, hi] of absolute row i (clamped to [0, seqlen_k)).
  JF_DEVICE void row_bounds(int i, int& lo, int& hi) const {
    const int64_t d = int64_t(i) + off;
    lo = wl < 0 ? 0 : int(max64(d - wl, 0));
    hi = wr < 0 ? seqlen_k - 1 : int(min64(d + wr, seqlen_k - 1));
  }
};

// Masks a warpgroup's S fragment (64 x N, wgmma layout, float s[N/2]) with
// -inf. row0: absolute query row of this thread's first row (16*warp + g
// within the WG's 64 rows); col0: absolute key of its first column
// (n0 + 2t). Element s[4j + 2h + e] is row row0 + 8h, key col0 + 8j + e.
template <int NR>
JF_DEVICE void apply_mask(float (&s)[NR], const MaskInfo& mi, int batch, int row0, int col0) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    int lo, hi;
    mi.row_bounds(row, lo, hi);
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
  if (mi.has_seg()) {
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
}

inline MaskInfo make_mask_info(const FwdParams& p) {
  MaskInfo mi;
  mi.seqlen_q = p.seqlen_q;
  mi.seqlen_k = p.seqlen_k;
  mi.off = p.seqlen_k - p.seqlen_q;
  mi.wl = p.window_left < 0 ? -1 : p.window_left;
  mi.wr = p.window_right < 0 ? -1 : p.window_right;
  if (p.causal) mi.wr = mi.wr < 0 ? 0 : (mi.wr > 0 ? 0 : mi.wr);  // robust to unfolded causal
  mi.q_seg = p.q_segment;
  mi.kv_seg = p.kv_segment;
  if (mi.q_seg == nullptr || mi.kv_seg == nullptr) mi.q_seg = mi.kv_seg = nullptr;
  return mi;
}

}  // namespace jax_flash::sm90
