// The tile order of a variable-length (cu_seqlens) forward, computed by the
// kernel itself from the offsets: no pre-pass. A tile is (sequence, query
// block of that sequence's own length, query head); no tile straddles two
// sequences.
//
// Order: heaviest first, without sorting. Each sequence's query blocks m
// get levels lo + m, where lo estimates the KV blocks a block sees beyond
// its own index:
//   causal-like (a right bound, no left one): lo = max(0, nbk - nbq), the
//     bottom-right diagonal's offset in blocks, so a tile's level is its
//     KV block count (exact for T == S per sequence and square tiles);
//   otherwise: lo = max(0, nbk - 1), every block of a sequence sees all its
//     nbk key blocks, so the longest sequences hold the top levels and the
//     shortest ones the bottom.
// The query heads are taken in sections (a multiple of the GQA group) whose
// K and V, over all sequences, fit in about 32 MB of L2, as the dense
// kernels' TileOrder does: section by section; within one, level by level
// from the highest down; within a level by sequence (batch-major), then
// head: the heads of one sequence run side by side (the GQA group's K / V
// shared in L2).
//
// Decoding tile index t walks a cursor (section, level, the level's first
// index and tile count) down the levels of a section, then to the next
// section. The indices one CTA decodes increase (the dynamic counter), so
// the cursor only moves forward. The per-sequence work is
// a 32-wide mask of the sequences active at a level: on the device one
// lane per sequence and a ballot (the producer warp), on the host a loop;
// the rest is the same code on both (cuda/tests/sm90_varlen_order_check.cpp
// replays it against a brute-force enumeration).
#pragma once

#include <cstdint>

#include "jax_flash/host_device.h"
#include "jax_flash/seqlen_info.h"  // load_readonly

namespace jax_flash {

// One sequence of a batch row: its rows and keys in that row.
struct VarlenSeq {
  int offset_q, len_q, offset_k, len_k;
};

// Where the cursor stands: `section`, `level`, the index of the level's
// first tile and its tile count (level < 0: past the section's last tile);
// the order's top level and query blocks per head (fixed).
struct VarlenCursor {
  int section, level, base, count;
  int top, blocks;
};

// A decoded tile: block (query block of the sequence), head, batch row and
// the sequence's geometry; block < 0: no tile (past the end).
struct VarlenTile {
  int block, head, batch;
  VarlenSeq seq;
};

JF_HOST_DEVICE int popc32(uint32_t m) {
#ifdef __CUDA_ARCH__
  return __popc(m);
#else
  int n = 0;
  for (; m != 0u; m &= m - 1u) ++n;
  return n;
#endif
}

// Position of the k-th (0-based) set bit of m (k < popc32(m)).
JF_HOST_DEVICE int nth_set_bit(uint32_t m, int k) {
#ifdef __CUDA_ARCH__
  return int(__fns(m, 0u, k + 1));
#else
  for (int i = 0; i < 32; ++i)
    if ((m >> i) & 1u) {
      if (k == 0) return i;
      --k;
    }
  return -1;
#endif
}

struct VarlenOrder {
  const int32_t* cu_q;  // [batch, num_seqs + 1] offsets into each batch row
  const int32_t* cu_k;
  int batch, num_seqs;  // sequences per batch row
  int total_q, total_k;  // rows of the tensors (offsets are clamped to them)
  int num_heads;         // query heads
  int heads_per_section;  // query heads per L2 section (l2_section_heads)
  int block_m, block_n;
  bool causal_like;

  // Query heads per section: K + V of all sequences of a power of two of KV
  // heads in about 32 MB (TileOrder's rule), times the GQA group.
  static int l2_section_heads(int batch, int total_k, int head_bytes, int num_heads, int heads_per_kv) {
    const long long kv_head_bytes = 2LL * batch * total_k * head_bytes;  // K + V of one KV head
    const long long l2_budget = 32LL << 20;
    int sec = 1;
    while (2LL * sec * kv_head_bytes <= l2_budget && sec * heads_per_kv < num_heads) sec *= 2;
    sec *= heads_per_kv;
    return sec > num_heads ? num_heads : (sec < 1 ? 1 : sec);
  }

  JF_HOST_DEVICE int num_sequences() const { return batch * num_seqs; }

  JF_HOST_DEVICE static int clamp_to(int x, int hi) { return x < 0 ? 0 : (x > hi ? hi : x); }

  // Sequence g (batch-major), offsets clamped to the tensors and lengths to
  // >= 0: any offsets give in-bounds rows.
  JF_HOST_DEVICE VarlenSeq seq(int g) const {
    const int b = g / num_seqs, s = g - b * num_seqs;
    const int64_t i = int64_t(b) * (num_seqs + 1) + s;
    VarlenSeq r;
    r.offset_q = clamp_to(load_readonly(cu_q + i), total_q);
    r.len_q = clamp_to(load_readonly(cu_q + i + 1), total_q) - r.offset_q;
    r.offset_k = clamp_to(load_readonly(cu_k + i), total_k);
    r.len_k = clamp_to(load_readonly(cu_k + i + 1), total_k) - r.offset_k;
    if (r.len_q < 0) r.len_q = 0;
    if (r.len_k < 0) r.len_k = 0;
    return r;
  }
  // Sequence g's levels [lo, lo + nb) (nb = its query blocks).
  JF_HOST_DEVICE void levels(const VarlenSeq& s, int& lo, int& nb) const {
    nb = (s.len_q + block_m - 1) / block_m;
    const int nbk = (s.len_k + block_n - 1) / block_n;
    lo = causal_like ? nbk - nb : nbk - 1;
    if (lo < 0) lo = 0;
  }
  JF_HOST_DEVICE bool active(int g, int level) const {
    if (g >= num_sequences()) return false;
    int lo, nb;
    levels(seq(g), lo, nb);
    return level >= lo && level < lo + nb;
  }

  // Bit i: sequence g0 + i has a tile at `level`. Device: every lane of the
  // warp calls it (lane i evaluates sequence g0 + i).
  JF_HOST_DEVICE uint32_t active_mask(int level, int g0) const {
#ifdef __CUDA_ARCH__
    return __ballot_sync(0xffffffffu, active(g0 + int(threadIdx.x & 31u), level));
#else
    uint32_t m = 0u;
    for (int i = 0; i < 32; ++i)
      if (active(g0 + i, level)) m |= 1u << i;
    return m;
#endif
  }
  // The highest level of any tile (-1: no tile). Device: the whole warp.
  JF_HOST_DEVICE int top_level() const {
    int top = -1;
#ifdef __CUDA_ARCH__
    for (int g = int(threadIdx.x & 31u); g < num_sequences(); g += 32) {
#else
    for (int g = 0; g < num_sequences(); ++g) {
#endif
      int lo, nb;
      levels(seq(g), lo, nb);
      if (nb > 0 && lo + nb - 1 > top) top = lo + nb - 1;
    }
#ifdef __CUDA_ARCH__
    top = __reduce_max_sync(0xffffffffu, top);
#endif
    return top;
  }
  // Sequences with a tile at `level` (device: the whole warp).
  JF_HOST_DEVICE int level_seqs(int level) const {
    int n = 0;
    for (int g0 = 0; g0 < num_sequences(); g0 += 32) n += popc32(active_mask(level, g0));
    return n;
  }
  // Query blocks of all sequences (device: the whole warp).
  JF_HOST_DEVICE int query_blocks() const {
    int n = 0;
#ifdef __CUDA_ARCH__
    for (int g = int(threadIdx.x & 31u); g < num_sequences(); g += 32) {
#else
    for (int g = 0; g < num_sequences(); ++g) {
#endif
      int lo, nb;
      levels(seq(g), lo, nb);
      n += nb;
    }
#ifdef __CUDA_ARCH__
    n = __reduce_add_sync(0xffffffffu, n);
#endif
    return n;
  }
  JF_HOST_DEVICE int section_heads(int section) const {
    const int left = num_heads - section * heads_per_section;
    return left < heads_per_section ? left : heads_per_section;
  }
  // The cursor at the top of `section`, whose first tile is `base`.
  JF_HOST_DEVICE void enter(VarlenCursor& c, int section, int base) const {
    c.section = section;
    c.level = c.top;
    c.base = base;
    c.count = c.level >= 0 ? level_seqs(c.level) * section_heads(section) : 0;
  }

  JF_HOST_DEVICE VarlenCursor start() const {
    VarlenCursor c;
    c.top = top_level();
    c.blocks = query_blocks();
    enter(c, 0, 0);
    return c;
  }

  // Tile t; t must not be below any index this cursor decoded before.
  JF_HOST_DEVICE VarlenTile decode(VarlenCursor& c, int t) const {
    VarlenTile w;
    w.block = -1;
    w.head = w.batch = 0;
    w.seq = VarlenSeq{0, 0, 0, 0};
    const int per_section = c.blocks * heads_per_section;  // tiles of a full section
    if (per_section <= 0) return w;
    const int section = t / per_section;
    if (section * heads_per_section >= num_heads) return w;
    if (section != c.section) enter(c, section, section * per_section);
    const int hs = section_heads(section);
    while (c.level >= 0 && t >= c.base + c.count) {
      c.base += c.count;
      --c.level;
      c.count = c.level >= 0 ? level_seqs(c.level) * hs : 0;
    }
    if (c.level < 0) return w;
    const int r = t - c.base;
    int k = r / hs;
    w.head = section * heads_per_section + (r - k * hs);
    for (int g0 = 0; g0 < num_sequences(); g0 += 32) {
      const uint32_t m = active_mask(c.level, g0);
      const int n = popc32(m);
      if (k < n) {
        const int g = g0 + nth_set_bit(m, k);
        w.seq = seq(g);
        int lo, nb;
        levels(w.seq, lo, nb);
        w.block = c.level - lo;
        w.batch = g / num_seqs;
        return w;
      }
      k -= n;
    }
    return w;  // not reached: the level counted its tiles
  }

  // An upper bound of the tile count from the shapes alone (the grid):
  // each sequence has at most len_q / block_m + 1 blocks.
  static int64_t max_tiles(int batch, int num_seqs, int total_q, int num_heads, int block_m) {
    return int64_t(num_heads) * (int64_t(batch) * ((total_q + block_m - 1) / block_m) +
                                 int64_t(batch) * num_seqs);
  }
};

}  // namespace jax_flash
