// The mainloop of the sm90 forward: both sides of the warp-specialised pipeline
// over one tile's KV blocks, for one element type, head-dim bucket (or
// head-dim pair: V and O kHeadDimV wide, Q and K kHeadDim) and tuning
// (FwdTuning, fwd_tuning.h).
//
// Producer (one thread of the producer warpgroup): per tile, K of the first
// (highest) KV block, then Q (once the consumers released the previous Q),
// then K[n-1] and V[n] for each block n going down (the order in which the
// overlapped consumer uses them; 8-bit: V[n] first, which the transposers
// need before the consumers do). Every load is a set of TMA boxes (one per
// 128-byte column block of the head dim) completing on the slot's "full"
// mbarrier; the slot is refilled only after its "empty" mbarrier saw every
// consumer warp.
//
// Consumers (each warpgroup: 64 query rows, all KV blocks of the tile):
//   S = Q K^T   wgmma SS, K-major A and B, D / kMmaK k-steps, N = kBlockN
//               (q_in_regs: wgmma RS, Q's A fragments loaded from shared
//               memory into registers once per tile, see load_q)
//   O += P V    wgmma RS, P converted in registers from S, V MN-major (tnspB),
//               kBlockN / kMmaK k-steps, N = kHeadDimV
// 8-bit elements (ElementTraits::kTransposeV, the FP8 forward): the same
// pipeline with wgmma k = 32. V arrives in its natural layout like K; the
// producer warpgroup's other warps (kTransposeWarps) rewrite each V stage as
// a V^T stage (ceil(kBlockN / 128) atoms of [head dim][128 keys], keys
// permuted within groups of 32 to match acc_to_a's P fragment;
// v_transpose.h), which feeds the PV GEMM K-major:
//   TMA -> full_v -> transposer -> empty_v (V stage free) and full_vt -> consumers
//   consumers -> empty_vt -> transposer (V^T stage free)
// The transposers walk the V stages in load order and stop at a stage the
// producer completes without data after its last load (finish_loads), which
// it marks in that slot's end word first. Q and K carry per-block descales
// (Q per warpgroup's 64 rows, K per KV block) folded into each block's softmax
// scale, V per-channel descales are applied by the epilogue; O is written in
// OutElement.
// Two schedules (FwdTuning::overlap):
//  serial:   wait K[n]; S = QK^T; wait; softmax; wait V[n]; O += PV; wait
//  overlap (FA3 "intra-warpgroup overlap"): the QK^T of block n is issued
//            together with the PV of block n+1; the softmax of block n runs
//            while the PV is still in flight:
//              issue S = Q K[n]^T; issue O += P[n+1] V[n+1]
//              wait(1) -> S ready; softmax(S) -> new max, P (fp32)
//              wait(0) -> PV done; rescale O; P[n] = pack(S)
// pingpong: the GEMM issue of each step is bracketed by named barriers so
// that the consumer warpgroups take turns on the tensor cores (one WG's GEMMs
// run while the other does its softmax): sync(kBarSched + wg) before,
// arrive(kBarSched + next wg) after. Turn sequence per WG and tile (both WGs
// see the same number of KV blocks nb, so the turns alternate strictly):
//   serial:  [QK0] [PV0 QK1] ... [PV(nb-1)]  -> nb + 1 turns
//   overlap: QK0 outside, [QK1 PV0] ... [QK(nb-1) PV(nb-2)], PV(nb-1) outside
//            -> nb - 1 turns
// The first consumer WG gives itself the initial turn (Consumer::start).
// Dropout (FwdTuning::dropout): the Philox output of a block (one call per
// 64-key chunk and row, philox.h) is drawn right after its QK^T (and the
// previous PV) are issued, so the integer work runs under the GEMMs (where
// registers allow, kDrawEarly; else just before use); after the block's
// softmax (whose row sums stay undropped: the LSE is the
// undropped one) the dropped elements of P are zeroed before acc_to_a, and
// the epilogue scales O by 1 / (1 - rate).
// With FwdTuning::dropout_producer_mask the consumers run no generator:
// warps 1..3 of the producer warpgroup (kMaskWarps, idle otherwise in the
// 16-bit kernels) draw each block's keep mask into a ring of bit masks in
// shared memory (drop_mask.h; kMaskStages slots, full_mask / empty_mask
// mbarriers: full by every mask thread, empty by every consumer thread), in
// the consumers' block order; the consumers read their words under the
// block's GEMMs and zero the dropped elements of the packed P (drop_p).
// Softmax: OnlineSoftmax::update_lazy; O is rescaled only when some row of the
// warp raised its max (a warp-uniform branch around rescale_rows), see
// softmax.cuh; lazy_rescale = false rescales after every block (update).
#pragma once

#include <type_traits>

#include "fwd_named_barriers.h"
#include "drop_mask.h"
#include "fwd_tuning.h"
#include "jax_flash/philox.h"
#include "sm90/common/mask.cuh"
#include "sm90/ptx/barrier.cuh"
#include "sm90/ptx/element_traits.cuh"
#include "sm90/ptx/mbarrier.cuh"
#include "sm90/ptx/smem_ops.cuh"
#include "sm90/ptx/tma.cuh"
#include "sm90/ptx/wgmma.cuh"
#include "sm90/common/softmax.cuh"
#include "sm90/common/tile_scheduler.cuh"
#include "sm90/common/tma_desc.h"
#include "jax_flash/varlen_order.h"
#include "softcap.cuh"
#include "v_transpose.cuh"

namespace jax_flash::sm90 {

template <typename Element_, int kHeadDim_, typename TuningT, typename OutElement_ = Element_,
          int kHeadDimV_ = kHeadDim_>
struct FwdMainloop {
  static constexpr bool kPacked = TuningT::value.packed;  // fwd_tuning.h
  // Variable-length sequences (fwd_varlen_kernel.cuh): the tile's sequence
  // (VarlenSeq) gives the loads' row offsets and, through
  // MaskInfo::for_sequence, the lengths of every block range and mask.
  static constexpr bool kVarlen = TuningT::value.varlen;
  using Element = Element_;
  using OutElement = OutElement_;  // of O (the epilogue)
  using Traits = ElementTraits<Element>;
  using Softmax = OnlineSoftmaxT<Traits::kPOffsetLog2, Traits::kLazyThresholdLog2, Traits::kBlockScales,
                                 TuningT::value.exp2_poly_every, TuningT::value.exp2_poly_degree>;
  // 8-bit inputs (see the top of the file): per-block descales, V transposed
  // in shared memory by warps 1..kTransposeWarps of the producer warpgroup.
  static constexpr bool kBlockScaled = Traits::kBlockScales;
  static constexpr bool kVTransposed = Traits::kTransposeV;
  static constexpr int kTransposeWarps = kVTransposed ? 3 : 0;
  static constexpr FwdTuning kTuning = TuningT::value;
  static constexpr int kHeadDim = kHeadDim_;    // of Q and K
  static constexpr int kHeadDimV = kHeadDimV_;  // of V and O
  static constexpr int kBlockN = kTuning.block_n;
  static constexpr int kConsumerWGs = kTuning.consumer_wgs;
  static constexpr int kStages = kTuning.stages;
  // ldmatrix results of a transposer warp live at once (VTranspose): 3, but 2
  // above 16 steps per warp (head dim 256: 21-22, 128 x 224 keys: 18-19)
  // under the producer warpgroup's 24 registers (two consumer warpgroups,
  // fwd_kernel.cuh), where ptxas 13.0 spills the stage loop's phase at 3.
  static constexpr int kTransposeDepth =
      kConsumerWGs == 2 && (kHeadDimV / 16) * (kBlockN / 32) > 16 * kTransposeWarps ? 2 : 3;
  static constexpr int kBlockM = kTuning.block_m();
  static constexpr bool kPingpong = kTuning.pingpong;
  static constexpr bool kOverlap = kTuning.overlap;
  static constexpr bool kQInRegs = kTuning.q_in_regs;
  static constexpr bool kLazy = kTuning.lazy_rescale;
  static constexpr bool kOInV = kTuning.o_in_v;
  static constexpr bool kDropout = kTuning.dropout;
  // A kernel for softcap calls only, with a fixed max (softcap.cuh); the
  // production kernels serve softcap by a run-time branch (kRuntime).
  static constexpr FwdSoftcap kSoftcapForm = kTuning.softcap;
  static constexpr bool kSoftcapFixed = kSoftcapForm != FwdSoftcap::kRuntime;
  static_assert(!kSoftcapFixed || std::is_same_v<Element, __nv_bfloat16>,
                "the fixed max needs P in bf16's range (softcap.cuh)");
  using SoftcapConsts = std::conditional_t<kSoftcapFixed, SoftcapFixedMax<kSoftcapForm>, SoftcapRuntime>;
  // Dropout with the keep mask drawn by the producer warpgroup's warps
  // 1..kMaskWarps into shared memory (see the top of the file).
  static constexpr bool kDropMask = kDropout && kTuning.dropout_producer_mask;
  static constexpr int kMaskWarps = kDropMask ? 3 : 0;
  static constexpr int kMaskThreads = 32 * kMaskWarps;
  static constexpr int kMaskStages = 2;
  using MaskLayout = DropMaskLayout<kBlockM, kBlockN>;
  static constexpr int kMaskChunks = MaskLayout::kChunks;
  // Dropout's Philox output drawn under the block's GEMMs (live across the
  // wait: 2 kBlockN / 16 registers) where the registers allow it (two
  // consumer warpgroups, O of at most 128 columns: 64 registers); else right
  // before it is applied.
  static constexpr bool kDrawEarly = kDropout && !kTuning.dropout_producer_mask && kConsumerWGs == 2 &&
                                     kHeadDimV <= 128;
  // FA3 rescales O before the PV GEMM (off the critical path) for hdim > 128
  // (its kHeadDim, the query/key one), not in its FP8 path.
  static constexpr bool kRescaleBeforePV = kHeadDim > 128 && !kVTransposed;
  // O not zero-filled before the tile: its first PV GEMM ignores the
  // accumulator (wgmma scale-d = 0, as CUTLASS's ScaleOut::Zero), so O's
  // registers are free until then (the tile's first QK^T and softmax); a
  // tile without keys zeroes O itself. Where it lowers ptxas 13.0's spills:
  // the 8-bit 128 x 224 tile (100 -> 44 bytes; at 192 x 160 and 128 x 128 it
  // raises them: 52 -> 84, 40 -> 276). Elsewhere the caller zero-fills O
  // (kZeroFillO).
  static constexpr bool kFirstPVZeroes = kVTransposed && kConsumerWGs == 2 && kBlockN > 128;
  static constexpr bool kZeroFillO = !kFirstPVZeroes;

  // Shared-memory geometry (smem_layout.cuh) of Q, K and V: column blocks of
  // one swizzle row (128 bytes; 64 for the 64-byte rows of an 8-bit head dim
  // of 64, with the 64B swizzle), k-steps of kMmaK elements.
  static constexpr int kRowBytes = kHeadDim * Traits::kBytes < 128 ? kHeadDim * Traits::kBytes : 128;
  static constexpr int kRowElems = kRowBytes / Traits::kBytes;
  static constexpr int kColBlocks = kHeadDim / kRowElems;    // TMA boxes per Q / K tile
  static constexpr int kColBlocksV = kHeadDimV / kRowElems;  // per V tile
  static constexpr int kStepBytes = Traits::kMmaK * Traits::kBytes;
  static constexpr int kStepsPerRow = kRowBytes / kStepBytes;
  static constexpr uint64_t kDescQK = ptx::desc_k_major<kRowBytes>();
  static constexpr int kQSteps = kHeadDim / Traits::kMmaK;  // k-steps of S = Q K^T
  static constexpr int kPSteps = kBlockN / Traits::kMmaK;   // k-steps of O += P V
  static constexpr int kSR = kBlockN / 2;                   // S registers per thread
  static constexpr int kOR = kHeadDimV / 2;                 // O registers per thread

  static_assert(kHeadDim % kRowElems == 0 && (kRowBytes == 128 || (kRowBytes == 64 && kVTransposed)),
                "head dim bucket: whole 128-byte swizzle rows (8-bit: or one 64-byte row)");
  static_assert(kHeadDimV % kRowElems == 0 && kHeadDimV <= 256,
                "value head dim: whole swizzle rows of Q's width, <= 256 (wgmma N of O += P V)");
  static_assert(kHeadDimV == kHeadDim || !kVTransposed,
                "8-bit: one head dim (the swizzle rows of V and V^T follow kRowBytes)");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "kBlockN: multiple of 16, <= 256 (TMA box, wgmma N)");
  static_assert(kBlockM <= 256, "TMA box rows <= 256");
  static_assert(!kVTransposed || kBlockN % Traits::kMmaK == 0,
                "8-bit: whole k-steps of keys in the PV GEMM (the V^T atoms' 32-key groups)");
  static_assert(!kBlockScaled || !kQInRegs, "q_in_regs reads 16-bit A fragments (load_a_sw128)");
  static_assert(!kDropout || (kBlockN % 64 == 0 && !kBlockScaled),
                "dropout: whole 64-key chunks per KV block (one Philox call per chunk and row), 16-bit");
  static_assert(!kDropMask || (!kVTransposed && (kMaskChunks == 1 || kMaskChunks == 2)),
                "producer mask: 16-bit (warps 1..3 transpose V in the 8-bit kernels), one or two chunks "
                "per block (one load per thread)");
  static_assert(!kBlockScaled || kBlockM % kFp8QBlock == 0, "one Q descale per warpgroup (fp8_scheme.h)");
  static_assert(!kBlockScaled || kBlockN == fp8_k_block(kHeadDim),
                "one K descale per KV block: the tile is the scheme's K block (fp8_scheme.h)");
  // ptxas 13.0 miscompiles Q in registers in the serial schedule: it hands the
  // loop-invariant Q fragments' registers to P inside the loop (the PTX is
  // right; the results were wrong on the H200). The overlap schedule compiles
  // correctly; tools/lint/check_wgmma_a_regs.py checks the SASS of every build.
  static_assert(!kQInRegs || kOverlap, "q_in_regs needs overlap (ptxas, see above)");
  static_assert(!kVarlen || (!kPacked && !kDropout && !kVTransposed && kOverlap),
                "varlen: 16-bit, no segment ids, no dropout, the overlap schedule (zero_v_tail's place)");

  // ---------------------------------------------------------------- storage
  // Tiles: Q, the K ring, the V ring, 8-bit: the V^T ring (whole 128-key
  // atoms per stage, VTransposeLayout; each 1 KB aligned); barriers: full_q,
  // empty_q, full_k[S], empty_k[S], full_v[S], empty_v[S], 8-bit:
  // full_vt[S], empty_vt[S] and an end word per V slot (finish_loads).
  static constexpr int kQBytes = kBlockM * kHeadDim * Traits::kBytes;
  static constexpr int kKBytes = kBlockN * kHeadDim * Traits::kBytes;   // one stage of K
  static constexpr int kVBytes = kBlockN * kHeadDimV * Traits::kBytes;  // one stage of V
  static constexpr int kVtBytes = vt_stage_bytes(kHeadDimV, kBlockN);   // 8-bit: one stage of V^T
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKBytes;
  static constexpr int kOffVt = kOffV + kStages * kVBytes;
  static constexpr int kOffMask = kOffVt + (kVTransposed ? kStages * kVtBytes : 0);
  // kDropMask: the bit-mask ring, rounded up to keep what follows 1 KB aligned.
  static constexpr int kMaskRingBytes = kDropMask ? (kMaskStages * MaskLayout::kBytes + 1023) / 1024 * 1024 : 0;
  static constexpr int kTileBytes = kOffMask + kMaskRingBytes;
  static constexpr int kMaskBar = 2 + 4 * kStages + (kVTransposed ? 3 * kStages : 0);
  static constexpr int kNumBarriers = kMaskBar + (kDropMask ? 2 * kMaskStages : 0);
  static_assert(kOffK % 1024 == 0 && kOffV % 1024 == 0 && kKBytes % 1024 == 0 && kVBytes % 1024 == 0 &&
                    kQBytes % 1024 == 0 && (!kVTransposed || kVtBytes % 1024 == 0),
                "128B-swizzled tiles must start 1 KB aligned");
  static constexpr int kKVEmptyArrivals = 4 * kConsumerWGs;  // every consumer warp

  // Shared-window addresses, set by the kernel's SharedStorage.
  struct Smem {
    uint32_t tiles;   // 1 KB aligned
    uint32_t bars;    // kNumBarriers mbarriers
    uint32_t o_free;  // kOInV: the epilogue's "O store has read the V ring" barrier
    JF_DEVICE uint32_t q() const { return tiles + kOffQ; }
    JF_DEVICE uint32_t k(int s) const { return tiles + kOffK + s * kKBytes; }
    JF_DEVICE uint32_t v(int s) const { return tiles + kOffV + s * kVBytes; }
    JF_DEVICE uint32_t vt(int s) const { return tiles + kOffVt + s * kVtBytes; }
    JF_DEVICE uint32_t mask(int s) const { return tiles + kOffMask + s * MaskLayout::kBytes; }
    JF_DEVICE uint32_t bar(int i) const { return bars + 8 * i; }
    JF_DEVICE uint32_t full_q() const { return bar(0); }
    JF_DEVICE uint32_t empty_q() const { return bar(1); }
    JF_DEVICE uint32_t full_k(int s) const { return bar(2 + s); }
    JF_DEVICE uint32_t empty_k(int s) const { return bar(2 + kStages + s); }
    JF_DEVICE uint32_t full_v(int s) const { return bar(2 + 2 * kStages + s); }
    JF_DEVICE uint32_t empty_v(int s) const { return bar(2 + 3 * kStages + s); }
    JF_DEVICE uint32_t full_vt(int s) const { return bar(2 + 4 * kStages + s); }
    JF_DEVICE uint32_t empty_vt(int s) const { return bar(2 + 5 * kStages + s); }
    // A word per V slot, not a barrier: 1 once the slot holds the end (finish_loads).
    JF_DEVICE uint32_t v_end(int s) const { return bar(2 + 6 * kStages + s); }
    // kDropMask: the bit-mask ring's barriers.
    JF_DEVICE uint32_t full_mask(int s) const { return bar(kMaskBar + s); }
    JF_DEVICE uint32_t empty_mask(int s) const { return bar(kMaskBar + kMaskStages + s); }
    // The V operand of the PV GEMM and its barriers: the V ring, or 8-bit the V^T ring.
    JF_DEVICE uint32_t pv(int s) const { return kVTransposed ? vt(s) : v(s); }
    JF_DEVICE uint32_t full_pv(int s) const { return kVTransposed ? full_vt(s) : full_v(s); }
    JF_DEVICE uint32_t empty_pv(int s) const { return kVTransposed ? empty_vt(s) : empty_v(s); }
  };

  // kQEmptyArrivals: who releases Q (each consumer warp, or the epilogue's
  // storing threads when O is staged in Q's buffer; the kernel decides).
  template <int kQEmptyArrivals>
  JF_DEVICE static void init_barriers(const Smem& sm) {
    ptx::mbar_init(sm.full_q(), 1);
    ptx::mbar_init(sm.empty_q(), kQEmptyArrivals);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(sm.full_k(s), 1);
      ptx::mbar_init(sm.empty_k(s), kKVEmptyArrivals);
      ptx::mbar_init(sm.full_v(s), 1);
      ptx::mbar_init(sm.empty_v(s), kVTransposed ? kTransposeWarps : kKVEmptyArrivals);
      if constexpr (kVTransposed) {
        ptx::mbar_init(sm.full_vt(s), kTransposeWarps);
        ptx::mbar_init(sm.empty_vt(s), kKVEmptyArrivals);
      }
    }
    if constexpr (kVTransposed) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) ptx::st_shared_b32(sm.v_end(s), 0u);
    }
    if constexpr (kDropMask) {
#pragma unroll
      for (int s = 0; s < kMaskStages; ++s) {
        ptx::mbar_init(sm.full_mask(s), kMaskThreads);
        ptx::mbar_init(sm.empty_mask(s), 128 * kConsumerWGs);
      }
    }
  }

  // ---------------------------------------------------------------- host -> device
  // Per-block descales of the 8-bit inputs (scheme.py; unused for 16-bit).
  struct Descales {
    const float* q = nullptr;  // [batch, heads, q_blocks]: per 64 query rows
    const float* k = nullptr;  // [batch, heads_k, k_blocks]: per kBlockN keys
    int q_blocks = 0, k_blocks = 0;
  };
  struct Arguments {
    GmemTensor q, k;
    GmemTensor v;      // [batch, seq, heads_k, head_dim_v], k's batch, seq and heads
    MaskInfo mask;     // make_mask_info (mask.cuh)
    SoftmaxScale sm;   // make_softmax_scale (softmax.cuh)
    int heads_per_kv;
    Descales descale;
    DropoutArgs dropout = {};
  };
  struct Params {
    CUtensorMap tm_q;  // box {kRowElems, kBlockM, 1, 1} (one swizzle row of kRowBytes)
    CUtensorMap tm_k;  // box {kRowElems, kBlockN, 1, 1}
    CUtensorMap tm_v;  // box {kRowElems, kBlockN, 1, 1} (kColBlocksV of them per stage)
    MaskInfo mask;
    SoftmaxScale sm;
    int heads_per_kv;  // num_heads / num_heads_k
    int num_heads;
    Descales descale;
    DropoutArgs dropout;
  };
  // False when a tensor map cannot be encoded (the call is then unsupported).
  static bool to_params(const Arguments& a, Params& p) {
    constexpr TmaElement e = tma_element<Element>();
    if (!encode_bshd(&p.tm_q, e, a.q, kBlockM, kRowBytes) ||
        !encode_bshd(&p.tm_k, e, a.k, kBlockN, kRowBytes) ||
        !encode_bshd(&p.tm_v, e, a.v, kBlockN, kRowBytes))
      return false;
    p.mask = a.mask;
    p.sm = a.sm;
    p.heads_per_kv = a.heads_per_kv;
    p.num_heads = a.q.heads;
    p.descale = a.descale;
    p.dropout = a.dropout;
    return true;
  }
  JF_DEVICE static void prefetch_descriptors(const Params& p) {
    ptx::prefetch_tmap(&p.tm_q);
    ptx::prefetch_tmap(&p.tm_k);
    ptx::prefetch_tmap(&p.tm_v);
  }

  // [first, last) KV blocks the tile starting at query row m0 visits.
  JF_DEVICE static void kv_block_range(const Params& p, int batch, int m0, int& n_first, int& n_last) {
    if constexpr (kPacked) {
      p.mask.kv_block_range(batch, m0, kBlockM, kBlockN, n_first, n_last);
    } else {
      p.mask.BlockMath<MaskInfo>::kv_block_range(m0, kBlockM, kBlockN, n_first, n_last);
    }
  }

  // ---------------------------------------------------------------- producer
  // The loads of the it-th tile of this CTA (one thread: lane 0 of warp 0).
  // kVarlen: seq is the tile's sequence; the blocks count from its start
  // and the TMA rows are offset by its first row and key.
  JF_DEVICE static void load(const Params& a, const Smem& sm, ptx::PipeState<kStages>& kst,
                             ptx::PipeState<kStages>& vst, const TileCoord& c, uint32_t it,
                             const VarlenSeq* seq = nullptr) {
    using namespace ptx;
    const int batch = c.batch, head = c.head;
    const int m0 = c.block * kBlockM;
    int n_first, n_last;
    if constexpr (kVarlen) {
      a.mask.for_sequence(seq->len_q, seq->len_k)
          .BlockMath<MaskInfo>::kv_block_range(m0, kBlockM, kBlockN, n_first, n_last);
    } else {
      kv_block_range(a, batch, m0, n_first, n_last);
    }
    const int q_row0 = kVarlen ? seq->offset_q : 0, k_row0 = kVarlen ? seq->offset_k : 0;
    const int head_k = head / a.heads_per_kv;

    auto load_k = [&](int n) {
      mbar_wait(sm.empty_k(kst.index), kst.phase ^ 1u);
      const uint32_t full = sm.full_k(kst.index), dst = sm.k(kst.index);
      mbar_arrive_expect_tx(full, kKBytes);
#pragma unroll
      for (int cb = 0; cb < kColBlocks; ++cb)
        tma_load_4d(&a.tm_k, full, dst + cb * kBlockN * kRowBytes, cb * kRowElems, k_row0 + n * kBlockN,
                    head_k, batch);
      kst.advance();
    };
    auto load_v = [&](int n) {
      mbar_wait(sm.empty_v(vst.index), vst.phase ^ 1u);
      const uint32_t full = sm.full_v(vst.index), dst = sm.v(vst.index);
      mbar_arrive_expect_tx(full, kVBytes);
#pragma unroll
      for (int cb = 0; cb < kColBlocksV; ++cb)
        tma_load_4d(&a.tm_v, full, dst + cb * kBlockN * kRowBytes, cb * kRowElems, k_row0 + n * kBlockN, head_k,
                    batch);
      vst.advance();
    };

    const bool has_keys = n_last > n_first;
    // kOInV: the previous tile's O store must have read the V ring before
    // this tile's first V load. o_free completes once per tile (epilogue
    // it - 1 -> phase it - 1); the producer waits for every phase, in
    // order, at a point where epilogue `it` cannot have completed yet
    // (before this tile's first V load, or before its Q load when it has
    // no keys), so the parity test is exact.
    auto wait_o_free = [&] {
      if constexpr (kOInV) {
        if (it > 0) mbar_wait(sm.o_free, (it - 1) & 1u);
      }
    };
    if (has_keys) load_k(n_last - 1);
    if (!has_keys) wait_o_free();
    // Q: always loaded (also for a tile without visible keys) so that the
    // consumers' full_q / empty_q phases advance once per tile.
    mbar_wait(sm.empty_q(), (it & 1u) ^ 1u);
    mbar_arrive_expect_tx(sm.full_q(), kQBytes);
#pragma unroll
    for (int cb = 0; cb < kColBlocks; ++cb)
      tma_load_4d(&a.tm_q, sm.full_q(), sm.q() + cb * kBlockM * kRowBytes, cb * kRowElems, q_row0 + m0, head,
                  batch);
    if (has_keys) wait_o_free();
    for (int n = n_last - 1; n >= n_first; --n) {
      if constexpr (kVTransposed) {  // V first (FA3's FP8 order): the transposers work on it
        load_v(n);                   // while K[n-1] loads
        if (n > n_first) load_k(n - 1);
      } else {
        if (n > n_first) load_k(n - 1);
        load_v(n);
      }
    }
  }

  // 8-bit, after the last tile: completes the next V stage without data, its
  // end word set first, so that the transposers, which wait for every stage
  // in order, find the end there (transpose_loop). The word is written only
  // once the slot's last transpose has been released (empty_v), so no
  // transposer reads it meanwhile, and only once: the kernel ends after it.
  JF_DEVICE static void finish_loads(const Smem& sm, ptx::PipeState<kStages>& vst) {
    if constexpr (kVTransposed) {
      ptx::mbar_wait(sm.empty_v(vst.index), vst.phase ^ 1u);
      ptx::st_shared_b32(sm.v_end(vst.index), 1u);
      ptx::mbar_arrive(sm.full_v(vst.index));  // release: the end word is visible to the waiters
    }
  }

  // ---------------------------------------------------------------- V transposer
  // 8-bit: warp w (0..kTransposeWarps-1) of the transposer warps, for the
  // whole kernel: each V stage the producer loaded, in order, into the V^T
  // stage of the same sequence number (both rings have kStages slots, so one
  // pipeline state walks both). The lane's address terms are recomputed per
  // stage from a fresh %tid.x (VTranspose::run): kept live across the loop
  // they would take registers the transpose needs (24 per thread at two
  // consumer warpgroups).
  JF_DEVICE static void transpose_loop(const Smem& sm, int w, int lane) {
    if constexpr (kVTransposed) {
      using namespace ptx;
      PipeState<kStages> st;
      for (;;) {
        mbar_wait(sm.full_v(st.index), st.phase);
        // The end (finish_loads)? Lane 0 reads the word and arrives on
        // empty_v for the warp, so its read is ordered before the producer's
        // write directly (compute-sanitizer does not follow __syncwarp from
        // the other lanes to lane 0's arrive).
        uint32_t end = 0;
        if (lane == 0) end = ld_shared_b32(sm.v_end(st.index));
        if (__shfl_sync(0xFFFFFFFFu, end, 0) != 0u) break;
        mbar_wait(sm.empty_vt(st.index), st.phase ^ 1u);
        VTranspose<kHeadDimV, kBlockN, kTransposeWarps, kTransposeDepth>::run(sm.v(st.index), sm.vt(st.index),
                                                                              w);
        fence_proxy_async_smem();  // the stores, before the consumers' wgmma reads them
        __syncwarp();
        if (lane == 0) {
          mbar_arrive(sm.full_vt(st.index));
          mbar_arrive(sm.empty_v(st.index));
        }
        st.advance();
      }
    }
  }

  // ---------------------------------------------------------------- dropout mask producer
  // kDropMask: mask thread j (0..kMaskThreads-1) of the producer warpgroup,
  // one tile: the bit masks of its KV blocks in the consumers' order (n
  // descending), each into the next slot of the ring once every consumer
  // warp has released it; thread j writes words j, j + kMaskThreads, ...
  // (consecutive threads, consecutive words) and arrives on the slot's
  // full_mask after its last store (release: its stores are visible to the
  // consumers that wait there). The generator's key words are read once per
  // tile (a few loads next to a block's work), not kept live across tiles.
  JF_DEVICE static void make_masks(const Params& a, const Smem& sm, ptx::PipeState<kMaskStages>& mst,
                                   const TileCoord& c, int j) {
    if constexpr (kDropMask) {
      const int m0 = c.block * kBlockM;
      int n_first, n_last;
      kv_block_range(a, c.batch, m0, n_first, n_last);
      const Dropout d(a.dropout);
      const DropMaskThreshold t(d.threshold);
      for (int n = n_last - 1; n >= n_first; --n) {
        ptx::mbar_wait(sm.empty_mask(mst.index), mst.phase ^ 1u);
        const uint32_t base = sm.mask(mst.index);
#pragma unroll 1
        for (int w = j; w < MaskLayout::kWords; w += kMaskThreads) {
          const int g = MaskLayout::group_of(w), lane = MaskLayout::lane_of(w);
          const uint32_t word =
              drop_mask_word(d, t, c.batch, c.head, m0 + 16 * g + lane / 4,
                             n * kMaskChunks + MaskLayout::chunk_of(w), lane % 4);
          ptx::st_shared_b32(base + 4 * w, word);
        }
        ptx::mbar_arrive(sm.full_mask(mst.index));
        mst.advance();
      }
    }
  }

  // ---------------------------------------------------------------- consumer GEMMs
  // Byte offset of k-step kk in a K-major [D / kRowElems][kRows][kRowElems]
  // tile of kRowBytes_-wide rows (A = Q, B = K of S = Q K^T; 8-bit: B = V^T,
  // whose atoms are [kHeadDimV rows][128 keys]: k-step kk is in atom kk / 4).
  template <int kRows, int kRowBytes_ = kRowBytes>
  struct KMajorStep {
    JF_DEVICE uint32_t operator()(int kk) const {
      constexpr int kPerRow = kRowBytes_ / kStepBytes;
      return (kk / kPerRow) * kRows * kRowBytes_ + (kk % kPerRow) * kStepBytes;
    }
  };
  // k-step kk of a V stage (B, MN-major): kMmaK rows of 128 bytes.
  struct VStep {
    JF_DEVICE uint32_t operator()(int kk) const { return kk * Traits::kMmaK * 128; }
  };

  // Issues S = Q_wg K^T (no commit/wait). q_addr: the WG's first Q row.
  JF_DEVICE static void issue_qk(float (&s)[kSR], uint32_t q_addr, uint32_t k_addr) {
    ptx::gemm_ss<Element, kBlockN, 0, kQSteps>(
        s, ptx::make_desc(kDescQK, q_addr), ptx::make_desc(kDescQK, k_addr), KMajorStep<kBlockM>{},
        KMajorStep<kBlockN>{}, true);
  }
  // q_in_regs: S = Q_wg K^T with Q from registers (wgmma RS; the A fragments
  // of the kQSteps k-steps, loaded once per tile by load_a_sw128), K as in
  // issue_qk. Same instructions otherwise: N = kBlockN, K-major B.
  JF_DEVICE static void issue_qk_rs(float (&s)[kSR], const uint32_t (&q)[kQSteps][4], uint32_t k_addr) {
    ptx::gemm_rs<Element, kBlockN, 0, kQSteps>(s, q, ptx::make_desc(kDescQK, k_addr),
                                              KMajorStep<kBlockN>{}, true);
  }
  // Issues O += P V (no commit/wait). 8-bit: V^T is K-major, atoms of
  // [kHeadDimV][128 keys] (Smem::pv, the V^T ring).
  // first: the tile's first PV GEMM, which (kFirstPVZeroes) overwrites O.
  JF_DEVICE static void issue_pv(float (&o)[kOR], const uint32_t (&p)[kPSteps][4], uint32_t v_addr,
                                 bool first) {
    if constexpr (kVTransposed) {
      ptx::gemm_rs<Element, kHeadDimV, 0, kPSteps>(o, p, ptx::make_desc(ptx::kDescKMajor, v_addr),
                                                   KMajorStep<kHeadDimV, 128>{}, kFirstPVZeroes && first);
    } else {
      ptx::gemm_rs<Element, kHeadDimV, 1, kPSteps>(
          o, p, ptx::make_desc(ptx::desc_mn_major<kBlockN>(), v_addr), VStep{}, kFirstPVZeroes && first);
    }
  }

  // The softmax scale of each KV block. 16-bit: the call's (at() leaves it).
  // 8-bit: the true score is s * q_descale * k_descale[n] (scheme.py), folded
  // into the block's scale_log2, or into the softcap's pre-factor when there
  // is one (tanh needs the true score; its output scale stays the call's).
  // K descales are read one block ahead (the loop visits n downwards), so the
  // load's latency hides behind a block's GEMMs.
  struct BlockScales {
    float scale_log2, softcap_pre;  // the call's (SoftmaxScale)
    float q = 1.f;                  // 8-bit: the warpgroup's Q descale
    const float* k = nullptr;       // 8-bit: this (batch, kv head)'s K descales
    mutable float k_next = 1.f;     // 8-bit: descale of the next block to visit
    JF_DEVICE BlockScales(const Params& a, int m0_wg, int head, int batch, int n_first_visit)
        : scale_log2(a.sm.scale_log2), softcap_pre(a.sm.softcap_pre) {
      if constexpr (kBlockScaled) {
        const Descales& d = a.descale;
        q = __ldg(d.q + (int64_t(batch) * a.num_heads + head) * d.q_blocks + m0_wg / kFp8QBlock);
        k = d.k + (int64_t(batch) * (a.num_heads / a.heads_per_kv) + head / a.heads_per_kv) * d.k_blocks;
        k_next = __ldg(k + n_first_visit);
      }
    }
    // Block n's (scale_log2, softcap_pre); call with n = n_last - 1, n_last - 2, ...
    JF_DEVICE void at(int n, float& block_scale_log2, float& block_softcap_pre) const {
      const float f = q * k_next;
      if (n > 0) k_next = __ldg(k + n - 1);
      block_scale_log2 = scale_log2;
      block_softcap_pre = softcap_pre;
      if (softcap_pre != 0.f) {
        block_softcap_pre = softcap_pre * f;
      } else {
        block_scale_log2 = scale_log2 * f;
      }
    }
  };

  // Everything a consumer warpgroup needs to run one tile's mainloop.
  struct Consumer {
    // The A operand of S = Q K^T for this warpgroup's 64 rows: their address in
    // the Q tile (wgmma SS) or, q_in_regs, their A fragments (wgmma RS), read
    // from shared memory once per tile.
    struct QSmem {
      uint32_t addr;
    };
    struct QRegs {
      uint32_t frag[kQSteps][4];
    };
    using QOperand = std::conditional_t<kQInRegs, QRegs, QSmem>;

    const Params& a;
    const Smem& sm;
    int wg, warp, lane;
    ptx::PipeState<kStages>& kst;
    ptx::PipeState<kStages>& vst;
    ptx::PipeState<kMaskStages>& mst;  // kDropMask: the bit-mask ring
    // kVarlen: the mask of the tile's sequence (set_sequence, once per tile).
    struct NoMask {};
    mutable std::conditional_t<kVarlen, MaskInfo, NoMask> seq_mask{};

    JF_DEVICE const MaskInfo& mask() const {
      if constexpr (kVarlen) {
        return seq_mask;
      } else {
        return a.mask;
      }
    }
    JF_DEVICE void set_sequence(const VarlenSeq& s) const {
      if constexpr (kVarlen) seq_mask = a.mask.for_sequence(s.len_q, s.len_k);
    }

    // kVarlen: the V rows of the tile's last KV block past the sequence's
    // end hold the next tokens of the packed tensor (anything, NaN
    // included); their P is 0 but 0 * NaN is not, so they are zeroed in
    // shared memory before the first PV GEMM reads the stage (the block
    // the tile visits first; called in run() once the tile's first QK^T and
    // softmax are done, only when the tile has keys). Every consumer thread takes a share, then the
    // proxy fence (st.shared before wgmma's async-proxy reads) and a barrier
    // of all consumer WGs (they share the stage). The producer refills the
    // slot only after every consumer warp released it.
    JF_DEVICE void zero_v_tail(int n_first, int n_last) const {
      const int len_k = seq_mask.seqlen_k;
      if (n_last <= n_first || n_last * kBlockN <= len_k) return;  // uniform over the CTA
      ptx::mbar_wait(sm.full_v(vst.index), vst.phase);
      const int valid = len_k - (n_last - 1) * kBlockN;
      constexpr int kChunks = kColBlocksV * (kRowBytes / 16);  // 16-byte chunks of a key's row
      const uint32_t base = sm.v(vst.index);
      for (int i = 128 * wg + 32 * warp + lane; i < (kBlockN - valid) * kChunks; i += 128 * kConsumerWGs) {
        const int r = valid + i / kChunks, c = i % kChunks;
        ptx::st_shared_v4_zero(base + (c / (kRowBytes / 16)) * kBlockN * kRowBytes + r * kRowBytes +
                               (c % (kRowBytes / 16)) * 16);
      }
      ptx::fence_proxy_async_smem();
      ptx::named_bar_sync(kBarVarlenV, 128 * kConsumerWGs);
    }

    // Before the first tile: the first pingpong turn is WG 0's.
    JF_DEVICE void start() const {
      if constexpr (kPingpong) {
        if (wg == 0) ptx::named_bar_arrive(kBarSched + 0, 256);
      }
    }
    JF_DEVICE void sched_sync() const {
      if constexpr (kPingpong) ptx::named_bar_sync(kBarSched + wg, 256);
    }
    JF_DEVICE void sched_arrive() const {
      if constexpr (kPingpong)
        ptx::named_bar_arrive(kBarSched + (wg + 1 == kConsumerWGs ? 0 : wg + 1), 256);
    }
    // One arrival per warp on an "empty" barrier (after the warp's wgmma wait).
    JF_DEVICE void release(uint32_t bar) const {
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(bar);
      __syncwarp();
    }
    JF_DEVICE void wait_full(uint32_t bar, uint32_t phase) const {
      ptx::mbar_wait(bar, phase);
      __syncwarp();
    }

    // After the Q "full" wait of the tile.
    JF_DEVICE QOperand load_q() const {
      QOperand q;
      if constexpr (kQInRegs) {
        ptx::load_a_sw128<kBlockM>(q.frag, sm.q(), 64 * wg);
      } else {
        q.addr = sm.q() + 64 * wg * kRowBytes;  // the WG's rows, column block 0
      }
      return q;
    }
    // Issues S = Q K^T for the K stage at k_addr (no fence/commit/wait).
    JF_DEVICE void issue_s(float (&s)[kSR], const QOperand& q, uint32_t k_addr) const {
      if constexpr (kQInRegs) {
        issue_qk_rs(s, q.frag, k_addr);
      } else {
        issue_qk(s, q.addr, k_addr);
      }
    }

    // Softcap and (only on blocks that need it) the element mask.
    // softcap_pre: a.sm.softcap_pre, times the block's descales when 8-bit.
    // plan (kPacked): MaskInfo::row_plan of the WG's rows, once per tile.
    // kSoftcapFixed: the form's transform (sc) instead.
    JF_DEVICE void score_mod(float (&s)[kSR], int m0_wg, int n, int batch, float softcap_pre,
                             uint32_t plan, const SoftcapConsts& sc) const {
      if constexpr (kSoftcapFixed) {
        sc.apply(s);
      } else {
        if constexpr (!kBlockScaled) softcap_pre = a.sm.softcap_pre;
        if (softcap_pre != 0.f) apply_softcap(s, softcap_pre);
      }
      const int n0 = n * kBlockN;
      const int row0 = m0_wg + 16 * warp + lane / 4, col0 = n0 + 2 * (lane % 4);
      if constexpr (kPacked) {
        if (a.mask.block_needs_mask(plan, m0_wg, 64, n, kBlockN))
          apply_mask<true>(s, a.mask, batch, row0, col0, MaskInfo::plan_exact(plan));
      } else {
        if (mask().block_needs_mask_by_position(m0_wg, 64, n0, kBlockN))
          apply_mask<false>(s, mask(), batch, row0, col0, false);
      }
    }

    // Dropout: the Philox output of the thread's elements of block n, one call
    // per 64-key chunk and row half (rows row0 and row0 + 8, columns
    // 64 c + 8 m + 2 t + e: byte 2 m + e; philox.h). Drawn while the block's
    // GEMMs run, applied to P by drop().
    struct BlockBits {
      Philox4x32 w[kBlockN / 64][2];
    };
    JF_DEVICE void draw(BlockBits& bits, const Dropout& d, int m0_wg, int n, int head, int batch) const {
      const uint32_t row0 = m0_wg + 16 * warp + lane / 4, t = lane % 4;
#pragma unroll
      for (int c = 0; c < kBlockN / 64; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          bits.w[c][h] = d.bytes(batch, head, row0 + 8 * h, n * (kBlockN / 64) + c, t);
    }
    // Zeroes P's dropped elements (accumulator register 4 j + 2 h + e is row
    // half h, column 8 j + 2 t + e); !kDrawEarly: draws each call here.
    JF_DEVICE void drop(float (&s)[kSR], const BlockBits& bits, const Dropout& d, int m0_wg, int n,
                        int head, int batch) const {
      const uint32_t row0 = m0_wg + 16 * warp + lane / 4, t = lane % 4;
#pragma unroll
      for (int c = 0; c < kBlockN / 64; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const KeepBits keep(
              kDrawEarly ? bits.w[c][h] : d.bytes(batch, head, row0 + 8 * h, n * (kBlockN / 64) + c, t),
              d.threshold);
#pragma unroll
          for (int m = 0; m < 8; ++m)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = s[4 * (8 * c + m) + 2 * h + e];
              x = keep.keep(2 * m + e) ? x : 0.f;
            }
        }
    }

    // kDropMask: the thread's mask words of the next block (one per 64-key
    // chunk, drop_mask.h), read while the block's GEMMs run; the slot is
    // released at once, by every thread after its own read (its arrive's
    // release semantics order the read before the slot's next write
    // directly; compute-sanitizer racecheck does not follow a warp's
    // __syncwarp to one elected lane's arrive, bwd_config.cuh).
    JF_DEVICE void load_mask(uint32_t (&words)[kMaskChunks]) const {
      if constexpr (kDropMask) {
        wait_full(sm.full_mask(mst.index), mst.phase);
        const uint32_t addr = sm.mask(mst.index) + 4 * MaskLayout::word(4 * wg + warp, lane, 0);
        if constexpr (kMaskChunks == 2) {
          const uint2 v = ptx::ld_shared_v2_u32(addr);
          words[0] = v.x;
          words[1] = v.y;
        } else {
          words[0] = ptx::ld_shared_b32(addr);
        }
        ptx::mbar_arrive(sm.empty_mask(mst.index));
        mst.advance();
      }
    }
    // kDropMask: zeroes the dropped elements of P packed as the A fragments
    // (acc_to_a: register i of k-step kk is row half i % 2, columns 16 kk +
    // 8 (i / 2) + 2 t + e, e = 0 in the low half).
    JF_DEVICE static void drop_p(uint32_t (&p)[kPSteps][4], const uint32_t (&words)[kMaskChunks]) {
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int j = 2 * kk + i / 2;
          p[kk][i] = drop_pair(p[kk][i], words[j / 8], j % 8, i % 2);
        }
    }

    // The softmax of one block: update_lazy() (returns true only when some row
    // of the warp raised its max; the same value on every lane) or, without
    // lazy rescaling, update() (true: O must always be rescaled).
    // kSoftcapFixed: the fixed max (false: never a rescale).
    template <bool kFirst>
    JF_DEVICE bool softmax(Softmax& smx, float (&s)[kSR], float scale_log2, float (&alpha)[2],
                           const SoftcapConsts& sc) const {
      if constexpr (kSoftcapFixed) {
        smx.template update_fixed<kFirst>(s, sc.exp_scale, sc.exp_off);
        return false;
      } else if constexpr (kLazy) {
        return smx.template update_lazy<kFirst>(s, scale_log2, alpha);
      } else {
        smx.template update<kFirst>(s, scale_log2, alpha);
        return true;
      }
    }

    // One tile: waits for Q, runs the KV blocks [n_first, n_last) into O
    // (pre-zeroed when kZeroFillO, else written by the first PV GEMM or zeroed
    // here) and the softmax state, and releases Q's buffer unless the
    // epilogue stages O there (kEpilogueReleasesQ).
    template <bool kEpilogueReleasesQ>
    JF_DEVICE void mma(float (&o)[kOR], Softmax& smx, int m0, int head, int batch, int n_first,
                       int n_last, uint32_t it) const {
      static_assert(!kQInRegs || !kEpilogueReleasesQ,
                    "q_in_regs frees Q's buffer right after the load: O cannot be staged there");
      wait_full(sm.full_q(), it & 1u);
      const QOperand q = load_q();
      // kQInRegs: the warp's only reads of Q's buffer are the ldmatrix above;
      // the arrive (after __syncwarp, release semantics) orders them before the
      // producer's empty_q wait and so before the next tile's TMA write. The
      // proxy fence orders these generic-proxy reads before that async-proxy
      // write, as CUTLASS's TMA epilogue does before releasing smem it read into
      // registers. The next tile's Q then loads during this mainloop.
      if constexpr (kQInRegs) {
        ptx::fence_proxy_async_smem();
        release(sm.empty_q());
      }
      if (n_last > n_first) {
        run(o, smx, q, m0 + 64 * wg, head, batch, n_first, n_last);
      } else if constexpr (kFirstPVZeroes) {
#pragma unroll
        for (int i = 0; i < kOR; ++i) o[i] = 0.f;
      }
      if constexpr (!kQInRegs && !kEpilogueReleasesQ)
        release(sm.empty_q());  // all QK^T of this warp are done
    }

    // O (pre-zeroed, or kFirstPVZeroes: written by the first PV GEMM) and
    // the softmax state for KV blocks [n_first, n_last); q from load_q().
    // kQInRegs: q's registers are only read here (by the async wgmma), never
    // written, so one wgmma_fence() after load_q orders them.
    JF_DEVICE void run(float (&o)[kOR], Softmax& smx, const QOperand& q, int m0_wg, int head,
                       int batch, int n_first, int n_last) const {
      using namespace ptx;
      const BlockScales bs(a, m0_wg, head, batch, n_last - 1);
      uint32_t plan = 0;
      if constexpr (kPacked) plan = a.mask.row_plan(batch, m0_wg, 64, kBlockN);
      float scale_log2 = a.sm.scale_log2, softcap_pre = a.sm.softcap_pre;  // 8-bit: per block
      SoftcapConsts sc{a.sm};
      if constexpr (kSoftcapFixed) smx.set_fixed_max(sc.m_raw);
      float s[kSR];
      uint32_t p[kPSteps][4];
      float alpha[2];
      // Dropout: the generator (key words read once per tile) and a block's bits.
      Dropout drop_gen;
      if constexpr (kDropout && !kDropMask) drop_gen = Dropout(a.dropout);
      BlockBits bits;
      uint32_t mask_words[kMaskChunks];  // kDropMask: a block's mask words

      if constexpr (kOverlap) {
        int n = n_last - 1;
        // Block n_last - 1: S alone.
        wait_full(sm.full_k(kst.index), kst.phase);
        wgmma_fence();
        issue_s(s, q, sm.k(kst.index));
        wgmma_commit();
        if constexpr (kDrawEarly) draw(bits, drop_gen, m0_wg, n, head, batch);
        load_mask(mask_words);
        wgmma_wait<0>();
        fence_regs(s);
        release(sm.empty_k(kst.index));
        kst.advance();
        if constexpr (kBlockScaled) bs.at(n, scale_log2, softcap_pre);
        score_mod(s, m0_wg, n, batch, softcap_pre, plan, sc);
        softmax<true>(smx, s, scale_log2, alpha, sc);
        if constexpr (kDropout && !kDropMask) drop(s, bits, drop_gen, m0_wg, n, head, batch);
        acc_to_a<Element>(s, p);
        if constexpr (kDropMask) drop_p(p, mask_words);
        // Before the first PV (and before the first pingpong turn, so no
        // warpgroup waits for another's turn here); the V load's latency
        // hides behind the first QK^T and softmax.
        if constexpr (kVarlen) zero_v_tail(n_first, n_last);
        float alpha_pending[2] = {1.f, 1.f};  // kRescaleBeforePV: applied before the next PV
        bool rescale_pending = false;         // kRescaleBeforePV: whether to apply it

        for (--n; n >= n_first; --n) {
          wait_full(sm.full_k(kst.index), kst.phase);
          sched_sync();
          fence_regs(p);
          wgmma_fence();
          issue_s(s, q, sm.k(kst.index));
          wgmma_commit();
          if constexpr (kRescaleBeforePV) {  // O is idle here (last PV waited for)
            if (rescale_pending) rescale_rows(o, alpha_pending);
          }
          fence_regs(o);
          wait_full(sm.full_pv(vst.index), vst.phase);
          wgmma_fence();
          issue_pv(o, p, sm.pv(vst.index), n + 1 == n_last - 1);
          wgmma_commit();
          sched_arrive();
          if constexpr (kDrawEarly) draw(bits, drop_gen, m0_wg, n, head, batch);
          load_mask(mask_words);
          wgmma_wait<1>();  // S ready (the PV may still run)
          fence_regs(s);
          release(sm.empty_k(kst.index));
          kst.advance();
          if constexpr (kBlockScaled) bs.at(n, scale_log2, softcap_pre);
          score_mod(s, m0_wg, n, batch, softcap_pre, plan, sc);
          const bool rescale = softmax<false>(smx, s, scale_log2, alpha, sc);
          if constexpr (kDropout && !kDropMask) drop(s, bits, drop_gen, m0_wg, n, head, batch);
          wgmma_wait<0>();  // PV done: O and P are ours again
          fence_regs(o);
          fence_regs(p);
          release(sm.empty_pv(vst.index));
          vst.advance();
          acc_to_a<Element>(s, p);
          if constexpr (kDropMask) drop_p(p, mask_words);
          if constexpr (kRescaleBeforePV) {
            alpha_pending[0] = alpha[0];
            alpha_pending[1] = alpha[1];
            rescale_pending = rescale;
          } else if (rescale) {  // warp-uniform: skipped, not predicated (always true when eager)
            rescale_rows(o, alpha);
          }
        }
        // PV of block n_first.
        if constexpr (kRescaleBeforePV) {
          if (rescale_pending) rescale_rows(o, alpha_pending);
        }
        fence_regs(o);
        fence_regs(p);
        wait_full(sm.full_pv(vst.index), vst.phase);
        wgmma_fence();
        issue_pv(o, p, sm.pv(vst.index), n_first == n_last - 1);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(o);
        fence_regs(p);
        release(sm.empty_pv(vst.index));
        vst.advance();
      } else {
        sched_sync();
        for (int n = n_last - 1; n >= n_first; --n) {
          wait_full(sm.full_k(kst.index), kst.phase);
          wgmma_fence();
          issue_s(s, q, sm.k(kst.index));
          wgmma_commit();
          sched_arrive();
          if constexpr (kDrawEarly) draw(bits, drop_gen, m0_wg, n, head, batch);
          load_mask(mask_words);
          wgmma_wait<0>();
          fence_regs(s);
          release(sm.empty_k(kst.index));
          kst.advance();
          if constexpr (kBlockScaled) bs.at(n, scale_log2, softcap_pre);
          score_mod(s, m0_wg, n, batch, softcap_pre, plan, sc);
          if (n == n_last - 1) {
            softmax<true>(smx, s, scale_log2, alpha, sc);
          } else if (softmax<false>(smx, s, scale_log2, alpha, sc)) {
            rescale_rows(o, alpha);
          }
          if constexpr (kDropout && !kDropMask) drop(s, bits, drop_gen, m0_wg, n, head, batch);
          acc_to_a<Element>(s, p);
          if constexpr (kDropMask) drop_p(p, mask_words);
          fence_regs(o);
          fence_regs(p);
          wait_full(sm.full_pv(vst.index), vst.phase);
          sched_sync();
          wgmma_fence();
          issue_pv(o, p, sm.pv(vst.index), n == n_last - 1);
          wgmma_commit();
          wgmma_wait<0>();
          fence_regs(o);
          fence_regs(p);
          release(sm.empty_pv(vst.index));
          vst.advance();
        }
        sched_arrive();
      }
    }
  };
};

}  // namespace jax_flash::sm90
