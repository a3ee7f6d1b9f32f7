// Softmax math on score fragments, written once for the forward (online
// softmax) and the backward (P recomputed from the saved LSE). Mirrors
// jax_flash/_src/softmax.py.
//
// Units. The kernels keep scores "raw": s = q.k (or, with softcap,
// s = tanh(scale * q.k / softcap)). The logit is s * scale_eff with
// scale_eff = scale (or softcap), and every exponential is taken in base 2
// with log2(e) folded into one multiplier, scale_log2 = scale_eff * log2(e):
//   p = 2^(s * scale_log2 - m * scale_log2)     (one FFMA + one MUFU.EX2)
#pragma once

#include <cmath>

#include "jax_flash/sinks.h"
#include "jax_flash/softmax_scale.h"
#include "mma.cuh"

namespace jax_flash::sm80 {

constexpr float kLn2 = 0.6931471805599453f;

// Softcap: s <- tanh(s * pre), pre = scale / softcap. Then scale_eff = softcap.
template <int kMT, int kNT>
JF_DEVICE void apply_softcap(float (&s)[kMT][kNT][4], float pre) {
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[m][n][i] = tanh_approx(s[m][n][i] * pre);
}

// Online softmax state of the rows a lane holds: 2 rows (g, g+8) per m-tile.
// m is the running max in raw units; l is this lane's partial row sum (the
// quad reduction of l is deferred to finalize: rescaling is linear in l).
template <int kMT>
struct OnlineSoftmax {
  float m[kMT][2];
  float l[kMT][2];

  JF_DEVICE void init() {
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m[i][h] = -INFINITY;
        l[i][h] = 0.f;
      }
  }

  // Folds one block of scores into the state: s (masked entries = -inf)
  // becomes p in place, and the output accumulator o is rescaled by
  // 2^((m_old - m_new) * scale_log2). kFirst skips the rescale (o = 0, m = -inf).
  // A row with no visible key so far keeps m = -inf; its exponent offset is
  // taken as 0 so that 2^(-inf - (-inf)) = NaN never happens (p = 2^-inf = 0).
  // kSkipUnraised: the rescale of l and o is skipped for the whole warp when
  // none of its rows raised its max (then every alpha is 1), and rows that
  // did not raise theirs take alpha = 1 exactly (not 2^(m * scale_log2 -
  // round(m * scale_log2)), the rounding residue of the fused form). Saves the
  // O multiplies of most blocks once the max has settled (the decoding
  // kernel's long key ranges).
  template <bool kFirst, bool kSkipUnraised = false, int kNT, int kNTO>
  JF_DEVICE void update(float (&s)[kMT][kNT][4], float (&o)[kMT][kNTO][4], float scale_log2) {
    if constexpr (kSkipUnraised && !kFirst) {
      update_skip_unraised(s, o, scale_log2);
      return;
    }
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m[i][h];
#pragma unroll
        for (int n = 0; n < kNT; ++n) mx = fmaxf(mx, fmaxf(s[i][n][2 * h], s[i][n][2 * h + 1]));
        mx = quad_max(mx);
        const float m_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
        if constexpr (!kFirst) {
          // m_old = -inf gives alpha = 0, correct since o and l are still 0.
          const float alpha = exp2_approx(m[i][h] * scale_log2 - m_scaled);
          l[i][h] *= alpha;
#pragma unroll
          for (int n = 0; n < kNTO; ++n) {
            o[i][n][2 * h] *= alpha;
            o[i][n][2 * h + 1] *= alpha;
          }
        }
        m[i][h] = mx;
        l[i][h] += exp_row(s, i, h, scale_log2, m_scaled);
      }
  }

  template <int kNT, int kNTO>
  JF_DEVICE void update_skip_unraised(float (&s)[kMT][kNT][4], float (&o)[kMT][kNTO][4], float scale_log2) {
    float m_old[kMT][2], m_scaled[kMT][2];
    bool raised = false;
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m[i][h];
#pragma unroll
        for (int n = 0; n < kNT; ++n) mx = fmaxf(mx, fmaxf(s[i][n][2 * h], s[i][n][2 * h + 1]));
        mx = quad_max(mx);
        m_old[i][h] = m[i][h];
        raised |= mx > m_old[i][h];
        m[i][h] = mx;
        m_scaled[i][h] = mx == -INFINITY ? 0.f : mx * scale_log2;
      }
    if (__any_sync(0xffffffffu, raised)) {
#pragma unroll
      for (int i = 0; i < kMT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // m_old = -inf gives alpha = 0, correct since o and l are still 0.
          const float alpha =
              m[i][h] > m_old[i][h] ? exp2_approx(m_old[i][h] * scale_log2 - m_scaled[i][h]) : 1.f;
          l[i][h] *= alpha;
#pragma unroll
          for (int n = 0; n < kNTO; ++n) {
            o[i][n][2 * h] *= alpha;
            o[i][n][2 * h + 1] *= alpha;
          }
        }
    }
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) l[i][h] += exp_row(s, i, h, scale_log2, m_scaled[i][h]);
  }

  // Row (i, h) of s becomes p = 2^(s * scale_log2 - m_scaled) in place;
  // returns the lane's partial sum of the row.
  template <int kNT>
  static JF_DEVICE float exp_row(float (&s)[kMT][kNT][4], int i, int h, float scale_log2, float m_scaled) {
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float p = exp2_approx(fmaf(s[i][n][2 * h + j], scale_log2, -m_scaled));
        s[i][n][2 * h + j] = p;
        sum += p;
      }
    return sum;
  }

  // One division at the end: o /= l. Writes the natural-log LSE of each of the
  // lane's rows into lse[kMT][2]. Rows that saw no visible key (l == 0): o = 0,
  // lse = -inf. sink: the head's sink logit (jax_flash/sinks.h; -inf: none),
  // then an empty row's LSE is the sink.
  template <int kNTO>
  JF_DEVICE void finalize(float (&o)[kMT][kNTO][4], float scale_eff, float (&lse)[kMT][2],
                          float sink = -INFINITY) {
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sum = quad_sum(l[i][h]);
        float inv;
        if (sink != -INFINITY) {  // uniform: one sink per (batch, head)
          finish_row_with_sink(m[i][h] * scale_eff, sum, sink, lse[i][h], inv);
        } else {  // without a sink: the same result in fewer instructions
          const bool empty = !(sum > 0.f);
          inv = empty ? 0.f : 1.f / sum;
          lse[i][h] = empty ? -INFINITY : m[i][h] * scale_eff + __logf(sum);
        }
#pragma unroll
        for (int n = 0; n < kNTO; ++n) {
          o[i][n][2 * h] *= inv;
          o[i][n][2 * h + 1] *= inv;
        }
      }
  }
};

// Backward: P = 2^(s * scale_log2 - lse_log2) in place, where lse_log2 is the
// saved LSE times log2(e) for each of the lane's rows. Callers pass +inf for
// rows with LSE = -inf (fully masked) and for rows past seqlen_q, so P = 0
// there (2^(finite - inf) = 2^(-inf - inf) = 0; never NaN).
template <int kMT, int kNT>
JF_DEVICE void probs_from_lse(float (&s)[kMT][kNT][4], const float (&lse_log2)[kMT][2],
                              float scale_log2) {
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        s[i][n][j] = exp2_approx(fmaf(s[i][n][j], scale_log2, -lse_log2[i][j / 2]));
}

// Backward, before masking: turns dP into the factor that multiplies P in dS,
//   dS = P * (dP - delta) [* (1 - tanh^2) with softcap],
// and applies the softcap to the scores (s <- tanh(s * pre)). Folding the
// tanh' factor in here, while s is still finite, keeps masked entries (P = 0,
// s = -inf) at dS = 0 instead of 0 * inf = NaN.
template <int kMT, int kNT>
JF_DEVICE void dp_minus_delta(float (&s)[kMT][kNT][4], float (&dp)[kMT][kNT][4],
                              const float (&delta)[kMT][2], float softcap_pre) {
  if (softcap_pre != 0.f) {
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float t = tanh_approx(s[i][n][j] * softcap_pre);
          s[i][n][j] = t;
          dp[i][n][j] = (dp[i][n][j] - delta[i][j / 2]) * (1.f - t * t);
        }
  } else {
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) dp[i][n][j] -= delta[i][j / 2];
  }
}

// Backward, after masking: s <- P (see probs_from_lse), dp <- dS = P * dp.
template <int kMT, int kNT>
JF_DEVICE void probs_and_dscores(float (&s)[kMT][kNT][4], float (&dp)[kMT][kNT][4],
                                 const float (&lse_log2)[kMT][2], float scale_log2) {
  probs_from_lse(s, lse_log2, scale_log2);
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) dp[i][n][j] *= s[i][n][j];
}

// Loads the saved statistics of the lane's rows (row0 + i*16 + g + 8h) for the
// backward: lse_log2 = LSE * log2(e), +inf for LSE = -inf and for rows past
// seqlen_q (so P = 0 there); delta = 0 past seqlen_q.
template <int kMT>
JF_DEVICE void load_row_stats(float (&lse_log2)[kMT][2], float (&delta)[kMT][2],
                              const float* lse, const float* dlt, int row0, int rows_valid,
                              int lane) {
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + i * 16 + (lane >> 2) + 8 * h;
      float l = INFINITY, d = 0.f;
      if (r < rows_valid) {
        const float v = __ldg(lse + r);
        l = v == -INFINITY ? INFINITY : v * kLog2e;
        d = __ldg(dlt + r);
      }
      lse_log2[i][h] = l;
      delta[i][h] = d;
    }
}

}  // namespace jax_flash::sm80
