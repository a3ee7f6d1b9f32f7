// The sm90 forward's tuning / ablation target: configurations other than the
// production one (fwd_tuning.h fwd_default_tuning), compiled only into the
// self-test / benchmark binary (tools/build/build_sm90_tests.sh), never into the
// extension. Each ablation changes the production configuration of every
// (head-dim bucket or pair, mask) in one way (a dropout ablation: of the
// dropout kernels, run on calls with dropout; the others on calls without);
// where that changes nothing (e.g.
// "no pingpong" at hdim 256, which has none) or does not apply, it is absent
// ('-' in the tables) rather than a copy of the default.
//
//   selftest_sm90 --list          the ablations and where each exists
//   selftest_sm90 --bench ...     TF/s of every ablation beside the default
#pragma once

#include <cuda_runtime.h>

#include "jax_flash/params.h"
#include "sm90/fwd/fwd_tuning.h"
#include "sm90/fwd/softcap.cuh"
#include "sm90/launch.h"
#include "sm90/common/mask.cuh"
#include "sm90/common/smem_layout.cuh"

namespace jax_flash::sm90::ablation {

using FwdLaunch = cudaError_t (*)(const FwdParams&, cudaStream_t);

// How an ablation changes a production configuration.
constexpr FwdTuning keep(FwdTuning t, int) { return t; }
constexpr FwdTuning no_pingpong(FwdTuning t, int) {
  t.pingpong = false;
  return t;
}
// The serial mainloop; Q stays in shared memory there (ptxas miscompiles Q in
// registers in the serial schedule, mainloop.cuh).
constexpr FwdTuning no_overlap(FwdTuning t, int) {
  t.overlap = false;
  t.q_in_regs = false;
  return t;
}
constexpr FwdTuning no_pingpong_no_overlap(FwdTuning t, int d) { return no_overlap(no_pingpong(t, d), d); }
constexpr FwdTuning q_in_smem(FwdTuning t, int) {
  t.q_in_regs = false;
  return t;
}
constexpr FwdTuning eager_rescale(FwdTuning t, int) {
  t.lazy_rescale = false;
  return t;
}
constexpr FwdTuning static_scheduler(FwdTuning t, int) {
  t.dynamic_scheduler = false;
  return t;
}
// O staging: the V ring where the default has the Q tile, and back. Only
// above hdim 128 (256 and the pair 192 / 128), where the choice depends on
// the mask.
constexpr FwdTuning toggle_o_in_v(FwdTuning t, int head_dim) {
  if (head_dim > 128) t.o_in_v = !t.o_in_v;
  return t;
}
// Pingpong where the default has none (above hdim 128, FA3's rule).
constexpr FwdTuning with_pingpong(FwdTuning t, int) {
  t.pingpong = true;
  return t;
}
// The pair 192 / 128: 112-key tiles (FA3's for D_v > 128), where O fits in a
// tile of its own (Q 48 + K 2 x 42 + V 2 x 28 + O 32 KB = 220 KB), so the next
// tile's Q loads during the epilogue and the V ring is never O's.
constexpr FwdTuning pair_n112_own_o(FwdTuning t, int head_dim) {
  if (head_dim == 192) {
    t.block_n = 112;
    t.o_in_v = false;
  }
  return t;
}

// hdim 64 on 128-row tiles (2 consumer warpgroups) instead of FA3's 192:
// short causal sequences waste less of their last query tile (T = 512: 3
// tiles of 192 rows hold 576, 4 of 128 hold 512) and give more CTAs.
constexpr FwdTuning d64_two_wgs(FwdTuning t, int head_dim) {
  if (head_dim == 64) t.consumer_wgs = 2;
  return t;
}

// A quarter of the softmax's exponentials on the FMA pipe (exp2_poly3)
// instead of the MUFU unit.
constexpr FwdTuning exp2_poly4(FwdTuning t, int) {
  t.exp2_poly_every = 4;
  return t;
}

// The softcap kernels (FwdTuning::softcap, sm90/fwd/softcap.cuh) of the
// buckets 64, 128 and 256; they serve softcap calls only (softcap_fixed_max_ok).
template <FwdSoftcap kForm, int kPolyEvery = 0>
constexpr FwdTuning softcap_kernel(FwdTuning t, int head_dim) {
  if (head_dim == 64 || head_dim == 128 || head_dim == 256) {
    t.softcap = kForm;
    if (kPolyEvery > 0) {
      t.exp2_poly_every = kPolyEvery;
      t.exp2_poly_degree = 5;
    }
  }
  return t;
}

// Dropout: the keep mask drawn the other way (the producer warpgroup's bit
// mask in shared memory <-> each consumer thread's own generator), with
// what fwd_dropout_draw ties to it (Q in registers at hdim 128 with the bit
// mask).
constexpr FwdTuning toggle_dropout_mask(FwdTuning t, int head_dim) {
  return fwd_dropout_draw(t, head_dim, !t.dropout_producer_mask);
}

struct FwdAblation {
  const char* name;  // table column
  const char* what;
  FwdTuning (*modify)(FwdTuning, int head_dim);
  // Outside the project's error criterion by design (a timing point; the
  // self-test holds it to looser tolerances and reports the criterion).
  bool approximate = false;
  // The production configuration without softcap kernels (the run-time
  // softcap branch, fwd_default_tuning), on the softcap calls the softcap
  // kernels would serve: what softcap calls ran before them.
  bool softcap_branch = false;
  bool dropout = false;  // an ablation of the dropout kernels (calls with dropout only)
};
// Index 0 is the production kernel, launched through jax_flash::sm90::run_fwd.
inline constexpr FwdAblation kFwdAblations[] = {
    {"default", "the production configuration (fwd_default_tuning), via run_fwd", keep},
    {"no-pp", "without the inter-warpgroup pingpong", no_pingpong},
    {"no-ov", "without the intra-warpgroup overlap (serial mainloop, Q in shared memory)", no_overlap},
    {"neither", "without pingpong and without overlap", no_pingpong_no_overlap},
    {"q-smem", "Q read from shared memory by every QK^T wgmma (where the default has Q in registers)",
     q_in_smem},
    {"eager", "O rescaled after every KV block (no lazy rescaling)", eager_rescale},
    {"static", "static persistent scheduler (where the default is the dynamic one: causal-like masks)",
     static_scheduler},
    {"o-in-v", "hdim 256, 192/128: O staged in the V ring toggled (the default stages it there for "
     "causal-like masks)", toggle_o_in_v},
    {"pp", "with the inter-warpgroup pingpong where the default has none (hdim 256, 192/128)",
     with_pingpong},
    {"n112", "192/128: 128 x 112 tiles, O in a tile of its own", pair_n112_own_o},
    {"d64-wg2", "hdim 64 on 128-row tiles, 2 consumer warpgroups (the default: 192 rows, 3)", d64_two_wgs},
    {"poly4", "every 4th exponential of the softmax on the FMA pipe (exp2_poly3)", exp2_poly4},
    {"sc-branch", "softcap calls on the kernel without softcap kernels (run-time branch, rational tanh, "
     "running max)", keep, false, true},
    {"sc-rat", "softcap kernel, fixed max: the rational tanh", softcap_kernel<FwdSoftcap::kRational>},
    {"sc-exp", "softcap kernel, fixed max: tanh = 1 - 2 / (1 + e^2y) (ex2 + rcp)",
     softcap_kernel<FwdSoftcap::kExp>},
    {"sc-exp-p4", "sc-exp with every 4th softmax exponential on the FMA pipe (exp2_poly5)",
     softcap_kernel<FwdSoftcap::kExp, 4>},
    {"sc-exp-p2", "sc-exp with every 2nd softmax exponential on the FMA pipe (exp2_poly5)",
     softcap_kernel<FwdSoftcap::kExp, 2>},
    {"sc-exp-p1", "sc-exp with every softmax exponential on the FMA pipe (exp2_poly5)",
     softcap_kernel<FwdSoftcap::kExp, 1>},
    {"sc-mufu", "softcap kernel, fixed max: tanh.approx.f32 (FA3's; outside the error criterion)",
     softcap_kernel<FwdSoftcap::kMufu>, true},
    {"drop-alt", "dropout calls: the keep mask drawn the other way (producer bit mask in shared memory, "
     "hdim 128 with Q in registers <-> each consumer thread's own Philox)", toggle_dropout_mask, false, false, true},
    {"drop-qsm", "dropout calls: Q read from shared memory where the default dropout kernel has it in "
     "registers", q_in_smem, false, false, true},
};
constexpr int kNumFwdAblations = int(sizeof(kFwdAblations) / sizeof(kFwdAblations[0]));

constexpr bool same_tuning(const FwdTuning& a, const FwdTuning& b) {
  return a.block_n == b.block_n && a.consumer_wgs == b.consumer_wgs && a.stages == b.stages &&
         a.pingpong == b.pingpong && a.overlap == b.overlap && a.q_in_regs == b.q_in_regs &&
         a.lazy_rescale == b.lazy_rescale && a.o_in_v == b.o_in_v &&
         a.dynamic_scheduler == b.dynamic_scheduler && a.exp2_poly_every == b.exp2_poly_every &&
         a.exp2_poly_degree == b.exp2_poly_degree && a.softcap == b.softcap &&
         a.dropout == b.dropout && a.dropout_producer_mask == b.dropout_producer_mask;
}

// The launchers of one bucket or head-dim pair: [ablation][causal_like],
// nullptr where the ablation is the default or repeats an earlier one (a
// dropout ablation: the dropout kernels').
// Defined in fwd_ablation_hdim<d>_sm90.cu (a pair: hdim<d>v<d_v>), one object
// per bucket or pair (bf16 only: the schedule does not depend on the 16-bit
// type).
struct FwdAblationBucket {
  FwdLaunch launch[kNumFwdAblations][2];
};
FwdAblationBucket fwd_ablation_bucket_64();
FwdAblationBucket fwd_ablation_bucket_128();
FwdAblationBucket fwd_ablation_bucket_256();
FwdAblationBucket fwd_ablation_pair_192_128();

inline FwdLaunch fwd_ablation_launcher(int ablation, const FwdParams& p) {
  if (ablation == 0) return &jax_flash::sm90::run_fwd;
  if (ablation < 0 || ablation >= kNumFwdAblations || p.dtype != DType::kBFloat16) return nullptr;
  if (kFwdAblations[ablation].dropout != p.dropout.enabled()) return nullptr;
  static const FwdAblationBucket b64 = fwd_ablation_bucket_64(), b128 = fwd_ablation_bucket_128(),
                                 b256 = fwd_ablation_bucket_256(), mla = fwd_ablation_pair_192_128();
  const FwdAblationBucket* b = nullptr;
  if (p.head_dim_v != p.head_dim) {
    if (p.head_dim == 192 && p.head_dim_v == 128) b = &mla;
  } else {
    const int bucket = Sm90FwdHeadDims::bucket(p.head_dim);
    b = bucket == 64 ? &b64 : bucket == 128 ? &b128 : &b256;
  }
  if (b == nullptr) return nullptr;
  // A softcap kernel serves softcap calls whose softcap a fixed max covers.
  const int hd = p.head_dim_v != p.head_dim ? p.head_dim : Sm90FwdHeadDims::bucket(p.head_dim);
  const FwdTuning t = kFwdAblations[ablation].modify(fwd_default_tuning(hd, p.head_dim_v, false), hd);
  if ((t.softcap != FwdSoftcap::kRuntime || kFwdAblations[ablation].softcap_branch) &&
      !(softcap_fixed_max_ok(p.softcap) && hd != 192))
    return nullptr;
  const MaskInfo mi = make_mask_info(p);
  if (p.dropout.enabled() && mi.q_span != nullptr) return nullptr;  // packed: the default's kernels only
  return b->launch[ablation][fwd_causal_like(mi.wl, mi.wr) ? 1 : 0];
}

// Whether ablation `ablation` exists for this call (and the call is one the
// production forward accepts; the ablations' workspace is the same counter).
inline bool fwd_ablation_available(int ablation, const FwdParams& p) {
  return fwd_ablation_launcher(ablation, p) != nullptr && jax_flash::sm90::fwd_supported(p) &&
         p.sm90_tile_counter != nullptr;
}

inline cudaError_t fwd_ablation_run(int ablation, const FwdParams& p, cudaStream_t stream) {
  const FwdLaunch launch = fwd_ablation_launcher(ablation, p);
  if (launch == nullptr || !jax_flash::sm90::fwd_supported(p)) return cudaErrorNotSupported;
  if (p.batch == 0 || p.seqlen_q == 0) return cudaSuccess;  // as run_fwd: nothing to write
  return launch(p, stream);
}

}  // namespace jax_flash::sm90::ablation
