// The softcap kernels of the sm90 forward (FwdTuning::softcap other than
// kRuntime): the tanh form and the fixed exponent offset that replaces the
// running max.
//
// Why no running max: with softcap every logit is softcap * t with t = tanh(.)
// in [-1, 1]. In base 2, x = c t with c = softcap * log2(e) (SoftmaxScale::
// scale_log2), so with a fixed offset M every p = 2^(x - M) lies in
// [2^(-c - M), 2^(c - M)]. M = max(0, c - kTopLog2) keeps p <= 2^48 (row sums
// of 2^31 keys and their P V products stay far below float's 2^128 for |v| up
// to 2^49) and, while c + M <= kFloorLog2 (c <= 75: softcap <= 52; Gemma 2's
// attention softcap is 50), p >= 2^-102: no p is flushed by ex2.approx.ftz or
// the FTZ sums (below 2^-126), so every key counts as with the running max. O
// and l scale together, so O / l is the same; LSE = M ln 2 + log(l). This
// removes per block the row max (one FMNMX per score and two quad shuffles
// per row), the vote and the rescale of O. P stays in bf16's range (float's
// exponent); fp16's (2^-24 ... 65504) is too narrow for it, so these kernels
// are bf16 only. A larger softcap goes to the production kernel.
#pragma once

#include <cuda_bf16.h>

#include "fwd_tuning.h"
#include "jax_flash/fast_math.cuh"
#include "jax_flash/host_device.h"
#include "jax_flash/softmax_scale.h"
#include "sm90/ptx/common.cuh"

namespace jax_flash::sm90 {

constexpr float kSoftcapTopLog2 = 48.f;
constexpr float kSoftcapFloorLog2 = 102.f;

// M of the top of the file, for c = softcap * log2(e).
JF_HOST_DEVICE float softcap_fixed_offset(float c) { return c > kSoftcapTopLog2 ? c - kSoftcapTopLog2 : 0.f; }
// Whether a fixed offset serves softcap c (c + M <= kFloorLog2).
JF_HOST_DEVICE bool softcap_fixed_max_ok(float softcap) {
  const float c = softcap * kLog2e;
  return softcap > 0.f && c + softcap_fixed_offset(c) <= kSoftcapFloorLog2;
}

// A softcap kernel's per-call constants and its score transform. After
// apply(), scores (and -inf for masked ones, set afterwards) map to
// p = 2^(s * exp_scale - exp_off):
//   kRational, kMufu: s = t, exp_scale = c, exp_off = M;
//   kExp: s = -1 / (1 + e^{2y}) = (t - 1) / 2 (neg_logistic_exp2), so
//         c t - M = 2c s + c - M: exp_scale = 2c, exp_off = M - c, and the
//         tanh's own 1 - 2r costs no instruction.
// The production kernels (kRuntime): nothing per call (softmax.cuh apply_softcap).
struct SoftcapRuntime {
  JF_DEVICE explicit SoftcapRuntime(const SoftmaxScale&) {}
};

template <FwdSoftcap kForm>
struct SoftcapFixedMax {
  static_assert(kForm != FwdSoftcap::kRuntime, "the production kernel's softcap is softmax.cuh apply_softcap");
  float pre;        // score -> the argument of the form
  float exp_scale;  // see above
  float exp_off;
  float m_raw;  // the fixed max as OnlineSoftmax keeps it (raw units: m_raw * scale_eff = M ln 2)

  JF_DEVICE explicit SoftcapFixedMax(const SoftmaxScale& sm) {
    const float c = sm.scale_log2;
    const float m = softcap_fixed_offset(c);
    m_raw = m / c;  // scale_eff = softcap = c ln 2
    if constexpr (kForm == FwdSoftcap::kExp) {
      pre = sm.softcap_pre * (2.f * kLog2e);
      exp_scale = 2.f * c;
      exp_off = m - c;
    } else {
      pre = sm.softcap_pre;
      exp_scale = c;
      exp_off = m;
    }
  }

  template <int NR>
  JF_DEVICE void apply(float (&s)[NR]) const {
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const float x = s[i] * pre;
      if constexpr (kForm == FwdSoftcap::kRational) s[i] = tanh_approx(x);
      if constexpr (kForm == FwdSoftcap::kExp) s[i] = neg_logistic_exp2(x);
      if constexpr (kForm == FwdSoftcap::kMufu) s[i] = tanh_mufu(x);
    }
  }
};

}  // namespace jax_flash::sm90
