// Tuning of the sm90 forward: the typed configuration every forward kernel is
// built from, and the ONE policy that picks the production configuration per
// head-dim bucket and mask (the role of FA3's hopper/tile_size.h).
//
// The extension compiles only fwd_default_tuning()'s configurations and,
// for softcap calls, fwd_softcap_tuning()'s (launch_templates.cuh). Other
// configurations are ablations: the sm90 self-test / benchmark binary
// instantiates its own list of them (cuda/tests/sm90_fwd_ablation.h), nothing
// in the production path can reach them.
#pragma once

#include "jax_flash/fp8_scheme.h"

namespace jax_flash::sm90 {

// How a forward kernel serves softcap (scores -> softcap * tanh(scores /
// softcap)). kRuntime: one kernel for calls with and without it, a run-time
// branch before the mask, tanh as XLA's rational (tanh_rational.h), the
// running max (the production kernels). The others are kernels for softcap
// calls only, with a fixed exponent offset in place of the running max
// (sm90/fwd/softcap.cuh: the logits are bounded by the softcap, so no row
// max, no quad shuffles, no O rescale); they differ in the tanh:
//   kRational: the rational (accurate to a couple of ulps);
//   kExp: 1 - 2 / (1 + e^{2y}), ex2 + rcp (absolute error about 2^-22);
//   kMufu: tanh.approx.f32 (FlashAttention-3's; relative error 2^-11).
// (tanh.approx.bf16x2 / f16x2 would not halve the MUFU work on sm_90: ptxas
// 13.0 splits each into two MUFU.TANH.BF16 / .F16 ops and a PRMT.)
enum class FwdSoftcap : int { kRuntime = 0, kRational, kExp, kMufu };

struct FwdTuning {
  // Tile: kBlockM = 64 * consumer_wgs query rows (one wgmma M = 64 per
  // consumer warpgroup, FA3's AtomLayoutQK) x block_n keys, `stages` K and V
  // stages in the TMA ring.
  int block_n;
  int consumer_wgs;
  int stages;
  // Inter-warpgroup "pingpong": named barriers hand the tensor cores from one
  // consumer warpgroup to the next, so one WG's GEMMs run during the other's
  // softmax.
  bool pingpong;
  // Intra-warpgroup overlap: the softmax of block n runs while the PV GEMM of
  // block n + 1 and the QK^T GEMM of block n - 1 are in flight. Without it the
  // mainloop is serial (QK^T, wait, softmax, PV, wait).
  bool overlap;
  // S = Q K^T as wgmma RS: each consumer WG reads its Q rows into registers
  // once per tile instead of every QK^T wgmma reading them from shared memory
  // (a third less shared-memory operand traffic for that GEMM; energy per FLOP
  // at the power cap). Needs `overlap` (ptxas 13.0 miscompiles it in the
  // serial schedule, mainloop.cuh) and an O tile of its own.
  bool q_in_regs;
  // Lazy rescaling (softmax.cuh update_lazy): the running max moves only when
  // a block exceeds it by more than 2^8 in p, and O is rescaled only when some
  // row of the warp moved. false: O rescaled after every block (update).
  bool lazy_rescale;
  // The epilogue stages O in the V ring (FA3: smem_o aliases smem_v) instead of
  // its own tile / the Q tile: the next tile's Q and K then load during the
  // epilogue.
  bool o_in_v;
  // DynamicPersistentTileScheduler (atomic tile counter, LPT order) instead of
  // StaticPersistentTileScheduler (tile_scheduler.cuh).
  bool dynamic_scheduler;
  // Not a knob but the kind of call: packed sequences (segment ids with their
  // tile spans, jax_flash/mask_info.h): key ranges and masks from the spans,
  // and the packed tile order. A kernel of its own, so that the code and the
  // registers of the other kernels stay as they are.
  bool packed;
  // Also the kind of call: attention dropout on P (jax_flash/philox.h), drawn
  // per block while its GEMMs run.
  bool dropout;
  // Also the kind of call: variable-length sequences (cu_seqlens; the
  // varlen kernel, fwd_varlen_kernel.cuh): each tile one sequence's query
  // block, loads at the sequence's offsets, rows stored up to its end.
  bool varlen;
  // Dropout: the keep mask drawn by warps 1..3 of the producer warpgroup
  // into a bit mask in shared memory (drop_mask.h), read by the consumers,
  // instead of each consumer thread running the generator for its own
  // elements (mainloop.cuh).
  bool dropout_producer_mask;
  // 0, or every exp2_poly_every-th exponential of the softmax computed on the
  // FMA pipe instead of the MUFU unit (softmax.cuh kPolyEvery).
  int exp2_poly_every;
  // The polynomial of those exponentials: 3 (exp2_poly3, relative error
  // 1e-4: below P's rounding, above the LSE's tolerance) or 5 (exp2_poly5,
  // 1.6e-7).
  int exp2_poly_degree = 3;
  // See FwdSoftcap.
  FwdSoftcap softcap = FwdSoftcap::kRuntime;

  constexpr int block_m() const { return 64 * consumer_wgs; }
};

// The production configuration. Measured on the H200 (B=2, T=S=8192, bf16;
// benchmarks/NOTES.md):
// - tiles as FA3 for bf16/fp16 (hopper/tile_size.h): hdim 64: 192 x 128 with
//   three consumer WGs (FA3 uses 192 x 192 when not causal; that spills at
//   160 registers here); hdim 128: 128 x 128 (128 x 176 / 192 were within
//   the noise); hdim 256: 128 x 80 (224 KB of shared memory); the head-dim
//   pair 192 / 128 (DeepSeek MLA): 128 x 128 (Q 48 KB, K 2 x 48 KB, V 2 x
//   32 KB: 208 KB; FA3 takes 112 keys only when D_v > 128).
// - pingpong + overlap for hdim <= 128, overlap only above (FA3's choices:
//   its scheduler barrier needs kHeadDim <= 128, the query/key one).
// - Q in registers where its 32 registers fit: the hdim-128 x 128 tile
//   (R237 of 240; 256 would need 64, the pair's 192 would need 48); +2.6%
//   at the power cap.
// - lazy rescaling everywhere: +6.5% at the power cap at hdim 128.
// - causal-like masks (right bound, no left bound): the dynamic scheduler
//   (+13% at hdim 128, +3% at 64) and, above hdim 128, O in the V ring (+30%
//   together at hdim 256; the static heaviest-first order leaves SMs idle at
//   the end). Without such a mask O in the V ring is -8% at hdim 256; there
//   O goes to the Q tile (no room for a tile of its own at hdim 256 or at the
//   pair's 128 x 128).
//
// 8-bit inputs (element_bytes = 1, the FP8 forward): FA3's FP8 tiles
// (hopper/tile_size.h, element size 1): hdim 128: 128 x 224 (causal or not),
// hdim 64: 192 x 160, hdim 256: 128 x 128. At 128 x 128 the tile's fixed
// costs per KV block (barrier hand-offs, row statistics, pipeline bubbles)
// were not amortised at FP8's doubled GEMM rate (H200 ncu at hdim 128: tensor
// pipe ~46% busy). The KV tile is also the K descale block (fp8_scheme.h,
// asserted below). Shared memory at hdim 128: Q 16 KB, K and V 2 x 28 KB
// each, V^T 2 x 32 KB (whole 128-key atoms), O 32 KB: 224 KB. Registers
// (ptxas 13.0): the consumer spills 44 bytes at hdim 128 (S 112, P 28, O 64
// registers of 240; with mainloop.cuh kFirstPVZeroes) and 52 at hdim 64 (of
// 160), in a tile's first KV block and its bookkeeping: none in the KV loop.
// No pingpong
// (FA3 takes it from hdim 128 up; on the H200 the FP8 kernel ran 0.5-1.2 %
// faster without it at hdim 128 and 0.7 % at 256, and 3 % slower with it at
// 64: cuda/tests/bench_fp8_sm90.cu), no Q in registers (16-bit fragments only); O
// staged in the V ring at hdim 256 (the V^T ring leaves no room for an O tile
// of its own, and O is 16-bit: twice Q's tile); the 16-bit choices otherwise.
//
// Dropout: whole 64-key chunks per KV block (one Philox call covers a row's
// 64 keys): 128 x 64 tiles at hdim 256. Where the keep mask is drawn, and Q
// in registers with it: fwd_dropout_draw below.
//
// head_dim is the query/key head dim (a bucket, or the first of a head-dim
// pair), head_dim_v the value one (the bucket again, or the pair's second).
// Dropout's keep mask drawn by each consumer thread (production) or by the
// producer warpgroup into shared memory (FwdTuning::dropout_producer_mask,
// the ablation drop-alt). On the H200 the producer's mask ran the hdim-64
// dropout forward at half the speed of the one without dropout (250 vs 522
// TF/s, B=2 T=8k: a 52 % cost, where the consumers' own draw costs 23-38 %
// at the buckets), and with two consumer
// WGs its register budgets (32 / 240) exceeded the CTA's launch allocation,
// so the consumers' setmaxnreg.inc never returned (now 32 / 232, asserted in
// fwd_kernel.cuh; not yet rerun).
constexpr bool kFwdDropoutProducerMask = false;

// A dropout configuration with its keep mask drawn by the producer
// warpgroup or by the consumers. Drawn by the consumers, the block's Philox
// output (4 words per 64 keys and row) is live across the GEMMs: Q cannot
// stay in registers. From the producer's bit mask a consumer holds one word
// per 64 keys: Q in registers where the policy puts it without dropout
// (hdim 128: no spills, ptxas 13.0).
constexpr FwdTuning fwd_dropout_draw(FwdTuning t, int head_dim, bool producer_mask) {
  t.dropout_producer_mask = producer_mask;
  t.q_in_regs = producer_mask && head_dim == 128;
  return t;
}

constexpr FwdTuning fwd_default_tuning(int head_dim, int head_dim_v, bool causal_like,
                                       int element_bytes = 2, bool packed = false,
                                       bool dropout = false) {
  FwdTuning t{};
  t.packed = packed;
  t.dropout = dropout;
  t.block_n = head_dim <= 192 ? (head_dim_v <= 128 ? 128 : 112) : 80;
  t.consumer_wgs = head_dim == 64 ? 3 : 2;
  t.stages = 2;
  t.pingpong = head_dim <= 128;
  t.overlap = true;
  t.q_in_regs = head_dim == 128;
  t.lazy_rescale = true;
  t.o_in_v = causal_like && head_dim > 128;
  t.dynamic_scheduler = causal_like;
  if (element_bytes == 1) {
    t.block_n = head_dim == 64 ? 160 : head_dim == 128 ? 224 : 128;
    t.consumer_wgs = head_dim == 64 ? 3 : 2;
    t.pingpong = false;
    t.q_in_regs = false;
    t.o_in_v = head_dim == 256;
  }
  if (dropout) {
    if (head_dim == 256) t.block_n = 64;
    t = fwd_dropout_draw(t, head_dim, kFwdDropoutProducerMask);
  }
  return t;
}

// hdim 64, causal-like masks, short queries: 128-row tiles with 2 consumer
// warpgroups in place of FA3's 192 / 3. The last query tile wastes less (T =
// 512: 3 tiles of 192 rows hold 576, 4 of 128 hold 512) and a sequence has
// more tiles. On the H200 (selftest_sm90 --bench d64, B*T = 16k, H = 32,
// causal; the ablation d64-wg2): +11 % at T = 512 and 1k, -15 % at 8k.
constexpr int kFwdShortCausalMaxSeqlenQ = 1024;
constexpr bool fwd_short_causal(int head_dim, int head_dim_v, bool causal_like, int seqlen_q) {
  return head_dim == 64 && head_dim_v == 64 && causal_like && seqlen_q <= kFwdShortCausalMaxSeqlenQ;
}
constexpr FwdTuning fwd_short_causal_tuning(int head_dim, int head_dim_v) {
  FwdTuning t = fwd_default_tuning(head_dim, head_dim_v, /*causal_like=*/true);
  t.consumer_wgs = 2;
  return t;
}
template <int kHeadDim, int kHeadDimV>
struct ShortCausalFwdTuning {
  static constexpr FwdTuning value = fwd_short_causal_tuning(kHeadDim, kHeadDimV);
};

// The FP8 KV tile is the scheme's K descale block (one descale per KV block).
static_assert(fwd_default_tuning(64, 64, false, 1).block_n == fp8_k_block(64) &&
                  fwd_default_tuning(64, 64, true, 1).block_n == fp8_k_block(64) &&
                  fwd_default_tuning(128, 128, false, 1).block_n == fp8_k_block(128) &&
                  fwd_default_tuning(128, 128, true, 1).block_n == fp8_k_block(128) &&
                  fwd_default_tuning(256, 256, false, 1).block_n == fp8_k_block(256) &&
                  fwd_default_tuning(256, 256, true, 1).block_n == fp8_k_block(256),
              "the FP8 policy's KV tile must be the scheme's K descale block (fp8_scheme.h)");

// A configuration as a type (the kernel's template parameter; C++17 has no
// class-type template parameters): any struct with a `static constexpr
// FwdTuning value`.
template <int kHeadDim, int kHeadDimV, bool kCausalLike, int kElementBytes = 2, bool kPacked = false,
          bool kDropout = false>
struct DefaultFwdTuning {
  static constexpr FwdTuning value =
      fwd_default_tuning(kHeadDim, kHeadDimV, kCausalLike, kElementBytes, kPacked, kDropout);
};

// Softcap calls (bf16, a head-dim bucket, not packed, no dropout, softcap <=
// 52: softcap.cuh softcap_fixed_max_ok): the softcap kernels, the default's
// tile and schedule with the fixed max and tanh as 1 - 2 / (1 + e^{2y}) in
// place of the run-time branch, the rational and the running max. Per KV
// block of 128 keys at hdim 128 and consumer warp (ptxas 13.0, the unmasked
// path): 620 SASS instructions and 192 MUFU ops, against 1487 and 130 for the
// run-time branch (461 and 66 without softcap). On the H200 the form e^{2y}
// + reciprocal with the running max cost 35 % of the speed without softcap,
// the rational 45 %, these kernels 32 % (D=128, T=8k, softcap 50;
// benchmarks/NOTES.md, softcap). Moving softmax
// exponentials to the FMA pipe (sc-exp-p4 / -p2 / -p1) trades MUFU ops for
// issue slots (p2: 909 and 160) and spills in the KV loop at hdim 64 (three
// consumer warpgroups, 160 registers). The alternatives are the sc-*
// ablations (cuda/tests/sm90_fwd_ablation.h, selftest_sm90 --bench
// --softcap=50).
constexpr FwdTuning fwd_softcap_tuning(int head_dim, bool causal_like) {
  FwdTuning t = fwd_default_tuning(head_dim, head_dim, causal_like);
  t.softcap = FwdSoftcap::kExp;
  return t;
}
template <int kHeadDim, bool kCausalLike>
struct SoftcapFwdTuning {
  static constexpr FwdTuning value = fwd_softcap_tuning(kHeadDim, kCausalLike);
};

// The varlen forward of a bucket or pair: the production tile and knobs of
// its mask (the tiles' costs and shapes are those of one sequence).
constexpr FwdTuning fwd_varlen_tuning(int head_dim, int head_dim_v, bool causal_like) {
  FwdTuning t = fwd_default_tuning(head_dim, head_dim_v, causal_like);
  t.varlen = true;
  return t;
}
template <int kHeadDim, int kHeadDimV, bool kCausalLike>
struct VarlenFwdTuning {
  static constexpr FwdTuning value = fwd_varlen_tuning(kHeadDim, kHeadDimV, kCausalLike);
};

// Which masks count as causal-like for the policy (a right bound without a
// left bound: heavy-tailed tile costs).
constexpr bool fwd_causal_like(int window_left, int window_right) {
  return window_right >= 0 && window_left < 0;
}

}  // namespace jax_flash::sm90
