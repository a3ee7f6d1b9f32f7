// The launch's mask as the kernels take it: the block geometry (BlockInfo)
// plus the optional segment ids, whose element test is data-dependent. Built
// on the host once per launch from the parameters.
//
// The element rule lives here once: MaskInfo::visible_keys gives the keys one
// query row sees (visible_rows the rows that see one key, for kernels that
// hold S^T); with segment ids and no exact runs the ids are compared on top
// (has_seg() && !exact). The element masks of the kernel families only map
// their fragment layouts onto these intervals (sm80/mask.cuh,
// sm90/common/mask.cuh, sm90/bwd/bwd_mask.cuh; the decoding kernel, which has
// no segment ids, takes BlockInfo::packed_row_bounds).
#pragma once

#include <cstdint>

#include "jax_flash/block_info.h"
#include "jax_flash/host_device.h"
#include "jax_flash/packing_layout.h"  // kSpanRows
#include "jax_flash/params.h"
#include "jax_flash/seqlen_info.h"

namespace jax_flash {

// What a tile of rows (or keys) can see, from the segment ids (the
// pre-pass cuda/packing/ writes it per kSpanRows-row group; the values of
// jax_flash/_src/tile_spans.py): no row of the tile sees a key outside
// [lo, hi); every real row sees every key of [full_lo, full_hi) (possibly
// empty); exact: each row's id has one run of keys (its q_iv entry), so the
// element mask is positional. The kv spans are the transpose (per group of
// keys: which query rows).
struct alignas(32) SpanEntry {  // one group's entry (packing_layout.h)
  int lo, hi, full_lo, full_hi, exact, pad0, pad1, pad2;
};
struct alignas(8) RunEntry {  // a token's run [lo, hi) (packing_layout.h)
  int lo, hi;
};
struct TileSpan {
  int lo, hi, full_lo, full_hi;
  bool exact;
  JF_HOST_DEVICE bool covers(int a0, int n) const { return a0 >= full_lo && a0 + n <= full_hi; }
};

// BlockInfo's fields (and its math, BlockMath) plus the segment ids, their
// tile spans and the diagonal shifts of packed sequences.
struct MaskInfo : BlockMath<MaskInfo> {
  int seqlen_q, seqlen_k;
  int off;     // seqlen_k - seqlen_q
  int wl, wr;  // window sides; -1 = unbounded
  const int32_t* q_seg;   // [batch, seqlen_q], or nullptr
  const int32_t* kv_seg;  // [batch, seqlen_k], or nullptr
  // With segment ids (else nullptr), each optional: {lo, hi, full_lo, full_hi}
  // per group of kSpanRows rows [batch, ceil(seqlen_q / 64)] (keys) and of
  // kSpanRows keys [batch, ceil(seqlen_k / 64)] (rows). Without them every
  // block of the positional range takes the element mask.
  const SpanEntry* q_span;
  const SpanEntry* kv_span;
  // With the spans: the keys [lo, hi) each row sees [batch, seqlen_q] and the
  // rows that see each key [batch, seqlen_k] (valid in exact groups: the
  // id's run within the band, shifts included).
  const RunEntry* q_iv;
  const RunEntry* kv_iv;
  // Diagonal shifts [batch, seqlen_q] / [batch, seqlen_k] (or nullptr): row i
  // sits at key i + off + q_shift[i]; equal for a row and a key of one
  // segment, so the mask may take either (jax_flash/_src/spec.py).
  const int32_t* q_shift;
  const int32_t* kv_shift;

  JF_HOST_DEVICE bool has_seg() const { return q_seg != nullptr; }

  // The union of the spans of the groups meeting [t0, t0 + n) (clamped to
  // the axis of length len): lo/hi the outer bounds, full the intersection.
  JF_HOST_DEVICE static TileSpan combine(const SpanEntry* spans, int len, int t0, int n) {
    const int g0 = t0 / kSpanRows;
    const int g1 = (min32(t0 + n, len) - 1) / kSpanRows;
    TileSpan s{0x7fffffff, 0, -0x7fffffff, 0x7fffffff, true};
    for (int g = g0; g <= g1; ++g) {
#ifdef __CUDA_ARCH__
      const int4 v = __ldg(reinterpret_cast<const int4*>(spans + g));
      const int4 w = __ldg(reinterpret_cast<const int4*>(spans + g) + 1);
      const SpanEntry e{v.x, v.y, v.z, v.w, w.x, 0, 0, 0};
#else
      const SpanEntry e = spans[g];
#endif
      s.exact = s.exact && e.exact != 0;
      if (e.hi > e.lo) {
        s.lo = s.lo < e.lo ? s.lo : e.lo;
        s.hi = s.hi > e.hi ? s.hi : e.hi;
      }
      s.full_lo = s.full_lo > e.full_lo ? s.full_lo : e.full_lo;
      s.full_hi = s.full_hi < e.full_hi ? s.full_hi : e.full_hi;
    }
    if (s.hi <= s.lo) s.lo = s.hi = 0;
    if (s.full_hi <= s.full_lo) s.full_lo = s.full_hi = 0;
    return s;
  }
  JF_HOST_DEVICE TileSpan rows_span(int batch, int m0, int bm) const {
    const int groups = (seqlen_q + kSpanRows - 1) / kSpanRows;
    return combine(q_span + int64_t(batch) * groups, seqlen_q, m0, bm);
  }
  JF_HOST_DEVICE TileSpan keys_span(int batch, int n0, int bn) const {
    const int groups = (seqlen_k + kSpanRows - 1) / kSpanRows;
    return combine(kv_span + int64_t(batch) * groups, seqlen_k, n0, bn);
  }

  // The positional ranges (BlockMath) narrowed by the spans. With shifts
  // positions alone bound nothing (make_mask_info keeps shifts only with
  // both spans, which include the shifted band).
  JF_HOST_DEVICE void kv_block_range(int batch, int m0, int bm, int bn, int& first, int& last) const {
    if (q_shift != nullptr) {
      first = 0;
      last = (seqlen_k + bn - 1) / bn;
    } else {
      BlockMath::kv_block_range(m0, bm, bn, first, last);
    }
    if (q_span != nullptr) narrow(rows_span(batch, m0, bm), bn, first, last);
  }
  JF_HOST_DEVICE void q_block_range(int batch, int n0, int bn, int bm, int& first, int& last) const {
    if (q_shift != nullptr) {
      first = 0;
      last = (seqlen_q + bm - 1) / bm;
    } else {
      BlockMath::q_block_range(n0, bn, bm, first, last);
    }
    if (kv_span != nullptr) narrow(keys_span(batch, n0, bn), bm, first, last);
  }
  JF_HOST_DEVICE static void narrow(const TileSpan& s, int b, int& first, int& last) {
    const int lo = s.lo / b, hi = (s.hi + b - 1) / b;
    first = first > lo ? first : lo;
    last = last < hi ? last : hi;
    if (last < first) last = first;
  }

  // The kernels without spans (see `packed` in the kernels' configurations):
  // positional ranges, and with segment ids every block takes the mask.
  JF_HOST_DEVICE bool block_needs_mask_by_position(int m0, int bm, int n0, int bn) const {
    return BlockMath::block_needs_mask(m0, bm, n0, bn, [this] { return has_seg(); });
  }

  // Whether the (rows [m0, m0 + bm), keys [n0, n0 + bn)) block needs the
  // element mask. Segment ids: every block, unless the spans show the keys
  // visible from every row (they then also bound the positions).
  JF_HOST_DEVICE bool block_needs_mask(int batch, int m0, int bm, int n0, int bn) const {
    if (has_seg()) {
      if (q_span != nullptr) return !rows_span(batch, m0, bm).covers(n0, bn);
      if (kv_span != nullptr) return !keys_span(batch, n0, bn).covers(m0, bm);
      return true;
    }
    return BlockMath::block_needs_mask(m0, bm, n0, bn);
  }

  // The mask plan of the rows [m0, m0 + bm) against blocks of bn keys, in one
  // register for the kernels' hot loops (computed once per tile): the blocks
  // every row sees entirely, [first, last) (bits 31..17 and 16..2; none when
  // they do not fit in 15 bits), and bit 0: exact runs. 0 without spans.
  JF_HOST_DEVICE uint32_t row_plan(int batch, int m0, int bm, int bn) const {
    if (q_span == nullptr) return 0u;
    const TileSpan s = rows_span(batch, m0, bm);
    const int first = (s.full_lo + bn - 1) / bn, last = s.full_hi / bn;
    const uint32_t exact = s.exact ? 1u : 0u;
    if (last <= first || last >= (1 << 15)) return exact;
    return (uint32_t(first) << 17) | (uint32_t(last) << 2) | exact;
  }
  JF_HOST_DEVICE static bool plan_exact(uint32_t plan) { return (plan & 1u) != 0; }
  // Whether block n (of the plan's bn keys) of the plan's rows needs the mask.
  JF_HOST_DEVICE bool block_needs_mask(uint32_t plan, int m0, int bm, int n, int bn) const {
    if (has_seg()) {
      const int first = int(plan >> 17), last = int((plan >> 2) & 0x7fffu);
      return !(n >= first && n < last);
    }
    return BlockMath::block_needs_mask(m0, bm, n * bn, bn);
  }

  // Whether the rows [m0, m0 + bm) (the keys [n0, n0 + bn)) have exact runs.
  JF_HOST_DEVICE bool rows_exact(int batch, int m0, int bm) const {
    return q_span != nullptr && rows_span(batch, m0, bm).exact;
  }
  JF_HOST_DEVICE bool keys_exact(int batch, int n0, int bn) const {
    return kv_span != nullptr && keys_span(batch, n0, bn).exact;
  }
  // The visible interval of an in-range row (key); use only where exact.
  JF_HOST_DEVICE void row_run(int batch, int row, int& lo, int& hi) const {
    load_run(q_iv + int64_t(batch) * seqlen_q + row, lo, hi);
  }
  JF_HOST_DEVICE void key_run(int batch, int key, int& lo, int& hi) const {
    load_run(kv_iv + int64_t(batch) * seqlen_k + key, lo, hi);
  }
  // Diagonal shifts of an in-range row / key (0 without shifts).
  JF_HOST_DEVICE int row_shift(int batch, int row) const {
    if (q_shift == nullptr || row >= seqlen_q) return 0;
    return load_int(q_shift + int64_t(batch) * seqlen_q + row);
  }
  JF_HOST_DEVICE int key_shift(int batch, int key) const {
    if (kv_shift == nullptr || key >= seqlen_k) return 0;
    return load_int(kv_shift + int64_t(batch) * seqlen_k + key);
  }

  // The element rule, per query row: the keys [lo, hi] (absolute,
  // inclusive; empty when hi < lo) that row `row` sees. kPacked: the packing
  // buffer is on (the kernels' `packed` configuration): rows carry diagonal
  // shifts, and exact tiles (row_plan, rows_exact: each row's id has one run
  // of keys) read their runs. exact is uniform over the tile (false when not
  // kPacked). Rows past seqlen_q are never stored (forward) or have P = 0
  // (backward): whatever they get is harmless.
  template <bool kPacked>
  JF_HOST_DEVICE void visible_keys(int batch, int row, bool exact, int& lo, int& hi) const {
    if constexpr (!kPacked) {
      row_bounds(row, lo, hi);
    } else if (exact) {
      lo = 0;
      hi = -1;
      if (row < seqlen_q) {
        row_run(batch, row, lo, hi);
        --hi;
      }
    } else {
      row_bounds(row, lo, hi, row_shift(batch, row));
    }
  }
  // Its transpose, per key: the rows [lo, hi] (absolute, inclusive, not
  // clamped: BlockMath::key_bounds) that see key `key`; empty past seqlen_k.
  // exact: keys_exact of the tile's keys.
  template <bool kPacked>
  JF_HOST_DEVICE void visible_rows(int batch, int key, bool exact, int64_t& lo, int64_t& hi) const {
    if constexpr (!kPacked) {
      key_bounds(key, lo, hi);
    } else if (exact) {
      lo = 0;
      hi = -1;
      if (key < seqlen_k) {
        int run_lo, run_hi;
        key_run(batch, key, run_lo, run_hi);
        lo = run_lo;
        hi = int64_t(run_hi) - 1;
      }
    } else {
      key_bounds(key, lo, hi, key_shift(batch, key));
    }
  }

  // The mask of one variable-length sequence (no segment ids): its own
  // lengths, rows and keys counted from its start, bottom-right aligned.
  JF_HOST_DEVICE MaskInfo for_sequence(int len_q, int len_k) const {
    MaskInfo m = *this;
    m.seqlen_q = len_q;
    m.seqlen_k = len_k;
    m.off = len_k - len_q;
    return m;
  }

  // Read-only loads (through the non-coherent cache on the device).
  JF_HOST_DEVICE static void load_run(const RunEntry* e, int& lo, int& hi) {
#ifdef __CUDA_ARCH__
    const int2 v = __ldg(reinterpret_cast<const int2*>(e));
    lo = v.x;
    hi = v.y;
#else
    lo = e->lo;
    hi = e->hi;
#endif
  }
  JF_HOST_DEVICE static int load_int(const int32_t* p) { return load_readonly(p); }
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
  mi.q_span = reinterpret_cast<const SpanEntry*>(p.q_span);
  mi.kv_span = reinterpret_cast<const SpanEntry*>(p.kv_span);
  mi.q_iv = reinterpret_cast<const RunEntry*>(p.q_iv);
  mi.kv_iv = reinterpret_cast<const RunEntry*>(p.kv_iv);
  mi.q_shift = p.q_shift;
  mi.kv_shift = p.kv_shift;
  if (mi.q_seg == nullptr || mi.kv_seg == nullptr) {
    mi.q_seg = mi.kv_seg = nullptr;
    mi.q_span = mi.kv_span = nullptr;
    mi.q_shift = mi.kv_shift = nullptr;
  }
  if (mi.q_iv == nullptr || mi.kv_iv == nullptr) mi.q_span = mi.kv_span = nullptr;
  if (mi.q_shift == nullptr || mi.kv_shift == nullptr || mi.q_span == nullptr ||
      mi.kv_span == nullptr)
    mi.q_shift = mi.kv_shift = nullptr;
  return mi;
}

}  // namespace jax_flash
