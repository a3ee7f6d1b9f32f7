// Persistent tile schedulers of the sm90 kernels, behind one interface.
//
// ============================================================== the contract
// A tile scheduler is a type S with
//
//   host
//     struct S::Arguments        problem shape (+ workspace) as the launcher knows it
//     struct S::Params           what the device needs; lives in the kernel's
//                                __grid_constant__ parameters
//     static S::Params S::to_params(const Arguments&)
//     static int  S::grid_size(const Params&, int num_sms)
//                                CTAs to launch (0: nothing to do)
//     static cudaError_t S::prepare(const Params&, cudaStream_t)
//                                stream-ordered set-up of the workspace before
//                                the kernel (e.g. zero a counter); cudaSuccess
//                                when there is none
//     static constexpr bool S::kNeedsWorkspace
//                                whether Arguments::counter must point to the
//                                call's own device int32
//   shared memory (composed into the kernel's SharedStorage)
//     static constexpr int S::kNumBarriers, S::kDataBytes
//                                8-byte mbarriers and bytes of data it owns
//     struct S::Smem { uint32_t bars, data; }
//                                their shared-window addresses, set by the kernel
//     template <int kConsumerThreads> static void S::init_barriers(const Smem&)
//                                one thread, before the CTA's first __syncthreads;
//                                kConsumerThreads threads call consumer_next
//     static void S::claim_first(const Params&, const Smem&)
//                                one thread, before the CTA's first __syncthreads:
//                                a scheduler that picks the CTA's first tile at
//                                run time stores it in its Smem data
//     static constexpr bool S::kOneTilePerCta
//                                grid_size() CTAs, each with exactly one (valid)
//                                tile: a kernel written for one tile per CTA
//                                (the backward) requires it and runs no loop
//   device: every role walks the same sequence of work tiles
//     static WorkTile S::initial_work(const Params&, const Smem&)
//                                after that __syncthreads
//     static bool     S::valid(const Params&, const WorkTile&)
//     static TileCoord S::coord(const Params&, const WorkTile&)
//     producer (exactly one thread per CTA; it decides the sequence):
//       static WorkTile S::prefetch_next(const Params&, const WorkTile& cur)
//                                at the start of `cur`, before its loads (a
//                                claim's latency hides behind them)
//       static void S::publish_next(const Smem&, uint32_t it, const WorkTile& next)
//                                after the loads of the it-th tile: makes
//                                `next` known to the consumers
//     consumers (every consumer thread, once per tile):
//       static WorkTile S::consumer_next(const Params&, const Smem&, uint32_t it,
//                                        const WorkTile& cur)
//                                after the mainloop of the it-th tile, before
//                                its epilogue: the tile that follows `cur`
//   it counts the tiles the CTA has processed (0, 1, ...); the barrier parities
//   derive from it.
//
// WorkTile is an opaque linear index; TileCoord is what the kernels use:
//   block   the sequence block the CTA owns (forward: query block of kBlockM
//           rows; backward: its KV block)
//   head    the head (forward: query head; backward: KV head)
//   batch   the batch index
//   split   the KV split (always 0 here). A split-KV scheduler enumerates
//           (block, head, batch, split) and the mainloop narrows its KV block
//           range to the split's share; a varlen scheduler makes coord() walk
//           the per-batch offsets (cu_seqlens) so that `block` counts blocks of
//           the batch's own length, and the kernel then builds that batch's
//           sequence lengths from `batch`.
// ==============================================================
//
// Forward tile order (the persistent schedulers; TileOrder below): a tile is
// (block, head, batch).
// - no causal-like mask: head-major, blocks ascending: the CTAs running at the
//   same time share the K/V of one or two heads (L2 reuse).
// - causal (right bound, no left bound): heaviest first (longest KV ranges:
//   the last query blocks), so the tail of the schedule is made of the
//   cheapest tiles. To keep K/V in L2 the heads are taken in sections of
//   `heads_per_section` (about 32 MB of K+V, a power of two times the GQA
//   group, like FA3's L2 swizzle); within a section: block descending, then head.
//
// StaticPersistentTileScheduler: grid = min(#tiles, #SMs); CTA b processes
// tiles b, b + grid, b + 2 grid, ... (no communication between the roles).
//
// DynamicPersistentTileScheduler (FA3's DynamicPersistentTileScheduler, the
// one it uses for causal): same order, but CTA b starts with tile b and then
// takes the next unclaimed tile from a global counter (atomicAdd + grid), so
// the longest tiles go first to whichever SM is free (LPT) instead of a fixed
// round robin. The producer claims the next tile when it starts the current
// one and hands the index to the consumer threads through shared memory
// (mbarriers tile_full / tile_empty: each thread's own arrive orders its
// access, which racecheck can follow). Workspace: one int per call, zeroed
// by prepare() with cudaMemsetAsync on the stream right before the kernel;
// every launch claims exactly `total` indices (grid first tiles, then one per
// claimed tile, plus one failed claim per CTA). No self-reset and no global
// ring: a counter shared by two launches (another stream, a graph replay)
// would hand tiles of one launch to the other, and a reset racing the other
// launch's claims could leave it non-zero for good.
#pragma once

#include <cuda_runtime.h>

#include "sm90/ptx/common.cuh"
#include "sm90/ptx/gmem_sync.cuh"
#include "sm90/ptx/mbarrier.cuh"

namespace jax_flash::sm90 {

struct WorkTile {
  int index;  // linear position in the tile order
};

struct TileCoord {
  int block, head, batch, split;
};

// Shared-memory int load that the compiler neither caches nor moves across
// the barriers around it.
JF_DEVICE int ld_shared_s32(uint32_t addr) {
  int v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// The (block, head, batch) order shared by the persistent schedulers.
struct TileOrder {
  int num_blocks;
  int num_bh;             // batch * num_heads
  int num_heads;
  int total;              // num_blocks * num_bh
  int heads_per_section;  // 0: plain head-major order
  int section_tiles;      // heads_per_section * num_blocks

  struct Arguments {
    int batch, num_heads, heads_per_kv;
    int seqlen;     // rows the blocks cover (forward: seqlen_q)
    int seqlen_kv;  // keys per head (sizes the L2 sections)
    int head_dim;
    int elem_bytes;  // of K and V
    int block;       // rows per block
    bool causal_like;
    // Packed sequences (segment-id tile spans): per batch element its blocks
    // heaviest first [batch, num_blocks] (tile_order.cuh), or nullptr.
    const int* perm = nullptr;
  };

  const int* perm;

  static TileOrder make(const Arguments& a) {
    TileOrder o;
    o.perm = a.perm;
    o.num_blocks = (a.seqlen + a.block - 1) / a.block;
    o.num_bh = a.batch * a.num_heads;
    o.num_heads = a.num_heads;
    o.total = o.num_blocks * o.num_bh;
    o.heads_per_section = 0;
    o.section_tiles = 0;
    if (a.causal_like) {
      const long long kv_head_bytes = 2LL * a.seqlen_kv * a.head_dim * a.elem_bytes;  // K + V of one KV head
      const long long l2_budget = 32LL << 20;
      int sec = 1;
      while (2LL * sec * kv_head_bytes <= l2_budget) sec *= 2;
      sec *= a.heads_per_kv;  // q heads sharing a KV head come together
      if (sec > o.num_bh) sec = o.num_bh;
      o.heads_per_section = sec < 1 ? 1 : sec;
      o.section_tiles = o.heads_per_section * o.num_blocks;
    }
    return o;
  }

  JF_DEVICE TileCoord decode(int t) const {
    TileCoord c;
    int bh;
    int rank;  // the block's place in its head's order
    if (heads_per_section == 0) {
      bh = t / num_blocks;
      rank = t - bh * num_blocks;
      c.block = rank;
    } else {
      const int sec = t / section_tiles;
      const int r = t - sec * section_tiles;
      const int base = sec * heads_per_section;
      const int hs = min(heads_per_section, num_bh - base);  // last section may be short
      rank = r / hs;
      bh = base + (r - rank * hs);
      c.block = num_blocks - 1 - rank;
    }
    c.batch = bh / num_heads;
    c.head = bh - c.batch * num_heads;
    c.split = 0;
    if (perm != nullptr) c.block = perm[int64_t(c.batch) * num_blocks + rank];
    return c;
  }
};

// One CTA per SM, at most one per tile.
inline int persistent_grid(int tiles, int sms) { return tiles < sms ? tiles : sms; }

struct StaticPersistentTileScheduler {
  struct Arguments {
    TileOrder::Arguments order;
    int* counter;  // unused
  };
  struct Params {
    TileOrder order;
  };
  static constexpr bool kNeedsWorkspace = false;
  static constexpr bool kOneTilePerCta = false;
  static constexpr int kNumBarriers = 0;
  static constexpr int kDataBytes = 0;
  struct Smem {
    uint32_t bars, data;
  };

  static Params to_params(const Arguments& a) { return Params{TileOrder::make(a.order)}; }
  static int grid_size(const Params& p, int num_sms) { return persistent_grid(p.order.total, num_sms); }
  static cudaError_t prepare(const Params&, cudaStream_t) { return cudaSuccess; }
  template <int kConsumerThreads>
  JF_DEVICE static void init_barriers(const Smem&) {}

  JF_DEVICE static void claim_first(const Params&, const Smem&) {}
  JF_DEVICE static WorkTile initial_work(const Params&, const Smem&) { return WorkTile{int(blockIdx.x)}; }
  JF_DEVICE static bool valid(const Params& p, const WorkTile& w) { return w.index < p.order.total; }
  JF_DEVICE static TileCoord coord(const Params& p, const WorkTile& w) { return p.order.decode(w.index); }
  JF_DEVICE static WorkTile prefetch_next(const Params&, const WorkTile& cur) {
    return WorkTile{cur.index + int(gridDim.x)};
  }
  JF_DEVICE static void publish_next(const Smem&, uint32_t, const WorkTile&) {}
  JF_DEVICE static WorkTile consumer_next(const Params&, const Smem&, uint32_t, const WorkTile& cur) {
    return WorkTile{cur.index + int(gridDim.x)};
  }
};

struct DynamicPersistentTileScheduler {
  struct Arguments {
    TileOrder::Arguments order;
    int* counter;  // the call's own device int32 (kNeedsWorkspace)
  };
  struct Params {
    TileOrder order;
    int* counter;
  };
  static constexpr bool kNeedsWorkspace = true;
  static constexpr bool kOneTilePerCta = false;
  // tile_full (producer -> consumers: the slot holds the next index) and
  // tile_empty (every consumer thread has read it); the slot itself.
  static constexpr int kNumBarriers = 2;
  static constexpr int kDataBytes = 16;
  struct Smem {
    uint32_t bars, data;
    JF_DEVICE uint32_t tile_full() const { return bars; }
    JF_DEVICE uint32_t tile_empty() const { return bars + 8; }
    JF_DEVICE uint32_t slot() const { return data; }
  };

  static Params to_params(const Arguments& a) { return Params{TileOrder::make(a.order), a.counter}; }
  static int grid_size(const Params& p, int num_sms) { return persistent_grid(p.order.total, num_sms); }
  // Stream-ordered (a memset node under graph capture): every launch, graph
  // replay included, starts from 0 on a counter no other launch touches.
  static cudaError_t prepare(const Params& p, cudaStream_t stream) {
    if (p.counter == nullptr) return cudaErrorInvalidValue;
    return cudaMemsetAsync(p.counter, 0, sizeof(int), stream);
  }
  template <int kConsumerThreads>
  JF_DEVICE static void init_barriers(const Smem& s) {
    ptx::mbar_init(s.tile_full(), 1);
    ptx::mbar_init(s.tile_empty(), kConsumerThreads);
  }

  JF_DEVICE static void claim_first(const Params&, const Smem&) {}
  JF_DEVICE static WorkTile initial_work(const Params&, const Smem&) { return WorkTile{int(blockIdx.x)}; }
  JF_DEVICE static bool valid(const Params& p, const WorkTile& w) { return w.index < p.order.total; }
  JF_DEVICE static TileCoord coord(const Params& p, const WorkTile& w) { return p.order.decode(w.index); }
  // total < 2^30 (blocks of >= 64 rows, fwd_supported), so v + gridDim.x
  // cannot overflow.
  JF_DEVICE static WorkTile prefetch_next(const Params& p, const WorkTile&) {
    return WorkTile{atomicAdd(p.counter, 1) + int(gridDim.x)};
  }
  // Hand-off `it`: the slot is rewritten once every consumer thread has read
  // index it - 1 (tile_empty phase it - 1; the producer cannot run further
  // ahead, so the parity is exact).
  JF_DEVICE static void publish_next(const Smem& s, uint32_t it, const WorkTile& next) {
    ptx::mbar_wait(s.tile_empty(), (it & 1u) ^ 1u);
    ptx::st_shared_b32(s.slot(), uint32_t(next.index));
    ptx::mbar_arrive(s.tile_full());  // release: the store above is visible to the waiters
  }
  JF_DEVICE static WorkTile consumer_next(const Params&, const Smem& s, uint32_t it, const WorkTile&) {
    ptx::mbar_wait(s.tile_full(), it & 1u);
    const int next = ld_shared_s32(s.slot());
    ptx::mbar_arrive(s.tile_empty());  // every thread, after its own read
    return WorkTile{next};
  }
};

// ------------------------------------------------------------ backward
// The backward's (KV block, KV head, batch) order. A CTA keeps the dK / dV of
// its KV block in registers for the whole sweep over the query blocks, so
// there is one tile per CTA (the single-tile schedulers below).
// - no causal-like mask: head-major, KV blocks ascending (the CTAs running
//   together share the Q / dO of one or two heads in L2).
// - causal (right bound, no left bound): KV block 0 sees the most query
//   blocks, so KV blocks ascending across all heads of a section (heaviest
//   first), with the heads taken in sections whose Q + dO fit in ~32 MB of L2.
// kDescending (deterministic mode): the same orders with the KV blocks
// descending (FA3's SPT order for causal), the order in which the KV blocks
// add into each dQ tile (bwd_dq.cuh, BwdDqAccumulator::store): the KV block a CTA
// waits for always has a smaller tile index.
struct BwdTileOrderArguments {
  int batch, num_heads, heads_per_kv;  // num_heads: KV heads
  int seqlen;    // keys the blocks cover (seqlen_k)
  int seqlen_q;  // query rows each tile streams (sizes the L2 sections)
  int head_dim;
  int elem_bytes;  // of Q and dO
  int block;       // keys per block
  bool causal_like;
};

template <bool kDescending>
struct BwdTileOrder {
  int num_blocks;         // KV blocks per head
  int num_bh;             // batch * num_heads (KV heads)
  int num_heads;
  int total;              // num_blocks * num_bh
  int heads_per_section;  // 0: plain head-major order
  int section_tiles;      // heads_per_section * num_blocks

  using Arguments = BwdTileOrderArguments;

  static BwdTileOrder make(const Arguments& a) {
    BwdTileOrder o;
    o.num_blocks = (a.seqlen + a.block - 1) / a.block;
    o.num_bh = a.batch * a.num_heads;
    o.num_heads = a.num_heads;
    o.total = o.num_blocks * o.num_bh;
    o.heads_per_section = 0;
    o.section_tiles = 0;
    if (a.causal_like && o.total > 0) {
      // What the CTAs of one KV head share in L2: Q and dO of all its q heads
      // and their fp32 dq_accum rows (which the dQ reductions hit as often as
      // Q is read). A section of heads then fits 20 MB; counting Q + dO alone
      // against 32 MB gave sections of 128 heads at T = 512 (132 CTAs in
      // flight on block 0 of 128 heads, nothing shared) and measured 14%
      // slower at T = 512, 6% at 1k (H200, benchmarks/NOTES.md).
      const long long kv_head_bytes =
          (2LL * a.elem_bytes + 4) * a.seqlen_q * a.head_dim * a.heads_per_kv;
      const long long l2_budget = 20LL << 20;
      int sec = 1;
      while (2LL * sec * kv_head_bytes <= l2_budget && sec < o.num_bh) sec *= 2;
      if (sec > o.num_bh) sec = o.num_bh;
      o.heads_per_section = sec < 1 ? 1 : sec;
      o.section_tiles = o.heads_per_section * o.num_blocks;
    }
    return o;
  }

  JF_DEVICE TileCoord decode(int t) const {
    TileCoord c;
    int bh;
    if (heads_per_section == 0) {
      bh = t / num_blocks;
      c.block = t - bh * num_blocks;
    } else {
      const int sec = t / section_tiles;
      const int r = t - sec * section_tiles;
      const int base = sec * heads_per_section;
      const int hs = min(heads_per_section, num_bh - base);  // last section may be short
      c.block = r / hs;
      bh = base + (r - c.block * hs);
    }
    if constexpr (kDescending) c.block = num_blocks - 1 - c.block;
    c.batch = bh / num_heads;
    c.head = bh - c.batch * num_heads;
    c.split = 0;
    return c;
  }
};

// One CTA per tile (FA3's SingleTileScheduler): grid = #tiles, CTA b
// processes tile b and nothing else.
template <typename Order>
struct SingleTileScheduler {
  struct Arguments {
    typename Order::Arguments order;
    int* counter;  // unused
  };
  struct Params {
    Order order;
  };
  static constexpr bool kNeedsWorkspace = false;
  static constexpr bool kOneTilePerCta = true;
  static constexpr int kNumBarriers = 0;
  static constexpr int kDataBytes = 0;
  struct Smem {
    uint32_t bars, data;
  };

  static Params to_params(const Arguments& a) { return Params{Order::make(a.order)}; }
  static int grid_size(const Params& p, int /*num_sms*/) { return p.order.total; }
  static cudaError_t prepare(const Params&, cudaStream_t) { return cudaSuccess; }
  template <int kConsumerThreads>
  JF_DEVICE static void init_barriers(const Smem&) {}
  JF_DEVICE static void claim_first(const Params&, const Smem&) {}

  JF_DEVICE static WorkTile initial_work(const Params&, const Smem&) { return WorkTile{int(blockIdx.x)}; }
  JF_DEVICE static bool valid(const Params& p, const WorkTile& w) { return w.index < p.order.total; }
  JF_DEVICE static TileCoord coord(const Params& p, const WorkTile& w) { return p.order.decode(w.index); }
  JF_DEVICE static WorkTile prefetch_next(const Params& p, const WorkTile&) { return WorkTile{p.order.total}; }
  JF_DEVICE static void publish_next(const Smem&, uint32_t, const WorkTile&) {}
  JF_DEVICE static WorkTile consumer_next(const Params& p, const Smem&, uint32_t, const WorkTile&) {
    return WorkTile{p.order.total};
  }
};

// One CTA per tile, the tiles taken in the order in which the CTAs start:
// one thread claims the CTA's tile index from a global counter (atomicAdd)
// and hands it to the others through shared memory. A CTA that waits for a
// tile of smaller index (the deterministic backward's dQ order) then always
// waits for a running or finished CTA, whatever order the hardware launches
// the blocks in. Workspace: one int per call, zeroed by prepare() on the
// stream right before the kernel; the grid claims exactly indices [0, total).
template <typename Order>
struct ClaimedSingleTileScheduler {
  struct Arguments {
    typename Order::Arguments order;
    int* counter;  // the call's own device int32 (kNeedsWorkspace)
  };
  struct Params {
    Order order;
    int* counter;
  };
  static constexpr bool kNeedsWorkspace = true;
  static constexpr bool kOneTilePerCta = true;
  static constexpr int kNumBarriers = 0;
  static constexpr int kDataBytes = 4;  // the claimed index
  struct Smem {
    uint32_t bars, data;
  };

  static Params to_params(const Arguments& a) { return Params{Order::make(a.order), a.counter}; }
  static int grid_size(const Params& p, int /*num_sms*/) { return p.order.total; }
  static cudaError_t prepare(const Params& p, cudaStream_t stream) {
    if (p.counter == nullptr) return cudaErrorInvalidValue;
    return cudaMemsetAsync(p.counter, 0, sizeof(int), stream);
  }
  template <int kConsumerThreads>
  JF_DEVICE static void init_barriers(const Smem&) {}
  // The __syncthreads after it orders the store before every thread's load.
  JF_DEVICE static void claim_first(const Params& p, const Smem& s) {
    ptx::st_shared_b32(s.data, uint32_t(atomicAdd(p.counter, 1)));
  }

  JF_DEVICE static WorkTile initial_work(const Params&, const Smem& s) {
    return WorkTile{int(ptx::ld_shared_b32(s.data))};
  }
  JF_DEVICE static bool valid(const Params& p, const WorkTile& w) { return w.index < p.order.total; }
  JF_DEVICE static TileCoord coord(const Params& p, const WorkTile& w) { return p.order.decode(w.index); }
  JF_DEVICE static WorkTile prefetch_next(const Params& p, const WorkTile&) { return WorkTile{p.order.total}; }
  JF_DEVICE static void publish_next(const Smem&, uint32_t, const WorkTile&) {}
  JF_DEVICE static WorkTile consumer_next(const Params& p, const Smem&, uint32_t, const WorkTile&) {
    return WorkTile{p.order.total};
  }
};

}  // namespace jax_flash::sm90
