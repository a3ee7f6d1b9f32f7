// Attention dropout's generator for the kernels: Philox4x32-7 and the keep
// decision of score element (batch, head, row, col), bit for bit the one of
// jax_flash/_src/core/dropout.py (the scheme is described there;
// tests/test_dropout_rng.py compiles this header with a host compiler and
// compares). One call gives the 16 decisions of one row that an MMA thread
// holds in a 64-column chunk: columns 8m + 2t + e (t = lane % 4, m < 8,
// e < 2), byte 2m + e of the output.
#pragma once

#include <cstdint>

#include "jax_flash/host_device.h"
#include "jax_flash/params.h"

namespace jax_flash {

// Rounds of Philox4x32 (dropout.py ROUNDS): 7, as FlashAttention-2's
// generator; Random123 (Salmon et al. 2011) finds Philox4x32-7 passes
// TestU01's BigCrush. Fewer rounds are the kernels' largest saving.
constexpr int kPhiloxRounds = 7;

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

// Philox4x32-R (Random123 constants).
template <int kRounds = kPhiloxRounds>
JF_HOST_DEVICE Philox4x32 philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                     uint32_t k1) {
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
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

// The 16 keep decisions of one Philox output, held as two words per output
// word (the 9-bit lanes of byte | 0x100 minus the threshold: bit 8 of a lane
// is set iff byte >= threshold; no lane borrows from the next):
//   lo[k]: bytes 0 and 2 of word k at bits 8 and 24, hi[k]: bytes 1 and 3.
// Five integer instructions per word; keep(c) is one bit test.
struct KeepBits {
  uint32_t lo[4], hi[4];
  JF_HOST_DEVICE KeepBits(const Philox4x32& w, uint32_t threshold) {
    const uint32_t t2 = threshold | (threshold << 16);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      lo[k] = ((w.x[k] & 0x00FF00FFu) | 0x01000100u) - t2;
      hi[k] = (((w.x[k] >> 8) & 0x00FF00FFu) | 0x01000100u) - t2;
    }
  }
  // Whether byte c (0..15) is kept; c known at compile time in the kernels.
  JF_HOST_DEVICE bool keep(int c) const {
    const uint32_t word = (c % 4) & 1 ? hi[c / 4] : lo[c / 4];
    return (word >> ((c % 4) & 2 ? 24 : 8)) & 1u;
  }
};

// 256 / (256 - threshold): the factor of kept elements (folded into the
// output's normalisation by the forward, into dP and dV by the backward);
// a launch parameter, so no key word is read for it.
JF_HOST_DEVICE float dropout_keep_scale(const DropoutArgs& a) { return 256.f / float(256u - a.threshold); }

// A call's generator in a kernel (from params.h's DropoutArgs): the key, the
// call's origin in the whole request (batch0, head0: nonzero in one shard of
// a sharded call; row0, col0: in one block of ring attention; so every call
// draws the single-device mask) and the byte threshold. Positions passed in
// are the call's. The column origin enters as whole 64-column chunks (chunk0
// = col0 / 64): the kernels draw one 64-column chunk's 16 bytes at a time, so
// a call's columns must start on a chunk (jax_flash/_src/backends/cuda.py
// serves only col0 % 64 == 0).
struct Dropout {
  uint32_t key0 = 0, key1 = 0, batch0 = 0, head0 = 0, row0 = 0, chunk0 = 0;
  uint32_t threshold = 0;  // keep iff byte >= threshold; 0 = no dropout
  bool broadcast = false;  // every (batch, head) draws at (0, 0)

  Dropout() = default;
  // Reads the key words (device memory in a kernel: once per thread).
  JF_HOST_DEVICE explicit Dropout(const DropoutArgs& a)
      : threshold(a.threshold), broadcast(a.broadcast) {
    if (a.words != nullptr) {
      key0 = a.words[0];
      key1 = a.words[1];
      batch0 = a.words[2];
      head0 = a.words[3];
      row0 = a.words[4];
      chunk0 = a.words[5] / 64u;
    }
  }
  // The 16 random bytes of (batch, head, row, 64-column chunk, t): byte
  // 2m + e is column 64 chunk + 8m + 2t + e.
  JF_HOST_DEVICE Philox4x32 bytes(uint32_t batch, uint32_t head, uint32_t row, uint32_t chunk,
                                  uint32_t t) const {
    const uint32_t b = broadcast ? 0u : batch0 + batch, h = broadcast ? 0u : head0 + head;
    return philox4x32(row0 + row, 4u * (chunk0 + chunk) + t, h, b, key0, key1);
  }
  JF_HOST_DEVICE KeepBits keep_bits(uint32_t batch, uint32_t head, uint32_t row, uint32_t chunk,
                                    uint32_t t) const {
    return KeepBits(bytes(batch, head, row, chunk, t), threshold);
  }
  // Whether element (batch, head, row, col) is kept (one call per element:
  // the reference form; kernels draw once per 16 elements).
  JF_HOST_DEVICE bool keep(uint32_t batch, uint32_t head, uint32_t row, uint32_t col) const {
    const KeepBits k = keep_bits(batch, head, row, col / 64u, (col % 8u) / 2u);
    return k.keep(int(2u * ((col % 64u) / 8u) + col % 2u));
  }
};

}  // namespace jax_flash
