// Scalar math on the softmax hot path, shared by the sm80 and sm90 families.
#pragma once

#include "jax_flash/tanh_rational.h"

namespace jax_flash {

// 2^x (ex2.approx: one MUFU op; ex2(-inf) = +0, which masking relies on).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA pipe instead of the MUFU unit (FlashAttention-4's exp2
// emulation), for x <= 127: x = j + f with j = floor(x) and f in [0, 1); 2^f
// by a cubic (relative error ~1e-4, below the rounding of P to e4m3 or
// bf16), 2^j added to its exponent field. Inputs below -127 (-inf included)
// are clamped there: 2^-127 is a subnormal that the FTZ sums and the
// conversions of P treat as 0. Why: where the MUFU unit is as busy as the
// tensor cores (16 ex2 per clock and SM against e4m3's doubled GEMM rate), a
// share of the exponentials moved to the FMA pipe frees the softmax's
// critical resource. About eight FMA/ALU instructions against one MUFU op.
__device__ __forceinline__ float exp2_poly3(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: the sum's last bits hold floor(x)
  x = fmaxf(x, -127.f);
  const float r = __fadd_rd(x, kRound);
  const float f = x - (r - kRound);
  float p = fmaf(0.077119089663028717041015625f, f, 0.227564394474029541015625f);
  p = fmaf(p, f, 0.695146143436431884765625f);
  p = fmaf(p, f, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(r) << 23));
}

// exp2_poly3's construction with a quintic for 2^f (relative error 1.7e-7
// evaluated in float32, as ex2.approx's): accurate enough for the row sums
// and so the LSE, where the cubic's 1e-4 is not (the error criterion's LSE
// tolerance is about 1e-5). The constant term is 1 exactly, as the cubic's:
// at the clamp (x = -127, also for x = -inf) p = 1 and the exponent field
// becomes 0 (+0); below 1 it would wrap into the sign bit. About ten FMA/ALU
// instructions.
__device__ __forceinline__ float exp2_poly5(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: the sum's last bits hold floor(x)
  x = fmaxf(x, -127.f);
  const float r = __fadd_rd(x, kRound);
  const float f = x - (r - kRound);
  float p = fmaf(1.8671263242140412e-3f, f, 9.0170381590724e-3f);
  p = fmaf(p, f, 5.579990893602371e-2f);
  p = fmaf(p, f, 0.24016445875167847f);
  p = fmaf(p, f, 0.6931512951850891f);
  p = fmaf(p, f, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(r) << 23));
}

// -1 / (1 + 2^x) = (tanh(x ln(2) / 2) - 1) / 2 with two MUFU ops (ex2, rcp)
// and one add: tanh in the form 1 - 2 / (1 + e^{2y}). Saturates without a
// clamp (x = +inf or past 128: -0; x below -126: -1) and keeps NaN. Absolute
// error about 2^-22 (ex2.approx, rcp.approx), not relative: near tanh = 0
// the form loses what the rational keeps.
__device__ __forceinline__ float neg_logistic_exp2(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(-1.f - exp2_approx(x)));
  return r;
}

// tanh(y) from x = 2 y log2(e) in the form 1 - 2 / (1 + e^{2y}).
__device__ __forceinline__ float tanh_exp2(float x) { return fmaf(2.f, neg_logistic_exp2(x), 1.f); }

// tanh.approx.f32: one MUFU op, relative error about 2^-11 (FlashAttention-3's
// softcap, cutlass fast_tanh).
__device__ __forceinline__ float tanh_mufu(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh as XLA computes it in float32 (tanh_rational.h): one MUFU reciprocal
// (rcp.approx, relative error ~2^-23 after the division's multiply) and FMA
// work, instead of an exponential and a reciprocal.
__device__ __forceinline__ float tanh_approx(float x) {
  float p, q;
  tanh_rational_parts(x, p, q);
  return __fdividef(p, q);
}

// The backward's softcap tanh: kExp2Form: tanh_exp2 of x (x = 2 y log2(e)),
// else the rational of x = y.
template <bool kExp2Form>
__device__ __forceinline__ float softcap_tanh(float x) {
  if constexpr (kExp2Form) {
    return tanh_exp2(x);
  } else {
    return tanh_approx(x);
  }
}

}  // namespace jax_flash
