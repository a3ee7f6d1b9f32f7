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
//
// kFlagDynamic (FA3's DynamicPersistentTileScheduler, the one it uses for
// causal): same tile order, but CTA b starts with tile b and then takes the
// next unclaimed tile from a global counter (atomicAdd + gridDim.x), so the
// longest tiles go first to whichever SM is free (LPT) instead of a fixed
// round robin. The producer warp claims the next tile when it starts the
// current one (the atomic's latency hides behind the loads) and hands the
// index to the consumer threads through shared memory (mbarriers tile_full /
// tile_empty, args.cuh). Workspace: one int per call
// (FwdParams::sm90_tile_counter), zeroed by the launcher with cudaMemsetAsync
// on the stream right before the kernel; every launch claims exactly `total`
// indices (one per processed tile: grid = min(total, #SMs) first tiles, then
// one per claimed tile, plus one failed claim per CTA). No self-reset and no
// global ring: a counter shared by two launches (another stream, a graph
// replay) would hand tiles of one launch to the other, and a reset racing
// the other launch's claims could leave it non-zero for good.
#pragma once

#include "ptx/common.cuh"

namespace jax_flash::sm90 {

// Shared-memory int load that the compiler neither caches nor moves across
// the named barriers around it.
JF_DEVICE int ld_shared_s32(uint32_t addr) {
  int v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

struct TileScheduler {
  int num_m_blocks;
  int num_bh;              // batch * num_heads
  int num_heads;
  int total;               // num_m_blocks * num_bh
  int heads_per_section;   // 0: plain head-major order
  int section_tiles;       // heads_per_section * num_m_blocks
  int* counter;            // kFlagDynamic: the call's zeroed int (see above), else unused

  // kFlagDynamic: the tile this CTA processes after the current one (>= total:
  // none). One call per processed tile, by one thread. total < 2^30 (blocks
  // of >= 128 rows, fwd_supported), so v + gridDim.x cannot overflow.
  JF_DEVICE int claim_next() const { return atomicAdd(counter, 1) + int(gridDim.x); }

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

// The persistent grid: one CTA per SM, at most one per tile. balanced: the
// fewest CTAs that need no more rounds than that (at most ceil(tiles / sms)
// tiles each), so fewer than `rounds` CTAs sit out the last round (one CTA
// per SM can leave up to sms - 1 idle). With tiles of equal cost that changes
// nothing unthrottled (same number of rounds); at the power cap the SMs idle
// in a partial last round leave part of the budget unused, while the smaller
// grid runs every round at the cap (2048 tiles on 132 SMs: 16 rounds either
// way, 128 CTAs all busy instead of 68 of 132 in the last round).
// cuda/tests/sm90_fwd_host_check.cpp checks these properties.
inline int persistent_grid(int tiles, int sms, bool balanced) {
  const int grid = tiles < sms ? tiles : sms;
  if (!balanced || grid <= 0) return grid;
  const int rounds = (tiles + sms - 1) / sms;
  return (tiles + rounds - 1) / rounds;
}

inline TileScheduler make_scheduler(int batch, int num_heads, int heads_per_kv, int seqlen_q,
                                    int seqlen_k, int head_dim, int block_m, bool causal_like) {
  TileScheduler s;
  s.num_m_blocks = (seqlen_q + block_m - 1) / block_m;
  s.num_bh = batch * num_heads;
  s.num_heads = num_heads;
  s.total = s.num_m_blocks * s.num_bh;
  s.heads_per_section = 0;
  s.section_tiles = 0;
  s.counter = nullptr;
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
