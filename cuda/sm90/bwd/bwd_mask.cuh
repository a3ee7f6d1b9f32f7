// Masking for the sm90 backward, on the transposed score tile S^T (keys x
// queries) that the consumer warpgroups hold (SdP_swapAB). The rule is
// MaskInfo's (jax_flash/mask_info.h: visible_rows per key, the transpose of
// visible_keys, and the segment ids unless the runs are exact;
// BlockMath::q_block_range gives each KV block's query blocks); this file
// only walks the fragment. Queries >= seqlen_q are not masked here: their P
// is 0 through the staged LSE (+inf), and their Q / dO rows are zero-filled
// by TMA.
#pragma once

#include <cstdint>

#include "sm90/common/mask.cuh"

namespace jax_flash::sm90 {

// Deterministic dQ order (BwdDqAccumulator::store): the KV blocks whose query-block
// ranges hold query block m add into its dQ tile in descending block order.
// They form an interval of blocks: first(n) and last(n) of
// BlockInfo::q_block_range are non-decreasing in n, so {n : first(n) <= m} is a prefix, {n : last(n) > m}
// a suffix. So the block that adds just before block n is n + 1 when m is in
// n + 1's range, else n is the first. Returns n + 1's range (empty when n is
// the last block).
JF_DEVICE void dq_pred_range(const MaskInfo& mi, int n_block, int num_n_blocks, int bn, int bm,
                             int& first, int& last) {
  first = last = 0;
  if (n_block + 1 < num_n_blocks) mi.BlockMath::q_block_range((n_block + 1) * bn, bn, bm, first, last);
}

// Masks a warpgroup's S^T fragment (64 keys x NQ queries, wgmma layout,
// float s[NQ/2]) with -inf. Element s[4j + 2h + e] is key key0 + 8h,
// query q0 + 8j + e, where key0 = absolute key of the thread's first row
// (n0 + 64 wg + 16 warp + lane / 4) and q0 = absolute query of its first
// column (m0 + 2 (lane % 4)).

// Key key0 + 8h is seen by the queries [lo, hi] (absolute, inclusive): made
// relative to q0 and clamped to [-1, 2 NR] (the column offsets d are in
// [0, 2 NR)) so that the compare is on small ints.
template <int NR>
JF_DEVICE void mask_key_outside(float (&s)[NR], int h, int64_t lo, int64_t hi, int q0) {
  const int rlo = int(max64(min64(lo - q0, 2 * NR), -1));
  const int rhi = int(max64(min64(hi - q0, 2 * NR), -1));
#pragma unroll
  for (int j = 0; j < NR / 4; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int d = 8 * j + e;
      if (d < rlo || d > rhi) s[4 * j + 2 * h + e] = -INFINITY;
    }
}

// Queries whose segment id differs from the key's.
// kSegUnroll > 0 (kBlockM 80 with softcap): the test first collects mismatch
// bits in a loop unrolled only kSegUnroll times, which bounds the query
// segment ids in flight (fully unrolled, the 20 ids of 80 queries make that
// kernel spill), then applies them.
template <int NR, int kSegUnroll>
JF_DEVICE void mask_other_segments_t(float (&s)[NR], const MaskInfo& mi, int batch, int key0, int q0) {
  const int32_t* kv_seg = mi.kv_seg + int64_t(batch) * mi.seqlen_k;
  const int32_t* q_seg = mi.q_seg + int64_t(batch) * mi.seqlen_q;
  // Keys past seqlen_k are already -inf; do not read them.
  const int ks0 = key0 < mi.seqlen_k ? __ldg(kv_seg + key0) : 0;
  const int ks1 = key0 + 8 < mi.seqlen_k ? __ldg(kv_seg + key0 + 8) : 0;
  if constexpr (kSegUnroll > 0) {
    static_assert(NR / 2 <= 32 && (NR / 4) % kSegUnroll == 0, "mismatch bits");
    uint32_t bits0 = 0, bits1 = 0;  // bit 2j + e: query q0 + 8j + e vs key key0 (+ 8)
#pragma unroll kSegUnroll
    for (int j = 0; j < NR / 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q = q0 + 8 * j + e;
        const int qs = q < mi.seqlen_q ? __ldg(q_seg + q) : ks0;  // as below
        bits0 |= uint32_t(qs != ks0) << (2 * j + e);
        bits1 |= uint32_t(qs != ks1) << (2 * j + e);
      }
#pragma unroll
    for (int j = 0; j < NR / 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if ((bits0 >> (2 * j + e)) & 1u) s[4 * j + e] = -INFINITY;
        if ((bits1 >> (2 * j + e)) & 1u) s[4 * j + 2 + e] = -INFINITY;
      }
  } else {
#pragma unroll
    for (int j = 0; j < NR / 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q = q0 + 8 * j + e;
        // Queries past seqlen_q have P = 0 anyway; do not read them.
        const int qs = q < mi.seqlen_q ? __ldg(q_seg + q) : ks0;
        if (qs != ks0) s[4 * j + e] = -INFINITY;
        if (qs != ks1) s[4 * j + 2 + e] = -INFINITY;
      }
  }
}

// kPacked, exact: MaskInfo::visible_rows's (exact: keys_exact of the keys).
template <bool kPacked, int kSegUnroll = 0, int NR>
JF_DEVICE void apply_mask_t(float (&s)[NR], const MaskInfo& mi, int batch, int key0, int q0, bool exact) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int64_t lo, hi;
    mi.visible_rows<kPacked>(batch, key0 + 8 * h, exact, lo, hi);
    mask_key_outside(s, h, lo, hi, q0);
  }
  if (mi.has_seg() && !exact) mask_other_segments_t<NR, kSegUnroll>(s, mi, batch, key0, q0);
}

}  // namespace jax_flash::sm90
