// Attention dropout's generator for the kernels: Philox4x32-10 and the keep
// decision of score element (batch, head, row, col), bit for bit the one of
// jax_flash/_src/dropout.py (the scheme is described there;
// tests/test_dropout_rng.py compiles this header with a host compiler and
// compares). One call gives the 16 decisions of one row that an MMA thread
// holds in a 64-column chunk: columns 8m + 2t + e (t = lane % 4, m < 8,
// e < 2), byte 2m + e of the output.
#pragma once

#include <cstdint>

#include "jax_flash/host_device.h"

namespace jax_flash {

struct Philox4x32 {
  uint32_t x[4];
};

JF_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t m, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  hi = __umulhi(a, m);
  lo = a * m;
#else
  const uint64_t p = uint64_t(a) * m;
  hi = uint32_t(p >> 32);
  lo = uint32_t(p);
#endif
}

// Philox4x32-10 (Salmon et al. 2011, Random123 constants).
JF_HOST_DEVICE Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                        uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(c0, 0xD2511F53u, hi0, lo0);
    philox_mulhilo(c2, 0xCD9E8D57u, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// The byte threshold of a rate in [0, 1): round(rate * 256), at most 255
// (dropout.threshold; Python passes the integer).
struct DropoutParams {
  uint32_t key0, key1;
  uint32_t threshold;  // keep iff byte >= threshold; 0 = no dropout
  float keep_scale;    // 256 / (256 - threshold)
};

// The 16 random bytes of (batch, head, row, 64-column chunk, t): one Philox
// call; byte 2m + e is column 64 chunk + 8m + 2t + e.
JF_HOST_DEVICE Philox4x32 dropout_bytes(const DropoutParams& d, uint32_t batch, uint32_t head, uint32_t row,
                                        uint32_t chunk, uint32_t t) {
  return philox4x32_10(row, 4u * chunk + t, head, batch, d.key0, d.key1);
}

// Whether element (batch, head, row, col) is kept (one call per element: the
// reference form; kernels call dropout_bytes once per 16 elements).
JF_HOST_DEVICE bool dropout_keep(const DropoutParams& d, uint32_t batch, uint32_t head, uint32_t row,
                                 uint32_t col) {
  const Philox4x32 w = dropout_bytes(d, batch, head, row, col / 64u, (col % 8u) / 2u);
  const uint32_t c = 2u * ((col % 64u) / 8u) + col % 2u;
  const uint32_t byte = (w.x[c / 4u] >> (8u * (c % 4u))) & 0xFFu;
  return byte >= d.threshold;
}

}  // namespace jax_flash
