// Persistent tile scheduler: grid = min(#tiles, #SMs) CTAs; CTA b processes
// tiles b, b + gridDim.x, b + 2 * gridDim.x, ... (static round robin, so the
// producer warp and the consumer warpgroups walk the same sequence without
// talking to each other). A tile is (query block, head, batch).
//
// Order of the tile sequence:
// - no causal-like mask: head-major, query blocks ascending: the CTAs running
//   at the same time share the K/V of one or two heads (L2 reuse).
// - causal (wr >= 0, unbounded left window): heaviest first (longest KV
//   ranges: the last query blocks), so the tail of the schedule is made of the
//   cheapest tiles. To keep K/V in L2 the heads are taken in sections of
//   `heads_per_section` (about 32 MB of K+V, a power of two times the GQA group
//   like FA3's L2 swizzle); within a section: query block descending, then head.
#pragma once

#include "ptx/common.cuh"

namespace jax_flash::sm90 {

struct TileScheduler {
  int num_m_blocks;
  int num_bh;              // batch * num_heads
  int num_heads;
  int total;               // num_m_blocks * num_bh
  int heads_per_section;   // 0: plain head-major order
  int section_tiles;       // heads_per_section * num_m_blocks

  JF_DEVICE void decode(int t, int& m_block, int& head, int& batch) const {
    int bh;
    if (heads_per_section == 0) {
      bh = t / num_m_blocks;
      m_block = t - bh * num_m_blocks;
    } else {
      const int sec = t / section_tiles;
      const int r = t - sec * section_tiles;
      const int base = sec * heads_per_section;
      const int hs = min(heads_per_section, num_bh - base);  // last section may be short
      const int mm = r / hs;
      bh = base + (r - mm * hs);
      m_block = num_m_blocks - 1 - mm;
    }
    batch = bh / num_heads;
    head = bh - batch * num_heads;
  }
};

inline TileScheduler make_scheduler(int batch, int num_heads, int heads_per_kv, int seqlen_q,
                                    int seqlen_k, int head_dim, int block_m, bool causal_like) {
  TileScheduler s;
  s.num_m_blocks = (seqlen_q + block_m - 1) / block_m;
  s.num_bh = batch * num_heads;
  s.num_heads = num_heads;
  s.total = s.num_m_blocks * s.num_bh;
  s.heads_per_section = 0;
  s.section_tiles = 0;
  if (causal_like) {
    const long long kv_head_bytes = 2LL * seqlen_k * head_dim * 2;  // K + V of one KV head
    const long long l2_budget = 32LL << 20;
    int sec = 1;
    while (2LL * sec * kv_head_bytes <= l2_budget) sec *= 2;
    sec *= heads_per_kv;  // q heads sharing a KV head come together
    if (sec > s.num_bh) sec = s.num_bh;
    s.heads_per_section = sec < 1 ? 1 : sec;
    s.section_tiles = s.heads_per_section * s.num_m_blocks;
  }
  return s;
}

}  // namespace jax_flash::sm90
