// Shapes, shared-memory plan, kernel arguments and tile scheduler of the sm90
// (FlashAttention-3 style) backward. See bwd_kernel.cuh for the algorithm.
//
// CTA = 1 producer warpgroup + 2 consumer warpgroups (384 threads). The CTA
// owns kBlockN keys of one KV head and keeps their dK and dV in registers for
// the whole sweep over the query blocks (kBlockM rows per step) of every q
// head of the GQA group. Two work splits over the consumer warpgroups:
//
// kSdpSwapAB (hdim 64, 128; bwd_key_split.cuh BwdKeySplit): kBlockN = 128,
// warpgroup wg owns keys [64 wg, 64 wg + 64) (wgmma M = 64) and their dK, dV
// (64 x D each). FA3 (hopper/flash_bwd_launch_template.h, sm90): hdim 64:
// 128 x 128, hdim 128: 64 x 128, both with SdP_swapAB (S^T = K Q^T, so that
// P^T and dS^T are wgmma accumulators that feed dV += P^T dO and dK += dS^T Q
// from registers: Mma_dKV_is_RS), dKV_swapAB = dQ_swapAB = false, 2 consumer
// warpgroups, 2 stages of Q / dO and of dS. dQ = dS K (kBlockM x D per step)
// is split over the two warpgroups into 64 x 64 tiles: along the head dim for
// kBlockM = 64 (hdim 128: FA3 AtomLayoutMdQ = 1), along the rows for
// kBlockM = 128 (hdim 64: AtomLayoutMdQ = 2). The kBlockM 80 tile (hdim 128,
// no causal / local bound, bwd_policy.h; FA3's non-causal tile): kBlockM = 80, S^T / dP^T
// 64 x 80 per WG, dV / dK RS GEMMs of 5 k-steps, and dQ_swapAB: dQ^T = K^T
// dS^T, 64 head-dim columns x 80 queries per WG (see kDqSwapAB below).
//
// !kSdpSwapAB (hdim 256; bwd_column_split.cuh BwdColumnSplit): kBlockM =
// kBlockN = 64. dK and dV of 64 keys x 256 are 128 registers per thread
// however they are split, so S = Q K^T and dP = dO V^T are split along the
// keys (warpgroup wg: keys [32 wg, 32 wg + 32), 64 x 32, 16 registers each)
// and dK, dV, dQ along the head dim (warpgroup wg: columns [128 wg, 128 wg +
// 128)); P and dS go through shared memory (FA3 hdim 256: Mma_dKV_is_RS
// false, SdP_swapAB false, 2 consumer warpgroups, dKV / dQ split over the
// warpgroups along the head dim, 1 dO stage). FA3 uses kBlockN = 80 with
// dKV_swapAB / dQ_swapAB (M = head dim, 160 accumulator registers for dK +
// dV, dQ sliced and added with atomics from registers); 64 keys keep dV =
// P^T dO and dK = dS^T Q unswapped (M = the 64 keys, A = P^T / dS^T read
// MN-major from the [query][key] tiles: wgmma tnspA), 128 registers for dK +
// dV and a 64-row dQ staged through shared memory like the other buckets.
// dQ is made in kDqSlices = 2 column slices of 64 per warpgroup (32
// registers each), each through the warpgroup's 64 x 64 fp32 staging tile.
//
// Head-dim pair (kHeadDimV != kHeadDim: 192 / 128, DeepSeek MLA): Q, K, dQ
// and dK are kHeadDim wide, V, dO and dV kHeadDimV; S = Q K^T has
// kHeadDim / 16 k-steps, dP = dO V^T kHeadDimV / 16. Production: 64 x 96
// with kDkvSwapAB (bwd_pair_split.cuh BwdPairSplit: each WG owns 48 keys and
// makes dK^T, dV^T for them; P^T and dS^T through [key][query] tiles, so
// the P / dS buffers are kBlockN rows of 64 queries). Kept for measurements:
// the column split on 64 x 64 (BwdPairConfig64): dK, dV and dQ are 8 column
// blocks of 64 (3 + 2 + 3), each a 64 x 64 x 64 GEMM per step; the split
// gives each WG 4 (bwd_column_split.cuh): WG 0 dK blocks 1-2, dV block 0, dQ
// block 0; WG 1 dK block 0, dV block 1, dQ blocks 1 and 2. Both tiles make
// dQ in those slices (kDqSlices = 2 the most per WG, dq_slices(wg) each WG's).
//
// Shared memory (all 16-bit tiles in the 128B-swizzled TMA/wgmma layout of
// smem_layout.cuh, [cols / 64][rows][64]):
//   K, V          [D/64][kBlockN][64]           loaded once per CTA (V: D_v)
//   Q             kStages x [D/64][kBlockM][64] TMA ring (producer warp)
//   dO            kStagesDo x [D_v/64][kBlockM][64]  TMA ring (1 stage for hdim 256)
//   dS            2 x [kBlockN/64][kBlockM][64] dS (queries x keys, K-major
//                                               for dQ = dS K), double buffered
//   P             2 x [kBlockM][64]             !kSdpSwapAB only: P (queries x
//                                               keys), double buffered
//   dQ            2 x 16 or 18 KB fp32          one staging tile per consumer WG:
//                   kDqTensor (default): [2][64][32] 128B-swizzled (two TMA boxes
//                   of 32 columns, added into dq_accum by cp.reduce.async.bulk.tensor);
//                   rows (kept for measurements, cuda/tests/sm90_bwd_tuning.h):
//                   [64][kDqPitch], one cp.reduce.async.bulk per row;
//                   dQ_swapAB (kBlockM 80): [2][80][32] swizzled only (20 KB)
//   LSE           kStages x [kBlockM] fp32      log2-unit LSE (+inf for empty
//                                               rows / rows past seqlen_q)
//   delta         kStagesDo x [kBlockM] fp32
//   mbarriers
// After the mainloop dK and dV (16-bit) are staged in the K and V tiles and
// stored by TMA (clipping the seq and head-dim tails).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "sm90/common/mask.cuh"
#include "sm90/ptx/common.cuh"
#include "sm90/common/smem_layout.cuh"
#include "sm90/common/softmax.cuh"
#include "sm90/common/tile_scheduler.cuh"

namespace jax_flash::sm90 {

template <int kHeadDim_, int kBlockM_, int kBlockN_ = 128, int kStagesDo_ = 2, bool kSdpSwapAB_ = true,
          int kHeadDimV_ = kHeadDim_>
struct BwdConfig {
  static constexpr int kHeadDim = kHeadDim_;    // Q, K, dQ, dK
  static constexpr int kHeadDimV = kHeadDimV_;  // V, dO, dV (O for delta)
  static constexpr bool kPair = kHeadDimV != kHeadDim;
  static constexpr int kBlockM = kBlockM_;  // query rows per step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr bool kSdpSwapAB = kSdpSwapAB_;  // the work split (see the top)
  static constexpr int kConsumerWGs = 2;
  static constexpr int kStages = 2;         // Q ring (and LSE)
  static constexpr int kStagesDo = kStagesDo_;  // dO ring (and delta)
  static_assert(kStagesDo >= 1 && kStagesDo <= kStages, "dO stages");
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kProducerRegs = 24;  // FA3 bwd: 24 / 240 with 2 consumer WGs
  static constexpr int kConsumerRegs = 240;
  // setmaxnreg budgets must fit the CTA's launch allocation
  // (__launch_bounds__(kThreads, 1): 65536 / kThreads rounded down to a
  // multiple of 8 per thread, 168 x 384 here): an increase beyond what the
  // other warps gave back waits forever.
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static_assert(128 * (kProducerRegs + kConsumerWGs * kConsumerRegs) <= kLaunchRegs * kThreads,
                "setmaxnreg budgets beyond the CTA's launch allocation deadlock");

  static_assert(kSdpSwapAB ? (kHeadDim % 64 == 0 && kHeadDim <= 128 && kBlockN == 128 && !kPair)
                           : ((kPair ? kHeadDim == 192 && kHeadDimV == 128 : kHeadDim == 256) &&
                              (kBlockN == 64 || (kPair && kBlockN == 96)) && kBlockM == 64),
                "head dim buckets: 64 and 128 (SdP_swapAB, 128 keys), 256 and the pair 192 / 128 (64 x 64; "
                "the pair also 64 x 96, dKV_swapAB)");
  // dKV_swapAB (the pair on 64 x 96, bwd_pair_split.cuh BwdPairSplit): each
  // WG owns 48 keys and makes dK^T = Q^T dS, dV^T = dO^T P for them (wgmma
  // M = the head dim, N = its 48 keys), P^T and dS^T through shared memory.
  static constexpr bool kDkvSwapAB = !kSdpSwapAB && kBlockN == 96;
  static_assert(kBlockM == 64 || kBlockM == 128 || (kBlockM == 80 && kHeadDim == 128),
                "kBlockM: 64 or 128 (80: hdim 128, dQ_swapAB)");
  // dQ_swapAB (FA3: kBlockM % 64 != 0, i.e. kBlockM = 80): each WG makes
  // dQ^T[cols, :] = K[:, cols]^T dS^T (wgmma M = its 64 head-dim columns, N =
  // kBlockM queries, A = K read MN-major (tnspA), B = dS K-major), so the
  // 80 rows need no 64-row wgmma M; the WG's staging tile is then kBlockM
  // rows (kDqRows) x 64 columns, written transposed from the accumulator.
  static constexpr bool kDqSwapAB = kSdpSwapAB && kBlockM % 64 != 0;
  // dQ (kBlockM x D) split over the 2 WGs into kDqRows-row x kDqWGCols parts,
  // each made in kDqSlices 64-column slices (one staging tile each).
  static constexpr int kDqSplitM = kDqSwapAB ? 1 : kBlockM / 64;  // WGs along the rows
  static constexpr int kDqSplitN = kConsumerWGs / kDqSplitM;  // WGs along the head dim
  static_assert(kDqSplitM * kDqSplitN == kConsumerWGs, "dQ split");
  // (The pair: dQ blocks 1 + 2, see the top; kDqWGCols is the most a WG makes.)
  static constexpr int kDqWGCols = kPair ? 128 : kHeadDim / kDqSplitN;
  static constexpr int kDqCols = 64;
  static constexpr int kDqSlices = kDqWGCols / kDqCols;
  // dQ slices WG wg makes per step, and the first column of its slice sl.
  static constexpr int dq_slices(int wg) { return kPair ? 1 + wg : kDqSlices; }
  static constexpr int dq_col0(int wg, int sl) {
    return kPair ? kDqCols * (wg + sl) : (kDqSplitN == 2 ? kDqWGCols * wg : 0) + kDqCols * sl;
  }
  static constexpr int kDqRows = kDqSwapAB ? kBlockM : 64;  // rows of a WG's dQ tile
  static_assert(kDqSlices * kDqCols == kDqWGCols && (kSdpSwapAB ? kDqSlices == 1 : kDqSlices == 2),
                "each WG's dQ staging tile is 64 x 64 (one wgmma N=64, one K column block)");
  // Row pitch of a dQ staging tile (floats) with row reductions (kept for
  // measurements; the plan reserves its size in every build): +8 makes the float2 fragment stores conflict-free (rows g and
  // g+4 land 32 banks apart) and keeps every row 16-byte aligned for the bulk
  // copy engine. hdim 256: no padding (the plan has no 4 KB to spare; the
  // default tensor-reduction layout does not use the pitch).
  static constexpr int kDqPitch = kDqCols + (kSdpSwapAB ? 8 : 0);

  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;   // K (and V of a bucket)
  static constexpr int kVBytes = kBlockN * kHeadDimV * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;    // one Q stage
  static constexpr int kDoBytes = kBlockM * kHeadDimV * 2;  // one dO stage
  static constexpr int kDsBytes = kBlockM * kBlockN * 2;  // one dS (or P) buffer
  static constexpr int kPBytes = kSdpSwapAB ? 0 : 2 * kDsBytes;  // P^T stays in registers there
  // One WG's dQ staging tile: the larger of the two layouts (64 x kDqPitch
  // rows, 64 x 64 swizzled boxes), a multiple of 1 KB. dQ_swapAB: only the
  // swizzled layout (two kDqRows x 32 boxes; no row reductions).
  static constexpr int kDqWGBytes = kDqSwapAB ? kDqRows * kDqCols * 4 : 64 * kDqPitch * 4;
  static_assert(kDqWGBytes >= kDqRows * kDqCols * 4 && kDqWGBytes % 1024 == 0, "dQ staging tile");
  static constexpr int kStatBytes = kBlockM * 4;          // one stage of LSE (or delta)

  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKVBytes;
  static constexpr int kOffQ = kOffV + kVBytes;
  static constexpr int kOffdO = kOffQ + kStages * kQBytes;
  static constexpr int kOffdS = kOffdO + kStagesDo * kDoBytes;
  static constexpr int kOffP = kOffdS + 2 * kDsBytes;
  static constexpr int kOffdQ = kOffP + kPBytes;
  static constexpr int kOffLse = kOffdQ + kConsumerWGs * kDqWGBytes;
  static constexpr int kOffDelta = kOffLse + kStages * kStatBytes;
  static constexpr int kOffBar = kOffDelta + kStagesDo * kStatBytes;
  // mbarriers: full_kv, full_q[S], empty_q[S], full_do[SD], empty_do[SD]
  static constexpr int kNumBars = 1 + 2 * kStages + 2 * kStagesDo;
  static constexpr int kSmemBytes = kOffBar + 8 * kNumBars;
  static constexpr int kSmemAlloc = kSmemBytes + 1024;  // + slack to align the base to 1 KB
  static_assert(kSmemBytes % 8 == 0 && kSmemAlloc - kSmemBytes >= 1008 + 4,
                "the claim slot (BwdSmem::claim_slot) fits the slack whatever the 16-byte aligned start");
  static_assert(kSmemAlloc <= 227 * 1024, "shared memory plan too large");
  static_assert(kOffV % 1024 == 0 && kOffQ % 1024 == 0 && kOffdO % 1024 == 0 &&
                    kOffdS % 1024 == 0 && kQBytes % 1024 == 0 && kDoBytes % 1024 == 0 &&
                    kDsBytes % 1024 == 0 &&
                    kOffP % 1024 == 0 && kOffdQ % 1024 == 0,
                "128B-swizzled tiles must start 1 KB aligned");
  static_assert(kOffdQ % 16 == 0 && kDqWGBytes % 16 == 0 && (kDqPitch * 4) % 16 == 0,
                "bulk copies need 16-byte aligned rows");
  static_assert(kOffBar % 8 == 0, "mbarrier alignment");

  // Arrivals: full_q / full_do: the 32 lanes of the producer warp (each
  // stores its share of the LSE / delta stage, lane 0 also arms the TMA
  // bytes); empty_*: every consumer warp once.
  static constexpr int kFullArrivals = 32;
  // Every consumer thread arrives on an "empty" barrier: its own reads of the
  // stage's LSE / delta rows (plain ld.shared, written by the producer warp's
  // st.shared) are then ordered before the refill by the arrive's release
  // semantics directly. (One elected lane per warp after __syncwarp is
  // ordered too, but compute-sanitizer racecheck does not follow that chain:
  // it reported 896 hazards per step and stage; cuda/tests/racecheck_probe.cu.)
  static constexpr int kEmptyArrivals = 128 * kConsumerWGs;

  // Attention dropout: the kernels of BwdDropoutConfig<...> (below).
  static constexpr bool kDropout = false;
  // Softcap's tanh: the rational (tanh_rational.h), or with
  // BwdSoftcapExpConfig<...> (below) 1 - 2 / (1 + e^{2y}).
  static constexpr bool kSoftcapTanhExp = false;
  static constexpr bool kDropProducer = false;
  // Variable-length sequences: the kernels of BwdVarlenConfig<...> (below).
  static constexpr bool kVarlen = false;
};

// Softcap's tanh in the form 1 - 2 / (1 + e^{2y}) (two MUFU ops and three
// other instructions instead of one MUFU op and about fifteen: ptxas 13.0,
// hdim 128, one 80-query step of a consumer warp: 903 SASS instructions
// against 1360, 618 without softcap; absolute error about 2^-22, far below
// the gradients' 16-bit rounding). A tuning alternative of the test target
// (cuda/tests/sm90_bwd_tuning.h).
template <typename Base>
struct BwdSoftcapExpConfig : Base {
  static constexpr bool kSoftcapTanhExp = true;
};

// A config with attention dropout: the base plan plus the keep mask's
// buffers (one Philox call gives the 16 keep bits of one query row in a
// 64-key chunk, philox.h).
// Key split (S^T rows are keys, so the mask drawn by query rows goes
// through shared memory, bwd_key_split.cuh): per consumer WG and step
// parity, the mask of the WG's 64 keys x kBlockM queries, [2 words][kBlockM
// + 8] (word w of query q: the generator's calls t = 2w, 2w + 1; +8 words
// per row of words keeps the transposed reads conflict-free).
// Column split (S rows are queries, bwd_column_split.cuh): a thread's call
// covers its row's keys of both WGs (32 each), so the thread of WG wg draws
// its row r0 + 8 wg for both and the two threads of the same warp and lane
// exchange the bits: one word per thread and WG, [128 threads][2 WGs], one
// buffer (a WG writes a step's words after the PdS barrier of the step
// before, which the other WG reaches only after reading that step's).
// kDropProducer (key split only): the masks are drawn not by the consumer
// WGs but by warps 2-3 of the producer warpgroup (idle otherwise), into the
// same buffers (a bit layout of their own, drop_bits.h), handed over with
// mbarriers per step parity: full_drop[b] (every mask thread, after its
// stores), empty_drop[b] (every consumer thread, after its reads). The
// mask warps' generator needs 32 registers: the producer warpgroup's budget
// is 32 there and the consumers' 232 (the launch allocation is 168 x 384).
template <typename Base, bool kDropProducer_ = false>
struct BwdDropoutConfig : Base {
  static constexpr bool kDropout = true;
  static constexpr bool kDropProducer = kDropProducer_;
  static_assert(!kDropProducer || Base::kSdpSwapAB, "producer-drawn masks: the key split's buffers");
  static constexpr int kDropThreads = kDropProducer ? 64 : 0;  // warps 2-3 of the producer warpgroup
  static constexpr int kProducerRegs = kDropProducer ? 32 : Base::kProducerRegs;
  static constexpr int kConsumerRegs = kDropProducer ? Base::kConsumerRegs - 8 : Base::kConsumerRegs;
  static_assert(128 * (kProducerRegs + Base::kConsumerWGs * kConsumerRegs) <= Base::kLaunchRegs * Base::kThreads,
                "setmaxnreg budgets beyond the CTA's launch allocation deadlock");
  static constexpr int kDropRowWords = Base::kBlockM + 8;
  static constexpr int kDropWGBytes = 2 * kDropRowWords * 4;
  static constexpr int kDropBytes =
      Base::kSdpSwapAB ? 2 * Base::kConsumerWGs * kDropWGBytes : 128 * Base::kConsumerWGs * 4;
  static constexpr int kOffDrop = Base::kSmemBytes;  // 8-byte aligned
  static constexpr int kOffDropBar = kOffDrop + kDropBytes;  // kDropProducer: full_drop[2], empty_drop[2]
  static constexpr int kSmemBytes = kOffDropBar + (kDropProducer ? 4 * 8 : 0);
  static constexpr int kSmemAlloc = kSmemBytes + 1024;
  static_assert(kSmemBytes % 8 == 0 && kSmemAlloc <= 227 * 1024, "shared memory plan too large");
};

// A config of the variable-length (cu_seqlens) backward (bwd_varlen_kernel.cuh):
// the base plan plus the slot through which the decoding warp hands the CTA's
// tile (KV block, kv head, batch row and the sequence's offsets and lengths)
// to every thread. Buckets only (the pair's column blocks and the dropout
// masks are not wired to the per-sequence rows).
template <typename Base>
struct BwdVarlenConfig : Base {
  static_assert(!Base::kPair && !Base::kDropout, "varlen: the buckets without dropout");
  static constexpr bool kVarlen = true;
  static constexpr int kVarlenSlotInts = 7;
  static constexpr int kOffVarlenSlot = Base::kSmemBytes;  // 8-byte aligned
  static constexpr int kSmemBytes = kOffVarlenSlot + 32;
  static constexpr int kSmemAlloc = kSmemBytes + 1024;
  static_assert(kSmemAlloc <= 227 * 1024, "shared memory plan too large");
};

template <int kHeadDim>
struct BwdConfigFor;
//                                        D   BM
template <> struct BwdConfigFor<64>  { using type = BwdConfig<64, 128>; };
template <> struct BwdConfigFor<128> { using type = BwdConfig<128, 64>; };
//                                         D   BM  BN  dO stages  SdP_swapAB
template <> struct BwdConfigFor<256> { using type = BwdConfig<256, 64, 64, 1, false>; };
// The head-dim pair 192 / 128 (DeepSeek MLA) on FA3's tile for it
// (hopper/flash_bwd_launch_template.h, hdim 192 with dv <= 128: 64 x 96, 2
// consumer WGs, SdP unswapped, dKV_swapAB, dQ unswapped), 2 dO stages: K 36
// KB, V 24 KB, Q 2 x 24 KB, dO 2 x 16 KB, P^T and dS^T 2 x 12 KB each, dQ
// staging 2 x 16 KB, LSE / delta 2 x 256 B each: 226304 B (+ barriers, 1 KB
// slack; of 232448). 96 keys per CTA: Q and dO are read and dQ reduced
// once per 96 keys instead of 64; dK + dV of 96 keys x (192 + 128) columns
// are 120 registers per consumer thread (128 keys would be 160).
template <int kHeadDim, int kHeadDimV>
struct BwdPairConfigFor;
template <> struct BwdPairConfigFor<192, 128> { using type = BwdConfig<192, 64, 96, 2, false, 128>; };
// The pair on the column split of hdim 256 (64 x 64, dK / dV unswapped;
// 189440 B + barriers): kept for measurements (cuda/tests/sm90_bwd_tuning.h).
using BwdPairConfig64 = BwdConfig<192, 64, 64, 2, false, 128>;
// hdim 128 with kBlockM = 80 (FA3 hopper/flash_bwd_launch_template.h: 80 x
// 128 with dQ_swapAB when not causal and not local, 64 x 128 otherwise), the
// default for masks without a causal / local bound (+4% on the H200 at
// T=S=8192, benchmarks/NOTES.md). Smem: K, V 32 KB each, Q
// and dO 2 x 20 KB each, dS 2 x 20 KB, dQ staging 2 x 20 KB, LSE / delta 2 x
// 320 B each: 230728 B + 1 KB slack (of 232448).
using BwdConfigHd128Bm80 = BwdConfig<128, 80>;

// Named barrier ids of the backward (0 is __syncthreads).
constexpr int kBwdBarDqFull = 1;   // + WG: the WG's dQ tile is staged (128 consumer + 32 writer threads)
constexpr int kBwdBarDqEmpty = 3;  // + WG: the writer has read the WG's tile out (same 160 threads)
constexpr int kBwdBarPdS = 5;      // both consumer WGs wrote their dS (256 threads)
constexpr int kBwdBarEpi = 6;      // both consumer WGs are done with K and V (256 threads)
constexpr int kBwdBarEpiWG = 7;    // + WG: the WG's dK/dV tile is staged (128 threads)
constexpr int kBwdBarDrop = 9;     // + WG: the WG's dropout mask of the step is drawn (key split: 128
                                   // threads; column split: the WG's arrivals + the other WG's, 256)
constexpr int kBwdBarVarlenZero = 11;  // varlen: both consumer WGs zeroed the rows past the sequence (256)
constexpr int kBwdDqBarThreads = 128 + 32;

// The tile order and scheduler (tile_scheduler.cuh): one CTA per (KV block,
// kv head, batch); deterministic kernels take the KV blocks descending and
// claim their tiles in the order the CTAs start (bwd_kernel.cuh).
template <bool kDet>
using BwdTileScheduler = std::conditional_t<kDet, ClaimedSingleTileScheduler<BwdTileOrder<true>>,
                                            SingleTileScheduler<BwdTileOrder<false>>>;

struct BwdKernelArgs {
  CUtensorMap tm_q;   // box {64, kBlockM, 1, 1}
  CUtensorMap tm_k;   // box {64, kBlockN, 1, 1}
  CUtensorMap tm_v;   // box {64, kBlockN, 1, 1}
  CUtensorMap tm_do;  // box {64, kBlockM, 1, 1}
  CUtensorMap tm_dk;  // box {64, 64, 1, 1} (64 rows x 64 columns of a consumer WG's part)
  CUtensorMap tm_dv;  // box {64, 64, 1, 1}
  CUtensorMap tm_dqacc;  // fp32 dq_accum (head_dim, seqlen_q, heads, batch), box {32, kDqRows, 1, 1}
  MaskInfo mask;
  SoftmaxScale sm;
  float scale;             // softmax scale (dK is multiplied by it at the end)
  const float* lse;        // [batch, heads, seqlen_q], natural log
  const float* delta;      // [batch, heads, seqlen_q]
  float* dq_accum;         // [batch, heads, seqlen_q_rounded, dq_pitch]
  int num_heads;
  int heads_per_kv;
  int seqlen_q_rounded;
  int dq_pitch;            // BwdParams::head_dim_rounded
  int head_dim;
  // Deterministic kernels only (else nullptr / 0): dq_sem[(batch * num_heads
  // + q head) * sem_m_blocks + query block] = 1 + the KV block that added
  // into that dQ tile last (0: none yet), zeroed by the launcher.
  int* dq_sem;
  int sem_m_blocks;        // ceil(seqlen_q / kBlockM)
  DropoutArgs dropout;     // the dropout kernels only (BwdDropoutConfig)
};

// The kernel's parameters: the backward's own and its scheduler's.
template <typename Scheduler>
struct BwdKernelParams {
  BwdKernelArgs args;
  typename Scheduler::Params scheduler;
};

template <typename Cfg>
struct BwdSmem {
  uint32_t base;  // 1 KB-aligned shared-window address
  JF_DEVICE uint32_t k() const { return base + Cfg::kOffK; }
  JF_DEVICE uint32_t v() const { return base + Cfg::kOffV; }
  JF_DEVICE uint32_t q(int s) const { return base + Cfg::kOffQ + s * Cfg::kQBytes; }
  JF_DEVICE uint32_t dout(int s) const { return base + Cfg::kOffdO + s * Cfg::kDoBytes; }
  JF_DEVICE uint32_t ds(int b) const { return base + Cfg::kOffdS + b * Cfg::kDsBytes; }
  JF_DEVICE uint32_t p(int b) const { return base + Cfg::kOffP + b * Cfg::kDsBytes; }  // !kSdpSwapAB
  JF_DEVICE uint32_t dq(int wg) const { return base + Cfg::kOffdQ + wg * Cfg::kDqWGBytes; }
  JF_DEVICE uint32_t lse(int s) const { return base + Cfg::kOffLse + s * Cfg::kStatBytes; }
  JF_DEVICE uint32_t delta(int s) const { return base + Cfg::kOffDelta + s * Cfg::kStatBytes; }
  // Cfg::kDropout: WG wg's keep mask of the steps of parity b.
  JF_DEVICE uint32_t drop(int b, int wg) const {
    if constexpr (Cfg::kDropout) {
      return base + Cfg::kOffDrop + (2 * b + wg) * Cfg::kDropWGBytes;
    } else {
      return 0;
    }
  }
  // Cfg::kDropout, column split: the exchanged keep words, [thread][WG].
  JF_DEVICE uint32_t drop_words() const {
    if constexpr (Cfg::kDropout) {
      return base + Cfg::kOffDrop;
    } else {
      return 0;
    }
  }
  // Cfg::kDropProducer: the mask buffers of parity b are drawn / read.
  JF_DEVICE uint32_t full_drop(int b) const {
    if constexpr (Cfg::kDropProducer) {
      return base + Cfg::kOffDropBar + 8 * b;
    } else {
      return 0;
    }
  }
  JF_DEVICE uint32_t empty_drop(int b) const {
    if constexpr (Cfg::kDropProducer) {
      return base + Cfg::kOffDropBar + 8 * (2 + b);
    } else {
      return 0;
    }
  }
  JF_DEVICE uint32_t bar(int i) const { return base + Cfg::kOffBar + 8 * i; }
  JF_DEVICE uint32_t full_kv() const { return bar(0); }
  JF_DEVICE uint32_t full_q(int s) const { return bar(1 + s); }
  JF_DEVICE uint32_t empty_q(int s) const { return bar(1 + Cfg::kStages + s); }
  JF_DEVICE uint32_t full_do(int s) const { return bar(1 + 2 * Cfg::kStages + s); }
  JF_DEVICE uint32_t empty_do(int s) const { return bar(1 + 2 * Cfg::kStages + Cfg::kStagesDo + s); }
  // The scheduler's data (the claimed tile index, one int), just past the
  // plan, in the 1 KB alignment slack of kSmemAlloc (the dynamic shared
  // memory is at least 16-byte aligned, so base - start <= 1008); it has no
  // barriers.
  JF_DEVICE uint32_t claim_slot() const { return base + Cfg::kSmemBytes; }
  // Cfg::kVarlen: the CTA's decoded tile (kVarlenSlotInts ints).
  JF_DEVICE uint32_t varlen_slot(int i) const {
    if constexpr (Cfg::kVarlen) {
      return base + Cfg::kOffVarlenSlot + 4 * i;
    } else {
      return 0;
    }
  }
};

}  // namespace jax_flash::sm90
