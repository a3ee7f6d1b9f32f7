// tanh(x) in float32 as XLA and Eigen compute it: a 13/6-degree rational
// interpolant on [-c, c], accurate to a couple of ulps, exactly +-1 at and
// past the clamp (Eigen's generic_fast_tanh_float, its FMA clamp). Softcap
// needs it on every score: this form costs one reciprocal on the MUFU pipe
// and about a dozen FMA-pipe instructions, where e^{2x} and a reciprocal cost
// two MUFU operations beside the softmax's own exponential, the pipe the
// forward is bound by. Shared by the kernels and their host emulator.
#pragma once

#include "jax_flash/host_device.h"

namespace jax_flash {

// Numerator p and denominator q of tanh(x) = p / q (q > 0 everywhere).
JF_HOST_DEVICE void tanh_rational_parts(float x, float& p, float& q) {
  constexpr float kClamp = 7.99881172180175781f;
  x = x > kClamp ? kClamp : x;  // NaN stays NaN (its comparisons are false),
  x = x < -kClamp ? -kClamp : x;  // where fminf / fmaxf would drop it
  const float x2 = x * x;
  p = -2.76076847742355e-16f;
  p = p * x2 + 2.00018790482477e-13f;
  p = p * x2 + -8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  p = p * x;
  q = 1.19825839466702e-06f;
  q = q * x2 + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
}

}  // namespace jax_flash
