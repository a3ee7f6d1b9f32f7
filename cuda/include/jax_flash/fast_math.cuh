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

// tanh as XLA computes it in float32 (tanh_rational.h): one MUFU reciprocal
// (rcp.approx, relative error ~2^-23 after the division's multiply) and FMA
// work, instead of an exponential and a reciprocal.
__device__ __forceinline__ float tanh_approx(float x) {
  float p, q;
  tanh_rational_parts(x, p, q);
  return __fdividef(p, q);
}

}  // namespace jax_flash
