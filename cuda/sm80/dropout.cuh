// Attention dropout in the sm80 kernels: the keep decisions of the score
// elements a thread holds, drawn once per KV block into a few bit masks and
// applied where the products need them (the forward zeroes dropped P before
// P V; the backward uses the same bits twice, on dP and on P).
//
// The generator is philox.h's Dropout: one Philox4x32-7 call gives the 16
// decisions of one row in a 64-key chunk that a thread holds in the C layout
// of mma.m16n8 (keys 8m + 2t + e of the chunk, t = lane % 4, byte 2m + e), so
// each thread draws exactly its own elements, and only where the tile is
// narrower than 64 keys (a warp tile of 32 or 16 keys) does a call serve
// fewer of them: the tile then takes the words of the call that cover its
// keys (8 or 4 decisions per call).
#pragma once

#include <cstdint>

#include "jax_flash/philox.h"
#include "mma.cuh"

namespace jax_flash::sm80 {

// Values the optimiser cannot see through (no code): what is computed from
// them is not hoisted out of the loop around the use.
JF_DEVICE void opaque_words(uint32_t& a, uint32_t& b, uint32_t& c, uint32_t& d) {
#if defined(__CUDA_ARCH__)
  asm volatile("" : "+r"(a), "+r"(b), "+r"(c), "+r"(d));
#else
  (void)a, (void)b, (void)c, (void)d;
#endif
}

// The key words in shared memory (the forward: kDropoutSmemBytes past its
// tiles): each thread reads them from device memory once (for its first
// draw), thread 0 also stores them in the slot, and the draws inside the KV
// loop (after a barrier) read them back with one broadcast load instead of
// holding four registers across the loop, where the accumulators take
// nearly all of them.
constexpr int kDropoutSmemBytes = 16;

JF_DEVICE void stash_dropout_words(char* slot, const Dropout& d, int tid) {
  if (tid == 0) *reinterpret_cast<uint4*>(slot) = make_uint4(d.key0, d.key1, d.batch0, d.head0);
}
JF_DEVICE Dropout stashed_dropout(const char* slot, const DropoutArgs& a) {
  const uint4 w = *reinterpret_cast<const uint4*>(slot);
  Dropout d;
  d.key0 = w.x;
  d.key1 = w.y;
  d.batch0 = w.z;
  d.head0 = w.w;
  d.threshold = a.threshold;
  d.broadcast = a.broadcast;
  return d;
}

// Dropout's keep_scale from the launch parameters alone, and its inverse,
// the keep rate (256 - threshold) / 256 (exact).
JF_HOST_DEVICE float dropout_keep_scale(const DropoutArgs& a) {
  Dropout d;
  d.threshold = a.threshold;
  return d.keep_scale();
}
JF_DEVICE float dropout_keep_rate(const DropoutArgs& a) {
  return float(256u - a.threshold) * (1.f / 256.f);
}

// Zero, as the compiler cannot know it (the threshold is a launch parameter
// below 256; dispatch.cu rejects others): see FragKeep::apply.
JF_DEVICE uint32_t dropout_opaque_zero(const DropoutArgs& a) { return a.threshold >> 8; }

// rows *= s (per-row statistics, [kMT][2]).
template <int kMT>
JF_DEVICE void scale_rows(float (&rows)[kMT][2], float s) {
#pragma unroll
  for (int m = 0; m < kMT; ++m) rows[m][0] *= s, rows[m][1] *= s;
}

// acc *= s (an epilogue's keep_scale).
template <int kMT, int kNT>
JF_DEVICE void scale_frags(float (&acc)[kMT][kNT][4], float s) {
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][n][i] *= s;
}

// Keep bits of a thread's score fragments acc[kMT][kNT][4] (the C layout of
// mask.cuh): element (m, n, i) at row row0 + 16m + g + 8(i/2) and key
// col0 + 8n + 2t + i%2, g = lane / 4, t = lane % 4. col0 is a multiple of 64
// when the tile spans whole chunks (kNT >= 8), else of 8 kNT.
//
// Packing. One call's decisions (W = kWordsPerCall Philox words) become 4W
// bits, 2W in each 16-bit half of a register: byte 4k + r of the words used
// sits at bit (r >= 2 ? 16 : 0) + 2k + (r & 1) of its slot, slots 2W bits
// wide, 16 / 2W calls per register. Every bit position is a compile-time
// constant at the use (one bit test and a select per element).
template <int kMT, int kNT>
struct FragKeep {
  static_assert(kNT % 8 == 0 || kNT == 4 || kNT == 2,
                "warp tiles of 16 or 32 keys, or of whole 64-key chunks");
  static constexpr int kWordsPerCall = kNT >= 8 ? 4 : kNT / 2;
  static constexpr int kCallsPerRow = kNT >= 8 ? kNT / 8 : 1;
  static constexpr int kCalls = kMT * 2 * kCallsPerRow;
  static constexpr int kSlotBits = 2 * kWordsPerCall;
  static constexpr int kSlots = 16 / kSlotBits;
  static constexpr int kRegs = (kCalls + kSlots - 1) / kSlots;

  uint32_t bits[kRegs];

  // Draws the decisions of every element (one Philox call per row and chunk).
  // batch, head: the call's positions (Dropout adds the origin).
  JF_DEVICE void draw(const Dropout& d, int batch, int head, int row0, int col0, int lane) {
    const int g = lane >> 2, t = lane & 3;
    // Lane arithmetic of philox.h's KeepBits, in two 9-bit lanes per word:
    // (byte | 0x100) - threshold has bit 8 set iff byte >= threshold, and
    // the bytes at odd positions are taken doubled (flag at bit 9), so that
    // both flags of a byte pair land side by side without a shift.
    const uint32_t t2 = d.threshold | (d.threshold << 16);
    const uint32_t add_even = 0x01000100u - t2, add_odd = 0x02000200u - 2u * t2;
    // Narrow tiles: which W words of the call cover the tile's keys.
    const int sub = kNT >= 8 ? 0 : (col0 % 64) / (8 * kNT);
#pragma unroll
    for (int i = 0; i < kRegs; ++i) bits[i] = 0;
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c = 0; c < kCallsPerRow; ++c) {
          const int call = (2 * m + h) * kCallsPerRow + c;
          // Opaque copies of the key: its round schedule is recomputed per
          // call (two adds a round) instead of being hoisted out of the KV
          // loop into 14 registers.
          Dropout dc = d;
          opaque_words(dc.key0, dc.key1, dc.batch0, dc.head0);
          const Philox4x32 w = dc.bytes(uint32_t(batch), uint32_t(head),
                                       uint32_t(row0 + 16 * m + g + 8 * h),
                                       uint32_t(col0 / 64 + c), uint32_t(t));
          uint32_t v = 0;  // bits 8 + 2k + (0, 1) and 24 + 2k + (0, 1) of word k
#pragma unroll
          for (int k = 0; k < kWordsPerCall; ++k) {
            uint32_t x = w.x[k];
#pragma unroll
            for (int s = 1; s < 4 / kWordsPerCall; ++s)
              if (sub == s) x = w.x[s * kWordsPerCall + k];
            const uint32_t even = ((x & 0x00FF00FFu) + add_even) & 0x01000100u;
            const uint32_t odd = (((x >> 7) & 0x01FE01FEu) + add_odd) & 0x02000200u;
            v |= (even | odd) << (2 * k);
          }
          const int slot = call % kSlots, shift = kSlotBits * slot - 8;
          bits[call / kSlots] |= shift >= 0 ? v << shift : v >> -shift;
        }
  }

  // The bits through shared memory, kBytesPerThread a thread: words
  // [kRegs][kThreads] from `slot` (consecutive threads, consecutive banks).
  static constexpr int kBytesPerThread = kRegs * 4;
  template <int kThreads>
  JF_DEVICE void store(char* slot, int tid) const {
    uint32_t* w = reinterpret_cast<uint32_t*>(slot) + tid;
#pragma unroll
    for (int i = 0; i < kRegs; ++i) w[i * kThreads] = bits[i];
  }
  template <int kThreads>
  JF_DEVICE void load(const char* slot, int tid) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(slot) + tid;
#pragma unroll
    for (int i = 0; i < kRegs; ++i) bits[i] = w[i * kThreads];
  }

  // Whether element (m, n, i) is kept (all compile-time after unrolling).
  JF_DEVICE bool kept(int m, int n, int i) const {
    const int call = (2 * m + i / 2) * kCallsPerRow + (kNT >= 8 ? n / 8 : 0);
    const int byte = kNT >= 8 ? 2 * (n % 8) + i % 2 : 2 * n + i % 2;
    const int k = byte / 4, r = byte % 4;
    const int bit = (r >= 2 ? 16 : 0) + kSlotBits * (call % kSlots) + 2 * k + (r & 1);
    return (bits[call / kSlots] >> bit) & 1u;
  }

  // acc <- kept ? acc : 0 (keep_scale is left to the kernels' epilogues:
  // the products that follow are linear in it). `zero`: a second apply of
  // the same bits passes dropout_opaque_zero, so that the bits it tests are
  // not provably the first apply's and the tests are redone (one instruction
  // per element) instead of the first apply's predicates being kept across
  // the code between (ptxas copies them into registers: three instructions
  // per element).
  JF_DEVICE void apply(float (&acc)[kMT][kNT][4], uint32_t zero = 0) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) bits[i] ^= zero;
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][n][i] = kept(m, n, i) ? acc[m][n][i] : 0.f;
  }
};

}  // namespace jax_flash::sm80
