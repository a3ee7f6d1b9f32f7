// The tile order of the variable-length (cu_seqlens) backward: a tile is
// (sequence, KV block of that sequence's own length, KV head); no tile
// straddles two sequences.
//
// It is the forward's order (varlen_order.h) with the roles of queries and
// keys exchanged: the "query blocks" it enumerates are KV blocks, its
// "heads" are KV heads, and the levels count the query blocks a KV block
// sees, in units of kBlockN rows for both sides (so that one level is the
// same work in every sequence whatever the tile's kBlockM):
//   causal-like (a right bound, no left one): KV block n of a sequence sees
//     the queries from about n kBlockN - (len_k - len_q) to its end, so the
//     lightest block is the last; the forward's level lo + j (j counted from
//     the sequence's start, lo = max(0, nbq - nbk)) is given to block
//     nbk - 1 - j: a tile's level is its query-block count (exact for
//     len_q == len_k), heaviest first;
//   otherwise every KV block sees all nbq query blocks: the sequences with
//     the most queries first.
// Sections of KV heads keep the Q and dO of their GQA groups, over all
// sequences, within about 32 MB of L2; within a section level by level, then
// sequence, then head (the KV heads of one sequence side by side).
// The decode is the forward's (a cursor that only moves down; on the device
// the whole warp, a ballot over 32 sequences at a time).
// cuda/tests/sm90_varlen_bwd_order_check.cpp replays it on the host against a
// brute-force enumeration.
#pragma once

#include <cstdint>

#include "jax_flash/varlen_order.h"

// The per-lane loops below are unrolled on the device (their arrays stay in
// registers); g++ would warn about the pragma.
#ifdef __CUDA_ARCH__
#define JF_VARLEN_UNROLL _Pragma("unroll")
#else
#define JF_VARLEN_UNROLL
#endif

namespace jax_flash {

struct VarlenBwdOrder {
  VarlenOrder fwd;  // the forward's order over (KV block, KV head): q and k exchanged

  // cu_q / cu_k: [batch, num_seqs + 1]; total_q / total_k: rows of Q / K;
  // block_n: keys per KV block (the tile); row_bytes: bytes of one Q row
  // plus one dO row of one query head.
  static VarlenBwdOrder make(const int32_t* cu_q, const int32_t* cu_k, int batch, int num_seqs, int total_q,
                             int total_k, int num_heads_k, int heads_per_kv, int block_n, int row_bytes,
                             bool causal_like) {
    VarlenBwdOrder o;
    o.fwd.cu_q = cu_k;
    o.fwd.cu_k = cu_q;
    o.fwd.batch = batch;
    o.fwd.num_seqs = num_seqs;
    o.fwd.total_q = total_k;
    o.fwd.total_k = total_q;
    o.fwd.num_heads = num_heads_k;
    // What a KV head's tiles stream: Q and dO of its group's q heads
    // (l2_section_heads counts 2 * rows * head_bytes per head).
    o.fwd.heads_per_section =
        VarlenOrder::l2_section_heads(batch, total_q, (row_bytes * heads_per_kv + 1) / 2, num_heads_k, 1);
    o.fwd.block_m = block_n;
    o.fwd.block_n = block_n;
    o.fwd.causal_like = causal_like;
    return o;
  }

  JF_HOST_DEVICE VarlenCursor start() const { return fwd.start(); }

  // Tile t: block = KV block of the sequence (from its start), head = KV
  // head, seq in the queries' and keys' own terms; block < 0: past the end.
  // t must not be below any index this cursor decoded before.
  JF_HOST_DEVICE VarlenTile decode(VarlenCursor& c, int t) const {
    VarlenTile w = fwd.decode(c, t);
    const VarlenSeq s = w.seq;
    w.seq = VarlenSeq{s.offset_k, s.len_k, s.offset_q, s.len_q};
    if (w.block >= 0 && fwd.causal_like) w.block = (s.len_q + fwd.block_m - 1) / fwd.block_m - 1 - w.block;
    return w;
  }

  // The same tile, decoded from the top of the order in one go (every CTA of
  // the backward decodes one index, so no cursor carries over between
  // tiles): with at most kCachedSeqs sequences each lane keeps the level
  // range of its sequences (g = lane + 32 i) in registers, so a level costs
  // kCachedSeqs / 32 ballots instead of reloading the offsets (device: the
  // whole warp). Otherwise the cursor's decode.
  static constexpr int kCachedPerLane = 4;
  static constexpr int kCachedSeqs = 32 * kCachedPerLane;
  JF_HOST_DEVICE VarlenTile decode_one(int t) const {
    if (fwd.num_sequences() > kCachedSeqs) {
      VarlenCursor c = start();
      return decode(c, t);
    }
    int lo[kCachedPerLane], nb[kCachedPerLane];
#ifdef __CUDA_ARCH__
    const int lane = int(threadIdx.x & 31u);
#else
    const int lane = 0;  // the host evaluates every sequence in active_bits
#endif
    int top = -1, blocks = 0;
JF_VARLEN_UNROLL
    for (int i = 0; i < kCachedPerLane; ++i) {
      lo[i] = 0;
      nb[i] = 0;
      const int g = lane + 32 * i;
      if (g < fwd.num_sequences()) fwd.levels(fwd.seq(g), lo[i], nb[i]);
      if (nb[i] > 0 && lo[i] + nb[i] - 1 > top) top = lo[i] + nb[i] - 1;
      blocks += nb[i];
    }
#ifdef __CUDA_ARCH__
    top = __reduce_max_sync(0xffffffffu, top);
    blocks = __reduce_add_sync(0xffffffffu, blocks);
#else
    top = fwd.top_level();
    blocks = fwd.query_blocks();
#endif
    VarlenTile w;
    w.block = -1;
    w.head = w.batch = 0;
    w.seq = VarlenSeq{0, 0, 0, 0};
    const int hps = fwd.heads_per_section;
    const int per_section = blocks * hps;
    if (per_section <= 0 || t < 0) return w;
    const int section = t / per_section;
    if (section * hps >= fwd.num_heads) return w;
    const int hs = fwd.section_heads(section);
    int base = section * per_section, level = top;
    for (; level >= 0; --level) {
      int n = 0;
JF_VARLEN_UNROLL
      for (int i = 0; i < kCachedPerLane; ++i) n += popc32(active_bits(lo[i], nb[i], level, i));
      if (t < base + n * hs) break;
      base += n * hs;
    }
    if (level < 0) return w;
    const int r = t - base;
    int k = r / hs;
    w.head = section * hps + (r - k * hs);
JF_VARLEN_UNROLL
    for (int i = 0; i < kCachedPerLane; ++i) {
      const uint32_t m = active_bits(lo[i], nb[i], level, i);
      const int n = popc32(m);
      if (k >= 0 && k < n) {
        const int g = 32 * i + nth_set_bit(m, k);
        const VarlenSeq s = fwd.seq(g);
        int l, b;
        fwd.levels(s, l, b);
        w.block = level - l;
        w.batch = g / fwd.num_seqs;
        w.seq = VarlenSeq{s.offset_k, s.len_k, s.offset_q, s.len_q};
        if (fwd.causal_like) w.block = b - 1 - w.block;
      }
      k -= n;
    }
    return w;
  }

  // Bit j: sequence 32 i + j has a tile at `level` (device: this lane's
  // sequence 32 i + lane has the cached range [lo, lo + nb); host: every
  // sequence evaluated from the offsets).
  JF_HOST_DEVICE uint32_t active_bits(int lo, int nb, int level, int i) const {
#ifdef __CUDA_ARCH__
    return __ballot_sync(0xffffffffu, level >= lo && level < lo + nb);
#else
    (void)lo;
    (void)nb;
    return fwd.active_mask(level, 32 * i);
#endif
  }

  // An upper bound of the tile count from the shapes alone (the grid).
  static int64_t max_tiles(int batch, int num_seqs, int total_k, int num_heads_k, int block_n) {
    return VarlenOrder::max_tiles(batch, num_seqs, total_k, num_heads_k, block_n);
  }
};

}  // namespace jax_flash
