// Dropout keep decisions as bits, for the sm90 kernels whose masks are drawn
// by the producer warpgroup (the forward's FwdTuning::dropout_producer_mask,
// fwd/drop_mask.h; the backward's BwdDropoutConfig kDropProducer,
// bwd/bwd_drop_mask.h): the generator's output (jax_flash/philox.h, the same
// bits and kept positions as the consumers' own draw) turned into one bit
// per element.
//
// Two Philox outputs (16 bytes each, byte c the decision of element c of
// philox.h's layout) make one word: byte j of output word k (byte c = 4 k
// + j) of output `half` is bit
//     drop_keep_bit(half, c) = 8 j + 7 - k - 4 half,
// so that shifting the word left by k + 4 half puts the four decisions of
// output word k in the sign bits of the word's four bytes (the forward's
// byte permute, fwd/drop_mask.h, reads them there).
//
// The byte comparisons (byte >= threshold) are done four at a time as
// carries: byte + (256 - threshold) carries out of its bit 7 iff byte >=
// threshold; with s = (w & 0x7F..) + (u & 0x7F..) (no carry crosses a byte)
// the carry out of bit 7 is the majority of the bits 7 of w, u and s.
// Needs threshold in 1..255 (the dropout kernels run only with dropout on).
#pragma once

#include <cstdint>

#include "jax_flash/host_device.h"
#include "jax_flash/philox.h"

namespace jax_flash::sm90 {

// Bit of the decision of byte c (0..15) of output `half` (0, 1).
JF_HOST_DEVICE constexpr int drop_keep_bit(int half, int c) { return 8 * (c % 4) + 7 - c / 4 - 4 * half; }

struct DropMaskThreshold {
  uint32_t u, u7;  // 256 - threshold in every byte; its low 7 bits
  JF_HOST_DEVICE explicit DropMaskThreshold(uint32_t threshold)
      : u(((256u - threshold) & 0xFFu) * 0x01010101u), u7(u & 0x7F7F7F7Fu) {}
};

// Majority of three words, bitwise (one LOP3).
JF_HOST_DEVICE uint32_t drop_maj(uint32_t a, uint32_t b, uint32_t c) { return (a & b) | (c & (a | b)); }

// Adds the decisions of Philox output w as output kHalf to word r.
template <int kHalf>
JF_HOST_DEVICE uint32_t drop_mask_half(uint32_t r, const Philox4x32& w, const DropMaskThreshold& t) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t s = (w.x[k] & 0x7F7F7F7Fu) + t.u7;
    const uint32_t carry = drop_maj(w.x[k], t.u, s);  // bit 8 j + 7: byte j kept
    const int shift = k + 4 * kHalf;
    r |= (carry >> shift) & (0x80808080u >> shift);
  }
  return r;
}

}  // namespace jax_flash::sm90
