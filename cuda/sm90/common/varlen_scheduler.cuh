// The persistent tile scheduler of the variable-length (cu_seqlens) sm90
// forward: the order of jax_flash/varlen_order.h (tiles never straddle two
// sequences, heaviest first), decoded from the offsets by the producer warp
// itself (no pre-pass), claimed dynamically as DynamicPersistentTileScheduler
// does (CTA b starts with tile b, then counter + grid).
//
// The producer warp (all 32 lanes: the decode ballots over the sequences)
// decodes each tile and lane 0 publishes it, coordinates and sequence
// geometry, through a shared-memory slot; the consumer threads read it there
// (they never decode). Hand-off j (j = 0: the CTA's first tile, j = it + 1:
// the tile after the it-th):
//   producer lane 0: wait tile_empty parity (j & 1) ^ 1 (every consumer
//     thread read hand-off j - 1; passes at once for j = 0), write the slot,
//     arrive on tile_full;
//   consumer thread: wait tile_full parity j & 1, read the slot, arrive on
//     tile_empty.
// The producer publishes hand-off it + 1 only after the loads of tile it,
// and a consumer reads it before tile it's epilogue, so the producer is at
// most one hand-off ahead and the parities are exact. The last hand-off is
// a tile with block < 0: every role leaves its loop on it.
//
// Workspace: one int per call (the claim counter), zeroed by prepare() on
// the stream before the kernel, as the dynamic scheduler's.
#pragma once

#include <cuda_runtime.h>

#include "jax_flash/varlen_order.h"
#include "sm90/common/tile_scheduler.cuh"  // ld_shared_s32, persistent_grid
#include "sm90/ptx/common.cuh"
#include "sm90/ptx/mbarrier.cuh"

namespace jax_flash::sm90 {

struct VarlenTileScheduler {
  struct Arguments {
    VarlenOrder order;
    int* counter;  // the call's own device int32
    int num_sms;
  };
  struct Params {
    VarlenOrder order;
    int* counter;
    int grid;  // min(an upper bound of the tiles, SMs)
  };
  static constexpr bool kNeedsWorkspace = true;
  static constexpr int kNumBarriers = 2;  // tile_full, tile_empty
  static constexpr int kSlotInts = 7;     // block, head, batch, offset_q, len_q, offset_k, len_k
  static constexpr int kDataBytes = 32;
  struct Smem {
    uint32_t bars, data;
    JF_DEVICE uint32_t tile_full() const { return bars; }
    JF_DEVICE uint32_t tile_empty() const { return bars + 8; }
    JF_DEVICE uint32_t slot(int i) const { return data + 4 * i; }
  };

  static Params to_params(const Arguments& a) {
    const int64_t bound = VarlenOrder::max_tiles(a.order.batch, a.order.num_seqs, a.order.total_q,
                                                 a.order.num_heads, a.order.block_m);
    const int sms = a.num_sms > 0 ? a.num_sms : 1;
    return Params{a.order, a.counter, bound < sms ? int(bound) : sms};
  }
  static int grid_size(const Params& p, int /*num_sms*/) { return p.grid; }
  static cudaError_t prepare(const Params& p, cudaStream_t stream) {
    if (p.counter == nullptr) return cudaErrorInvalidValue;
    return cudaMemsetAsync(p.counter, 0, sizeof(int), stream);
  }
  template <int kConsumerThreads>
  JF_DEVICE static void init_barriers(const Smem& s) {
    ptx::mbar_init(s.tile_full(), 1);
    ptx::mbar_init(s.tile_empty(), kConsumerThreads);
  }

  // ---------------------------------------------------------------- producer warp
  // Every lane: the cursor at the top of the order.
  JF_DEVICE static VarlenCursor start(const Params& p) { return p.order.start(); }
  // Every lane: the tile of index t (indices increase per CTA).
  JF_DEVICE static VarlenTile decode(const Params& p, VarlenCursor& c, int t) { return p.order.decode(c, t); }
  // Lane 0: the next index to decode (before the current tile's loads: the
  // claim's latency hides behind them); the caller broadcasts it.
  JF_DEVICE static int claim(const Params& p) { return atomicAdd(p.counter, 1) + int(gridDim.x); }
  // Lane 0: hand-off j (see the top of the file).
  JF_DEVICE static void publish(const Smem& s, uint32_t j, const VarlenTile& w) {
    ptx::mbar_wait(s.tile_empty(), (j & 1u) ^ 1u);
    const int v[kSlotInts] = {w.block, w.head, w.batch, w.seq.offset_q, w.seq.len_q, w.seq.offset_k, w.seq.len_k};
#pragma unroll
    for (int i = 0; i < kSlotInts; ++i) ptx::st_shared_b32(s.slot(i), uint32_t(v[i]));
    ptx::mbar_arrive(s.tile_full());  // release: the slot is visible to the waiters
  }

  // ---------------------------------------------------------------- consumers
  JF_DEVICE static VarlenTile read(const Smem& s, uint32_t j) {
    ptx::mbar_wait(s.tile_full(), j & 1u);
    VarlenTile w;
    w.block = ld_shared_s32(s.slot(0));
    w.head = ld_shared_s32(s.slot(1));
    w.batch = ld_shared_s32(s.slot(2));
    w.seq.offset_q = ld_shared_s32(s.slot(3));
    w.seq.len_q = ld_shared_s32(s.slot(4));
    w.seq.offset_k = ld_shared_s32(s.slot(5));
    w.seq.len_k = ld_shared_s32(s.slot(6));
    ptx::mbar_arrive(s.tile_empty());  // every thread, after its own reads
    return w;
  }
};

}  // namespace jax_flash::sm90
