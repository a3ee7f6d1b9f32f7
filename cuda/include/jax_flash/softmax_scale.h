// Launch-wide softmax constants, shared by every kernel family. Scores stay
// raw in the kernels (s = q.k, or tanh(scale * q.k / softcap) with softcap);
// logit = s * scale_eff, and the exponentials run in base 2 with
// scale_eff * log2(e) folded in (scale_log2).
#pragma once

namespace jax_flash {

constexpr float kLog2e = 1.4426950408889634f;

struct SoftmaxScale {
  float scale_log2;   // scale_eff * log2(e)
  float scale_eff;    // scale, or softcap when softcap is on
  float softcap_pre;  // scale / softcap (0 = softcap off)
};

inline SoftmaxScale make_softmax_scale(float scale, float softcap) {
  SoftmaxScale s;
  if (softcap > 0.f) {
    s.softcap_pre = scale / softcap;
    s.scale_eff = softcap;
  } else {
    s.softcap_pre = 0.f;
    s.scale_eff = scale;
  }
  s.scale_log2 = s.scale_eff * kLog2e;
  return s;
}

}  // namespace jax_flash
