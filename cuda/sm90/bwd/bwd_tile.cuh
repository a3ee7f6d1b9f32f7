// What every role of the sm90 backward knows about its CTA's work: the tile
// (one KV block of one kv head and batch element) and the walk over its steps
// (q head of the GQA group x visible query block), plus the small helpers the
// consumer work splits share (wgmma k-step functors, the P buffer choice, the
// full-barrier wait).
#pragma once

#include "bwd_config.cuh"
#include "bwd_mask.cuh"
#include "jax_flash/varlen_order.h"  // VarlenSeq
#include "sm90/common/tma_desc.h"    // GmemTensor
#include "sm90/ptx/mbarrier.cuh"
#include "sm90/ptx/smem_ops.cuh"

namespace jax_flash::sm90 {

// The CTA's work: KV block (of num_n_blocks per head), kv head, batch, and
// the visible query blocks [m_first, m_last) of every q head of the GQA group
// (iters steps: query block fastest, then q head).
struct BwdTile {
  int n_block, head_k, batch;
  int m_first, m_last, iters;
  int num_n_blocks;
};

template <typename Cfg, bool kPacked = false>
JF_DEVICE BwdTile make_bwd_tile(const BwdKernelArgs& a, const TileCoord& c, int num_n_blocks) {
  BwdTile w;
  w.num_n_blocks = num_n_blocks;
  w.n_block = c.block;
  w.head_k = c.head;
  w.batch = c.batch;
  if constexpr (kPacked) {
    a.mask.q_block_range(w.batch, w.n_block * Cfg::kBlockN, Cfg::kBlockN, Cfg::kBlockM, w.m_first, w.m_last);
  } else {
    a.mask.BlockMath<MaskInfo>::q_block_range(w.n_block * Cfg::kBlockN, Cfg::kBlockN, Cfg::kBlockM, w.m_first,
                                              w.m_last);
  }
  w.iters = (w.m_last - w.m_first) * a.heads_per_kv;
  return w;
}

// The variable-length backward's tile (Cfg::kVarlen): positions (n_block,
// the query blocks, the mask's rows and keys) count from the sequence's
// start; seq places them in the packed tensors; the mask is the call's for
// this sequence alone (its lengths, bottom-right causal / window offset);
// dk / dv (the kernel's parameters) serve the guarded row stores at the
// sequence's end.
struct BwdVarlenTile : BwdTile {
  VarlenSeq seq;
  MaskInfo mask;
  const GmemTensor* dk;
  const GmemTensor* dv;
};

template <typename Cfg>
JF_DEVICE const BwdVarlenTile& bwd_varlen(const BwdTile& w) {
  static_assert(Cfg::kVarlen, "the varlen kernels' tile");
  return static_cast<const BwdVarlenTile&>(w);
}

// The tile of KV block `block` of sequence `seq` (kv head, batch row).
template <typename Cfg>
JF_DEVICE BwdVarlenTile make_bwd_varlen_tile(const BwdKernelArgs& a, int block, int head_k, int batch,
                                             const VarlenSeq& seq) {
  BwdVarlenTile w;
  w.mask = a.mask.for_sequence(seq.len_q, seq.len_k);
  w.seq = seq;
  w.num_n_blocks = (seq.len_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  w.n_block = block;
  w.head_k = head_k;
  w.batch = batch;
  w.mask.BlockMath<MaskInfo>::q_block_range(block * Cfg::kBlockN, Cfg::kBlockN, Cfg::kBlockM, w.m_first, w.m_last);
  w.iters = (w.m_last - w.m_first) * a.heads_per_kv;
  w.dk = w.dv = nullptr;
  return w;
}

// Rows [r0, kRows) of a 128B-swizzled [kColBlocks][kRows][128 B] tile set to
// zero by `threads` threads (tid: this one's index): whole 128-byte rows, so
// the swizzle (within a row) does not matter.
template <int kRows, int kColBlocks>
JF_DEVICE void zero_tile_rows(uint32_t tile, int r0, int tid, int threads) {
  const int per_block = (kRows - r0) * 8;  // 16-byte chunks per column block
  for (int i = tid; i < kColBlocks * per_block; i += threads) {
    const int cb = i / per_block, rest = i - cb * per_block;
    ptx::st_shared_v4_zero(tile + uint32_t(cb * kRows * 128 + (r0 + rest / 8) * 128 + (rest % 8) * 16));
  }
}

// Walks (q head, query block) in step order.
struct BwdStepWalker {
  int hq, mb, m_first, m_last;
  JF_DEVICE BwdStepWalker(const BwdTile& w, int heads_per_kv)
      : hq(w.head_k * heads_per_kv), mb(w.m_first), m_first(w.m_first), m_last(w.m_last) {}
  JF_DEVICE void advance() {
    if (++mb == m_last) {
      mb = m_first;
      ++hq;
    }
  }
};

template <int kRows>
struct KMajorStep {  // k-step kk of a K-major [cols/64][kRows][64] tile
  JF_DEVICE uint32_t operator()(int kk) const { return (kk / 4) * kRows * 128 + (kk % 4) * 32; }
};
struct MNMajorStep {  // k-step kk of an MN-major tile: 16 rows of 128 B
  JF_DEVICE uint32_t operator()(int kk) const { return kk * 16 * 128; }
};

// &a when kInPlace, else &b (b sized kN when used).
template <bool kInPlace, int kN, int kM>
JF_DEVICE float (*select_p(float (*a)[kN], float (*b)[kM]))[kN] {
  if constexpr (kInPlace) {
    return a;
  } else {
    static_assert(kM == kN, "separate P buffer");
    return b;
  }
}

// A consumer thread's wait on a "full" barrier (then the warp converges
// before its wgmma). Its "empty" arrivals are plain ptx::mbar_arrive, by every
// thread after its wgmma wait and its last read of the stage
// (BwdConfig::kEmptyArrivals).
JF_DEVICE void bwd_wait_full(uint32_t bar, uint32_t phase) {
  ptx::mbar_wait(bar, phase);
  __syncwarp();
}

}  // namespace jax_flash::sm90
