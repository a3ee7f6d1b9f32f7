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
// holding six registers across the loop, where the accumulators take
// nearly all of them.
constexpr int kDropoutSmemBytes = 32;

JF_DEVICE void stash_dropout_words(char* slot, const Dropout& d, int tid) {
  if (tid == 0) {
    *reinterpret_cast<uint4*>(slot) = make_uint4(d.key0, d.key1, d.batch0, d.head0);
    *reinterpret_cast<uint2*>(slot + 16) = make_uint2(d.row0, d.chunk0);
  }
}
JF_DEVICE Dropout stashed_dropout(const char* slot, const DropoutArgs& a) {
  const uint4 w = *reinterpret_cast<const uint4*>(slot);
  const uint2 o = *reinterpret_cast<const uint2*>(slot + 16);
  Dropout d;
  d.key0 = w.x;
  d.key1 = w.y;
  d.batch0 = w.z;
  d.head0 = w.w;
  d.row0 = o.x;
  d.chunk0 = o.y;
  d.threshold = a.threshold;
  d.broadcast = a.broadcast;
  return d;
}

// The inverse of dropout_keep_scale (philox.h), the keep rate
// (256 - threshold) / 256 (exact).
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

// The 16 keep decisions of one Philox call (philox.h's Dropout::bytes),
// packed in 16 bits: byte 4k + r of the output at bit 2k + (r & 1) + (r >= 2 ?
// 8 : 0) (the low byte holds bytes 0 and 1 of each word, the high byte bytes
// 2 and 3). The lane arithmetic of philox.h's KeepBits, two 9-bit lanes per
// word: (byte | 0x100) - threshold has bit 8 set iff byte >= threshold; the
// odd bytes are taken doubled (flag at bit 9), so that the flags of a byte
// pair land side by side. thr = threshold * 0x10001 (both lanes).
JF_DEVICE uint32_t keep16(const Philox4x32& w, uint32_t thr) {
  uint32_t v = 0;  // flags at bits 8 + 2k + (0, 1) and 24 + 2k + (0, 1)
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t x = w.x[k];
    const uint32_t even = ((x & 0x00FF00FFu) + (0x01000100u - thr)) & 0x01000100u;
    const uint32_t odd = (((x >> 7) & 0x01FE01FEu) + (0x02000200u - 2u * thr)) & 0x02000200u;
    v |= (even | odd) << (2 * k);
  }
  return ((v >> 8) & 0xFFu) | ((v >> 16) & 0xFF00u);
}

// One call of the generator with the key made opaque: its round schedule is
// recomputed per call (two adds a round) instead of being hoisted out of the
// KV loop into 14 registers.
JF_DEVICE uint32_t draw_keep16(const Dropout& d, int batch, int head, int row, int chunk, int t) {
  Dropout dc = d;
  opaque_words(dc.key0, dc.key1, dc.batch0, dc.head0);
  const Philox4x32 w = dc.bytes(uint32_t(batch), uint32_t(head), uint32_t(row), uint32_t(chunk),
                                uint32_t(t));
  return keep16(w, d.threshold * 0x10001u);
}

// Keep bits of a thread's score fragments acc[kMT][kNT][4] (the C layout of
// mask.cuh): element (m, n, i) at row row0 + 16m + g + 8(i/2) and key
// col0 + 8n + 2t + i%2, g = lane / 4, t = lane % 4. col0 is a multiple of 64
// when the tile spans whole chunks (kNT >= 8), else of 8 kNT: the tile then
// takes W = kNT / 2 of the call's 4 words, the sub-th W of them.
//
// Packing: call (row, chunk) of the thread is kept in a slot of 2W bits in
// each 16-bit half of a register (16 / 2W calls a register): byte 4k + r of
// the words used at bit (r >= 2 ? 16 : 0) + 2k + (r & 1) of its slot. Every
// bit position is a compile-time constant at the use (one bit test and a
// select per element).
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

  // Call `call` ((2m + h) * kCallsPerRow + chunk) from its keep16 value.
  JF_DEVICE void place(int call, uint32_t k16, int sub) {
    constexpr uint32_t kMask = (1u << kSlotBits) - 1;
    const int slot = call % kSlots;
    const uint32_t lo = (k16 >> (kSlotBits * sub)) & kMask;
    const uint32_t hi = (k16 >> (8 + kSlotBits * sub)) & kMask;
    bits[call / kSlots] |= (lo << (kSlotBits * slot)) | (hi << (16 + kSlotBits * slot));
  }
  JF_DEVICE void clear() {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) bits[i] = 0;
  }
  // Which W words of a call a narrow tile takes.
  JF_DEVICE static int sub_of(int col0) { return kNT >= 8 ? 0 : (col0 % 64) / (8 * kNT); }

  // Draws the decisions of every element (one Philox call per row and chunk).
  // batch, head: the call's positions (Dropout adds the origin).
  JF_DEVICE void draw(const Dropout& d, int batch, int head, int row0, int col0, int lane) {
    const int g = lane >> 2, t = lane & 3, sub = sub_of(col0);
    clear();
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c = 0; c < kCallsPerRow; ++c)
          place((2 * m + h) * kCallsPerRow + c,
                draw_keep16(d, batch, head, row0 + 16 * m + g + 8 * h, col0 / 64 + c, t), sub);
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

// The backward's keep decisions of one (query block, KV block) tile drawn
// cooperatively: its warp tiles of S can be narrower than a 64-key chunk
// (32 or 16 keys), where a thread drawing its own elements would compute the
// whole call for a half or a quarter of it; instead every call of the tile
// (kBlockM rows x kBlockN / 64 chunks x 4 lane columns t) is drawn once, by
// one thread, into a table of keep16 values [row][chunk][t] in shared memory
// (2 bytes each), from which each thread takes its part. The table of the
// next tile is drawn during the current one's dV / dK products (after the
// barrier that ends the reads of the current table; the next tile's reads
// come after the barrier that starts it), so one table suffices.
template <int kBlockM, int kBlockN, int kThreads>
struct KeepTable {
  static_assert(kBlockN % 64 == 0, "whole 64-key chunks per KV block");
  static constexpr int kChunks = kBlockN / 64;
  static constexpr int kEntries = kBlockM * kChunks * 4;
  static constexpr int kBytes = (kEntries * 2 + 15) / 16 * 16;

  // Draws the table of the tile at (m0, n0) (threads split the calls).
  JF_DEVICE static void write(char* table, const Dropout& d, int batch, int head, int m0, int n0,
                              int tid) {
    uint16_t* e = reinterpret_cast<uint16_t*>(table);
#pragma unroll
    for (int i = 0; i < (kEntries + kThreads - 1) / kThreads; ++i) {
      const int idx = tid + i * kThreads;
      if (kEntries % kThreads == 0 || idx < kEntries) {
        const int r = idx / (4 * kChunks), c = (idx / 4) % kChunks, t = idx % 4;
        e[idx] = uint16_t(draw_keep16(d, batch, head, m0 + r, n0 / 64 + c, t));
      }
    }
  }

  // A thread's bits of its warp tile at (row0, col0) within the tile.
  template <int kMT, int kNT>
  JF_DEVICE static void read(FragKeep<kMT, kNT>& keep, const char* table, int row0, int col0,
                             int lane) {
    using Keep = FragKeep<kMT, kNT>;
    const uint16_t* e = reinterpret_cast<const uint16_t*>(table);
    const int g = lane >> 2, t = lane & 3, sub = Keep::sub_of(col0);
    keep.clear();
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c = 0; c < Keep::kCallsPerRow; ++c) {
          const int r = row0 + 16 * m + g + 8 * h;
          keep.place((2 * m + h) * Keep::kCallsPerRow + c,
                     e[(r * kChunks + col0 / 64 + c) * 4 + t], sub);
        }
  }
};

}  // namespace jax_flash::sm80
