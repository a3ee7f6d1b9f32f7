// Scalar math on the softmax hot path, shared by the sm80 and sm90 families.
#pragma once

namespace jax_flash {

// 2^x (ex2.approx: one MUFU op; ex2(-inf) = +0, which masking relies on).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh from one exponential and one reciprocal: 1 - 2 / (1 + e^{2x}).
// Absolute error ~1e-7 (tanh.approx.f32 has a relative error of ~2^-11, which
// after multiplying by the softcap moved the fp32 LSE beyond the accuracy of
// XLA's float32 tanh). Saturates cleanly: e^{2x} = inf gives 1, 0 gives -1.
__device__ __forceinline__ float tanh_approx(float x) {
  const float e = exp2_approx(x * 2.8853900817779268f);  // 2 * log2(e)
  return 1.f - __fdividef(2.f, 1.f + e);
}

}  // namespace jax_flash
