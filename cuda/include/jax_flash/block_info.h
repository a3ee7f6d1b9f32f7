// Which query / key blocks can hold a visible pair, for one batch element:
// the block ranges that let the kernels skip fully masked blocks, the test for
// blocks that need the element mask, and the visible interval of one row (or
// of one key) that the per-architecture element masks apply. Shared by every
// kernel family, forward and backward; jax_flash/_src/masking.py is the same
// math for the JAX backends (tests/test_block_info.py checks they agree).
//
// Masking convention (bottom-right aligned):
//   query row i sits at absolute position i + off, off = seqlen_k - seqlen_q;
//   key j visible iff j < seqlen_k
//                  && (wl < 0 || j >= i + off - wl)
//                  && (wr < 0 || j <= i + off + wr).
// Causal is wr = 0 with wl < 0 (folded in Python); there is no separate flag.
// Rows past seqlen_q are never stored (forward) or have P = 0 (backward), so
// the ranges clamp rows to seqlen_q but the element masks leave them alone.
// Block starts (m0, n0) need not be multiples of the block sizes.
#pragma once

#include <cstdint>

#include "jax_flash/host_device.h"
#include "jax_flash/seqlen_info.h"

namespace jax_flash {

JF_HOST_DEVICE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
JF_HOST_DEVICE int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
JF_HOST_DEVICE int min32(int a, int b) { return a < b ? a : b; }

// The block math over the fields seqlen_q, seqlen_k, off (= seqlen_k -
// seqlen_q), wl, wr (window sides, -1 = unbounded) of Self: BlockInfo below,
// and MaskInfo (mask_info.h), which holds the same fields next to the segment
// ids. A base that reads the derived struct's own fields, rather than a
// BlockInfo member or base subobject inside MaskInfo: nvcc schedules the
// kernels differently when their __grid_constant__ argument nests a struct
// (measured on the sm80 forward), and the kernels must not change with it.
template <typename Self>
struct BlockMath {
  JF_HOST_DEVICE const Self& self() const { return static_cast<const Self&>(*this); }

  // A causal-like mask: the right side bounds, the left does not (the
  // schedulers order such work heaviest first).
  JF_HOST_DEVICE bool causal_like() const { return self().wr >= 0 && self().wl < 0; }
  JF_HOST_DEVICE bool bounded() const { return self().wl >= 0 || self().wr >= 0; }

  // [first, last) KV blocks (of bn keys) holding a visible key for some row
  // of [m0, m0 + bm) (rows clamped to seqlen_q).
  JF_HOST_DEVICE void kv_block_range(int m0, int bm, int bn, int& first, int& last) const {
    const Self& b = self();
    const int n_blocks = (b.seqlen_k + bn - 1) / bn;
    first = 0;
    last = n_blocks;
    if (b.wr >= 0) {
      const int64_t hi = int64_t(min32(m0 + bm, b.seqlen_q) - 1) + b.off + b.wr;  // last visible key
      last = hi < 0 ? 0 : int(min64(hi / bn + 1, n_blocks));
    }
    if (b.wl >= 0) {
      const int64_t lo = int64_t(m0) + b.off - b.wl;  // first visible key
      first = lo <= 0 ? 0 : int(min64(lo / bn, n_blocks));
    }
    if (last < first) last = first;
  }

  // [first, last) query blocks (of bm rows) whose rows see a key of
  // [n0, n0 + bn) (keys clamped to seqlen_k).
  JF_HOST_DEVICE void q_block_range(int n0, int bn, int bm, int& first, int& last) const {
    const Self& b = self();
    const int m_blocks = (b.seqlen_q + bm - 1) / bm;
    first = 0;
    last = m_blocks;
    if (b.wr >= 0) {
      const int64_t lo = int64_t(n0) - b.off - b.wr;  // first row that sees key n0
      first = lo <= 0 ? 0 : int(min64(lo / bm, m_blocks));
    }
    if (b.wl >= 0) {
      const int64_t hi = int64_t(min32(n0 + bn, b.seqlen_k) - 1) - b.off + b.wl;  // last row
      last = hi < 0 ? 0 : int(min64(hi / bm + 1, m_blocks));
    }
    if (last < first) last = first;
  }

  // False only if every (row < seqlen_q, key) pair of the block is visible
  // by position. data_mask(): whether a data-dependent mask (segment ids) is
  // on, so that every block needs the element mask (asked only for blocks
  // inside seqlen_k, in this order: the kernels' code depends on it).
  template <typename DataMask>
  JF_HOST_DEVICE bool block_needs_mask(int m0, int bm, int n0, int bn, DataMask data_mask) const {
    const Self& b = self();
    if (n0 + bn > b.seqlen_k || data_mask()) return true;
    const int64_t m_last = int64_t(min32(m0 + bm, b.seqlen_q) - 1);
    if (b.wr >= 0 && int64_t(n0 + bn - 1) > int64_t(m0) + b.off + b.wr) return true;
    if (b.wl >= 0 && int64_t(n0) < m_last + b.off - b.wl) return true;
    return false;
  }
  JF_HOST_DEVICE bool block_needs_mask(int m0, int bm, int n0, int bn) const {
    return block_needs_mask(m0, bm, n0, bn, [] { return false; });
  }

  // Visible key interval [lo, hi] of absolute row i (clamped to [0, seqlen_k)).
  // shift: the row's diagonal shift (packed sequences, MaskInfo::row_shift).
  JF_HOST_DEVICE void row_bounds(int i, int& lo, int& hi, int shift = 0) const {
    const Self& b = self();
    const int64_t d = int64_t(i) + b.off + shift;
    lo = b.wl < 0 ? 0 : int(max64(d - b.wl, 0));
    hi = b.wr < 0 ? b.seqlen_k - 1 : int(min64(d + b.wr, b.seqlen_k - 1));
  }

  // Visible query interval [lo, hi] of absolute key k (the transpose of
  // row_bounds, for kernels that hold S^T): not clamped (+-2^62 when a side
  // is unbounded), empty (hi < lo) for keys past seqlen_k.
  // shift: the key's diagonal shift (MaskInfo::key_shift).
  JF_HOST_DEVICE void key_bounds(int k, int64_t& lo, int64_t& hi, int shift = 0) const {
    const Self& b = self();
    const int64_t k64 = int64_t(k) - shift;
    lo = b.wr >= 0 ? k64 - b.off - b.wr : INT64_MIN / 2;
    hi = b.wl >= 0 ? k64 - b.off + b.wl : INT64_MAX / 2;
    if (k >= b.seqlen_k) hi = lo - 1;  // keys past the end: nothing visible
  }
};

// The block geometry of one batch element (built from its SeqlenInfo and the
// window by make_block_info), for kernels that hold no segment ids (MaskInfo
// holds the same fields for those that do).
// Pack-GQA: the `group` query heads that share a KV head are folded into the
// rows, row r = (token r / group, head r % group), so that a tile of rows
// reads each key once for all of them; group 1 is the plain layout. The
// packed_* calls take packed rows; BlockMath's calls take tokens.
struct BlockInfo : BlockMath<BlockInfo> {
  int seqlen_q, seqlen_k;
  int off;     // seqlen_k - seqlen_q
  int wl, wr;  // window sides; -1 = unbounded
  int group;   // query heads folded into the rows per token

  JF_HOST_DEVICE int packed_rows() const { return seqlen_q * group; }
  JF_HOST_DEVICE int token(int row) const { return row / group; }

  // [first, last) KV blocks holding a key visible to some packed row of
  // [r0, r0 + n) (rows clamped to packed_rows(); r0 inside).
  JF_HOST_DEVICE void packed_kv_block_range(int r0, int n, int bn, int& first, int& last) const {
    const int t0 = token(r0), t1 = token(min32(r0 + n, packed_rows()) - 1);
    kv_block_range(t0, t1 - t0 + 1, bn, first, last);
  }

  // The keys [lo, hi) that every packed row of [r0, r0 + n) sees by position
  // (empty when hi <= lo): a block of keys inside needs no element mask.
  JF_HOST_DEVICE void packed_full_keys(int r0, int n, int64_t& lo, int64_t& hi) const {
    const int64_t t0 = token(r0), t1 = token(min32(r0 + n, packed_rows()) - 1);
    lo = 0;
    hi = seqlen_k;
    if (wl >= 0) lo = t1 + off - wl;
    if (wr >= 0) hi = min64(hi, t0 + off + wr + 1);
  }

  // The visible keys [lo, hi] of packed row `row` (row_bounds of its token).
  JF_HOST_DEVICE void packed_row_bounds(int row, int& lo, int& hi) const {
    row_bounds(token(row), lo, hi);
  }

  // Split-KV: of the blocks [first, last), split `split` of num_splits takes
  // an equal share of whole blocks (the last ones possibly fewer or none).
  JF_HOST_DEVICE static void split_blocks(int split, int num_splits, int& first, int& last) {
    const int per = (last - first + num_splits - 1) / num_splits;
    first = min32(last, first + split * per);
    last = min32(last, first + per);
  }
};

// The window sides as the kernels take them: any negative value = unbounded.
// group: query heads folded into the rows (pack-GQA), 1 for none.
JF_HOST_DEVICE BlockInfo make_block_info(const SeqlenInfo& s, int window_left, int window_right,
                                         int group = 1) {
  BlockInfo b;
  b.seqlen_q = s.seqlen_q;
  b.seqlen_k = s.seqlen_k;
  b.off = s.seqlen_k - s.seqlen_q;
  b.wl = window_left < 0 ? -1 : window_left;
  b.wr = window_right < 0 ? -1 : window_right;
  b.group = group;
  return b;
}

}  // namespace jax_flash
