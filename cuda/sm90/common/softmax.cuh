// Online softmax on wgmma accumulator fragments (sm90 forward).
//
// A consumer thread holds 2 rows of the warpgroup's 64 x N score tile:
// s[4j + 2h + e] is row h (0: g, 1: g + 8), column 8j + 2t + e; the 4 lanes
// of a quad (same g) share a row, so row reductions are 2 xor-shuffles.
//
// Units: scores stay raw (s = q.k, or tanh(scale * q.k / softcap) with
// softcap); logit = s * scale_eff; exponentials in base 2 with scale_eff *
// log2(e) folded in (scale_log2, which a caller may vary per KV block: the FP8
// path folds its block descales into it). The running max is kept in the
// scaled log2 domain, m = max(s * scale_log2), so that blocks with different
// scales compare correctly:
//   p = 2^(s * scale_log2 - m + offset)    (one FFMA + one MUFU.EX2)
// offset (ElementTraits::kPOffsetLog2) moves P into the range of the P
// operand's type (0 for 16-bit P; 8 for e4m3 P, FA3's max offset: p <= 256);
// l, O and the LSE carry the same factor, which finalize() removes.
// The row sum l is kept per thread (the quad reduction is deferred to the
// end: rescaling is linear), and O is divided by l once, at the end.
//
// Lazy (conditional) rescaling (update_lazy, FA4-style; the forward's softmax;
// update() is the eager form, FwdTuning::lazy_rescale = false, an ablation):
// the running max m is raised only when a block's row max exceeds it by more
// than `threshold` (ElementTraits::kLazyThresholdLog2: 8 for 16-bit P, where
// p <= 2^8 is safe in the fp32 sums and in bf16/fp16; 0 for e4m3 P, whose
// range the offset already uses), otherwise alpha = 1 and the rescale of O is
// skipped for the whole warp when none of its rows moved its max. l and O
// always share the same (possibly stale) m, so O / l and
// LSE = ln2 * (m + log2(l) - offset) stay exact. Why: at the power cap
// (sustained runs) fewer instructions per FLOP is higher clocks: +6.5% at hdim
// 128 (selftest_sm90 --bench --launches=300, benchmarks/NOTES.md).
#pragma once

#include <cmath>

#include "jax_flash/fast_math.cuh"
#include "jax_flash/sinks.h"
#include "jax_flash/softmax_scale.h"
#include "sm90/ptx/common.cuh"

namespace jax_flash::sm90 {

constexpr float kLog2e = 1.4426950408889634f;

// exp2_approx, tanh_approx: jax_flash/fast_math.cuh (shared with sm80).
JF_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
JF_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Softcap: s <- tanh(s * pre), pre = scale / softcap (then scale_eff = softcap).
template <int NR>
JF_DEVICE void apply_softcap(float (&s)[NR], float pre) {
#pragma unroll
  for (int i = 0; i < NR; ++i) s[i] = tanh_approx(s[i] * pre);
}

constexpr float kLn2 = 0.6931471805599453f;

// Max of row h (0 or 1) of the thread's fragment as a balanced tree (depth
// log2(NR / 2) instead of NR / 4 + 1 for a linear chain, which ptxas keeps
// as written); update() keeps its linear chain.
template <int NR>
JF_DEVICE float row_max_tree(const float (&s)[NR], int h) {
  constexpr int kP = NR / 4;  // column pairs of the row
  float v[kP];
#pragma unroll
  for (int j = 0; j < kP; ++j) v[j] = fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]);
#pragma unroll
  for (int stride = 1; stride < kP; stride *= 2)
#pragma unroll
    for (int j = 0; j + stride < kP; j += 2 * stride) v[j] = fmaxf(v[j], v[j + stride]);
  return v[0];
}

// kOffsetLog2 / kThresholdLog2: see the top of the file. kScaledMax: keep m
// in the scaled log2 domain (needed when scale_log2 varies per block); with
// one scale per call m stays raw (s units) and is scaled where used, which is
// the same arithmetic with the multiplications placed where the 16-bit
// kernels were tuned.
// (Integers: C++17 has no floating-point template parameters.)
// kPolyEvery: 0, or every kPolyEvery-th exponential of a row (by column
// pair order) on the FMA pipe (exp2_poly3, or exp2_poly5 with kPolyDegree 5;
// fast_math.cuh) instead of MUFU.
template <int kOffsetLog2_ = 0, int kThresholdLog2_ = 8, bool kScaledMax = false, int kPolyEvery = 0,
          int kPolyDegree = 3>
struct OnlineSoftmaxT {
  static constexpr float kOffsetLog2 = float(kOffsetLog2_);
  static constexpr float kThresholdLog2 = float(kThresholdLog2_);
  static_assert(kScaledMax || kOffsetLog2_ == 0, "an offset needs the scaled max");
  float m[2];  // running max (kScaledMax: of s * scale_log2; else of s), -inf while no visible key
  float l[2];  // this thread's partial row sum

  // Whether the i-th exponential of a row goes to the FMA pipe (kPolyEvery).
  static constexpr bool on_fma_pipe(int i) {
    return kPolyEvery > 0 && i % (kPolyEvery > 0 ? kPolyEvery : 1) == kPolyEvery - 1;
  }

  // Row h of s becomes p = 2^(s * scale_log2 - m_off) in place; returns the
  // thread's partial sum of the row.
  template <int NR>
  JF_DEVICE static float exp_row(float (&s)[NR], int h, float scale_log2, float m_off) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < NR / 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = fmaf(s[4 * j + 2 * h + e], scale_log2, -m_off);
        const float p = !on_fma_pipe(2 * j + e) ? exp2_approx(x)
                        : kPolyDegree == 5      ? exp2_poly5(x)
                                                : exp2_poly3(x);
        s[4 * j + 2 * h + e] = p;
        sum += p;
      }
    return sum;
  }
  // The exponent's subtrahend of a row with (scaled) running max m: a row with
  // no visible key so far (m = -inf) takes 0, so p = 2^-inf = 0 (never
  // -inf - -inf = NaN).
  JF_DEVICE static float exp_offset(float m) {
    const float base = m == -INFINITY ? 0.f : m;
    if constexpr (kOffsetLog2_ == 0) return base;
    return base - kOffsetLog2;
  }

  JF_DEVICE void init() {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }

  // Folds one block of scores in: s becomes p in place; returns in alpha the
  // factor by which O (and l, done here) must be rescaled. A row with no
  // visible key so far keeps m = -inf (p = 0 and alpha = 2^(-inf) = 0; O and l
  // are 0 then anyway).
  template <bool kFirst, int NR>
  JF_DEVICE void update(float (&s)[NR], float scale_log2, float (&alpha)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kScaledMax) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < NR / 4; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
        const float m_new = kFirst ? quad_max(mx) * scale_log2 : fmaxf(m[h], quad_max(mx) * scale_log2);
        alpha[h] = kFirst ? 1.f : exp2_approx(m[h] - (m_new == -INFINITY ? 0.f : m_new));
        m[h] = m_new;
        const float sum = exp_row(s, h, scale_log2, exp_offset(m_new));
        l[h] = kFirst ? sum : fmaf(l[h], alpha[h], sum);
      } else {
        float mx = kFirst ? -INFINITY : m[h];
#pragma unroll
        for (int j = 0; j < NR / 4; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
        mx = quad_max(mx);
        const float m_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
        alpha[h] = kFirst ? 1.f : exp2_approx(m[h] * scale_log2 - m_scaled);
        m[h] = mx;
        const float sum = exp_row(s, h, scale_log2, m_scaled);
        l[h] = kFirst ? sum : fmaf(l[h], alpha[h], sum);
      }
    }
  }

  // update() with lazy rescaling (see the top of the file). Returns whether
  // O must be rescaled by alpha: the same for every lane of the warp (false
  // for the first block); when false, alpha = {1, 1} and no exp2 was spent on
  // it. A row whose max is still -inf takes any finite block max (x > -inf);
  // a row and block both without visible keys keep m = -inf (p = 0, alpha =
  // 2^-inf = 0 as in update()); the comparison never forms inf - inf.
  template <bool kFirst, int NR>
  JF_DEVICE bool update_lazy(float (&s)[NR], float scale_log2, float (&alpha)[2]) {
    float m_old[2], m_off[2];  // scaled: the old max; raw max: the exponent's subtrahend
    bool raise[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mx = quad_max(row_max_tree(s, h));
      if constexpr (kScaledMax) {
        m_old[h] = m[h];
        raise[h] = kFirst || fmaf(mx, scale_log2, -kThresholdLog2) > m[h];
        if (raise[h]) m[h] = mx * scale_log2;
      } else {
        m_old[h] = m[h] * scale_log2;
        raise[h] = kFirst || fmaf(mx, scale_log2, -kThresholdLog2) > m_old[h];
        if (raise[h]) m[h] = mx;
        m_off[h] = m[h] == -INFINITY ? 0.f : m[h] * scale_log2;
      }
    }
    alpha[0] = alpha[1] = 1.f;
    bool rescale = false;
    if constexpr (!kFirst) {
      rescale = __any_sync(0xffffffffu, raise[0] || raise[1]);
      if (rescale) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (kScaledMax) {
            alpha[h] = raise[h] ? exp2_approx(m_old[h] - m[h]) : 1.f;
          } else {
            alpha[h] = raise[h] ? exp2_approx(m_old[h] - m_off[h]) : 1.f;
          }
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = exp_row(s, h, scale_log2, kScaledMax ? exp_offset(m[h]) : m_off[h]);
      l[h] = kFirst ? sum : fmaf(l[h], alpha[h], sum);
    }
    return rescale;
  }

  // The softcap kernels' softmax (sm90/fwd/softcap.cuh): a fixed offset
  // instead of the running max, so s becomes p = 2^(s * exp_scale - exp_off)
  // in place and only the row sums move; set_fixed_max() first (before any
  // block; a tile without blocks keeps m = -inf: lse = -inf, O = 0).
  JF_DEVICE void set_fixed_max(float m_raw) { m[0] = m[1] = m_raw; }
  template <bool kFirst, int NR>
  JF_DEVICE void update_fixed(float (&s)[NR], float exp_scale, float exp_off) {
    static_assert(!kScaledMax, "16-bit softcap kernels only");
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = exp_row(s, h, exp_scale, exp_off);
      l[h] = kFirst ? sum : l[h] + sum;
    }
  }

  // Natural-log LSE of the thread's 2 rows and the 1/l factor for O; rows that
  // saw no visible key: inv = 0 (O = 0), lse = -inf. scale_eff: the call's
  // logit scale (SoftmaxScale), for the raw max. sink: the head's sink logit
  // (jax_flash/sinks.h; -inf: none), then an empty row's LSE is the sink.
  JF_DEVICE void finalize(float scale_eff, float (&inv)[2], float (&lse)[2],
                          float sink = -INFINITY) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(l[h]);
      // The natural-log max that l and O are relative to.
      const float m_ln = kScaledMax ? (kOffsetLog2_ == 0 ? m[h] : m[h] - kOffsetLog2) * kLn2 : m[h] * scale_eff;
      if (sink != -INFINITY) {  // uniform: one sink per (batch, head)
        finish_row_with_sink(m_ln, sum, sink, lse[h], inv[h]);
        continue;
      }
      // Without a sink: the same result in fewer instructions (1 / sum).
      const bool empty = !(sum > 0.f);
      inv[h] = empty ? 0.f : 1.f / sum;
      lse[h] = empty ? -INFINITY : m_ln + __logf(sum);
    }
  }
};
using OnlineSoftmax = OnlineSoftmaxT<>;  // 16-bit P, one scale per call

// O (64 x D fragment) *= per-row factor.
template <int NR>
JF_DEVICE void rescale_rows(float (&o)[NR], const float (&f)[2]) {
#pragma unroll
  for (int j = 0; j < NR / 4; ++j) {
    o[4 * j + 0] *= f[0];
    o[4 * j + 1] *= f[0];
    o[4 * j + 2] *= f[1];
    o[4 * j + 3] *= f[1];
  }
}

}  // namespace jax_flash::sm90
