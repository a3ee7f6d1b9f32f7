// The sm90 forward's dropout keep mask as a bit mask in shared memory
// (FwdTuning::dropout_producer_mask): warps 1..3 of the producer warpgroup
// draw each KV block's Philox output (jax_flash/philox.h, the same bits and
// the same kept positions as the consumers' own draw) and store one bit per
// element; the consumers read one word per 32 of their elements and zero
// P's dropped elements on the packed 16-bit P fragment (one byte permute and
// one AND per element pair) instead of running the generator themselves.
//
// Word layout. A consumer thread (warp w of warpgroup g, lane l) holds, per
// 64-key chunk c of the block, the 32 elements of rows 16 (4 g + w) + l / 4
// + 8 h (h < 2) at columns 64 c + 8 m + 2 (l % 4) + e (m < 8, e < 2): the
// bytes 2 m + e of the two Philox calls (row, chunk, t = l % 4) of philox.h.
// Those 32 decisions are one word, row half h as output `half` of
// drop_bits.h: element 4 k + j = 2 m + e (byte j of Philox output word k)
// at bit drop_keep_bit(h, 4 k + j) = 8 j + 7 - k - 4 h, so that shifting
// the word left by k + 4 h puts output word k's four decisions in the sign
// bits of the word's bytes, where one byte permute in sign-replicating mode
// spreads a pair's two signs over the two halves of a 16-bit pair
// (drop_pair). The block's words are stored
// [16-row group][lane][chunk]: each consumer thread reads its chunks'
// words with one load, a warp reads (and a producer warp writes) contiguous
// words without bank conflicts.
//
// Generator output -> bits: sm90/common/drop_bits.h (shared with the
// backward's producer-drawn masks).
#pragma once

#include <cstdint>

#include "jax_flash/host_device.h"
#include "jax_flash/philox.h"
#include "sm90/common/drop_bits.h"

namespace jax_flash::sm90 {

// The word of one consumer thread and chunk: rows `row` and `row + 8` (call
// positions, Dropout::bytes), 64-key chunk `chunk`, t = lane % 4.
JF_HOST_DEVICE uint32_t drop_mask_word(const Dropout& d, const DropMaskThreshold& t, uint32_t batch,
                                       uint32_t head, uint32_t row, uint32_t chunk, uint32_t lane_t) {
  uint32_t r = drop_mask_half<0>(0u, d.bytes(batch, head, row, chunk, lane_t), t);
  return drop_mask_half<1>(r, d.bytes(batch, head, row + 8u, chunk, lane_t), t);
}

// prmt.b32 with one source: result byte i = source byte sel_i (sel's nibble
// i, low 2 bits), or with the nibble's bit 3 set the sign of that byte
// replicated over the byte.
JF_HOST_DEVICE uint32_t drop_prmt(uint32_t x, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(r) : "r"(x), "r"(sel));
  return r;
#else
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t n = (sel >> (4 * i)) & 0xFu, b = (x >> (8 * (n & 3u))) & 0xFFu;
    r |= ((n & 8u) ? ((b & 0x80u) ? 0xFFu : 0u) : b) << (8 * i);
  }
  return r;
#endif
}

// A packed pair of 16-bit P elements (columns 8 m + 2 t + e, e = 0 in the low
// half; row half h) with its dropped elements zeroed: `word` is the thread's
// word of the pair's chunk. m, h known at compile time in the kernel.
JF_HOST_DEVICE uint32_t drop_pair(uint32_t pair, uint32_t word, int m, int h) {
  const uint32_t x = word << (m / 2 + 4 * h);         // output word m / 2's signs in bytes 0..3
  const uint32_t sel = m % 2 == 0 ? 0x9988u : 0xBBAAu;  // bytes 2 (m % 2) + e, sign-replicated
  return pair & drop_prmt(x, sel);
}

// Where the words of a block live: [16-row group][lane][chunk], 4 bytes each.
template <int kBlockM, int kBlockN>
struct DropMaskLayout {
  static constexpr int kChunks = kBlockN / 64;
  static constexpr int kWords = kBlockM / 16 * 32 * kChunks;
  static constexpr int kBytes = 4 * kWords;
  // The word of consumer thread (16-row group g, lane) and chunk c.
  JF_HOST_DEVICE static constexpr int word(int g, int lane, int c) { return (g * 32 + lane) * kChunks + c; }
  // Word index -> its (16-row group, lane, chunk): the producer's task.
  JF_HOST_DEVICE static constexpr int group_of(int w) { return w / (32 * kChunks); }
  JF_HOST_DEVICE static constexpr int lane_of(int w) { return w / kChunks % 32; }
  JF_HOST_DEVICE static constexpr int chunk_of(int w) { return w % kChunks; }
};

}  // namespace jax_flash::sm90
