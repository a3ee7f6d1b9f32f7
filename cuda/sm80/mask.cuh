// Which (query, key) pairs are visible: block ranges (to skip fully masked
// blocks), the "does this block need the element mask" test, and the element
// mask itself. Mirrors jax_flash/_src/masking.py:
//   query row i sits at absolute position i + off, off = seqlen_k - seqlen_q;
//   key j visible iff j < seqlen_k
//                  && (wl < 0 || j >= i + off - wl)
//                  && (wr < 0 || j <= i + off + wr)
//                  && (no segment ids || q_seg[i] == kv_seg[j]).
// Rows past seqlen_q are never stored (forward) or have P = 0 (backward), so
// they are not masked here.
#pragma once

#include <cstdint>

#include "jax_flash/params.h"
#include "mma.cuh"

namespace jax_flash::sm80 {

JF_DEVICE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
JF_DEVICE int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Runtime masking description, resolved once per launch on the host.
struct MaskInfo {
  int seqlen_q, seqlen_k;
  int off;         // seqlen_k - seqlen_q
  int wl, wr;      // window; -1 = unbounded (causal already folded into wr)
  const int32_t* q_seg;   // [batch, seqlen_q], or nullptr
  const int32_t* kv_seg;  // [batch, seqlen_k], or nullptr

  JF_DEVICE bool has_seg() const { return q_seg != nullptr; }

  // [first, last) KV blocks that can hold a visible key for q rows
  // [m0, m0 + bm).
  JF_DEVICE void kv_block_range(int m0, int bm, int bn, int& first, int& last) const {
    const int n_blocks = (seqlen_k + bn - 1) / bn;
    first = 0;
    last = n_blocks;
    if (wr >= 0) {
      const int64_t hi = int64_t(min(m0 + bm, seqlen_q) - 1) + off + wr;  // last visible key
      last = hi < 0 ? 0 : int(min64(hi / bn + 1, n_blocks));
    }
    if (wl >= 0) {
      const int64_t lo = int64_t(m0) + off - wl;  // first visible key
      first = lo <= 0 ? 0 : int(min64(lo / bn, n_blocks));
    }
    if (last < first) last = first;
  }

  // [first, last) q blocks whose rows can see a key of KV block [n0, n0 + bn).
  JF_DEVICE void q_block_range(int n0, int bn, int bm, int& first, int& last) const {
    const int m_blocks = (seqlen_q + bm - 1) / bm;
    first = 0;
    last = m_blocks;
    if (wr >= 0) {
      const int64_t lo = int64_t(n0) - off - wr;  // first row that sees key n0
      first = lo <= 0 ? 0 : int(min64(lo / bm, m_blocks));
    }
    if (wl >= 0) {
      const int64_t hi = int64_t(min(n0 + bn, seqlen_k) - 1) - off + wl;  // last row
      last = hi < 0 ? 0 : int(min64(hi / bm + 1, m_blocks));
    }
    if (last < first) last = first;
  }

  // True unless every (row, key) of the block is visible by position (rows
  // past seqlen_q ignored). Segment ids always need the element mask.
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

// Sets masked entries of a warp's score fragments acc[kMT][kNT][4] to -inf.
// Element (m, n, i) sits at row row0 + m*16 + g + 8*(i/2) and key
// col0 + n*8 + 2t + i%2 (the C layout); row0/col0 are absolute indices.
// Row-outer order: only one row's bounds are live at a time (this runs while
// S and O occupy most of the register file). With segment ids the key's
// segment is re-read per row (L1 hits).
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
      if (mi.has_seg()) {
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
}

// Built on the host once per launch. Segment arrays are [batch, seqlen],
// contiguous; apply_mask offsets them by the batch index.
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

}  // namespace jax_flash::sm80
