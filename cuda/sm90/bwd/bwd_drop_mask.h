// The backward's key split with producer-drawn dropout masks
// (BwdDropoutConfig kDropProducer): the word layout of the mask buffers
// (bwd_config.cuh: per consumer WG and step parity, [2 words][kBlockM + 8])
// in the bits of sm90/common/drop_bits.h. Word w of query q of WG wg's 64
// keys (64-key chunk (n0 + 64 wg) / 64) holds the generator's calls t = 2 w
// (half 0) and 2 w + 1 (half 1) of that query row. The consumer thread
// (warp, lane) of a WG holds the keys 16 warp + g + 8 h (g = lane / 4, h <
// 2): byte c = 4 warp + 2 h + g % 2 of call t = g / 2, i.e. word g / 4,
// half (g / 2) % 2, bit bwd_drop_shift(warp, lane) + 16 h.
#pragma once

#include <cstdint>

#include "jax_flash/host_device.h"
#include "sm90/common/drop_bits.h"

namespace jax_flash::sm90 {

JF_HOST_DEVICE constexpr int bwd_drop_shift(int warp, int lane) {
  return drop_keep_bit((lane / 8) % 2, 4 * warp + (lane / 4) % 2);
}

// Word `word` (0, 1) of query row `row` (call positions, Dropout::bytes) in
// 64-key chunk `chunk`.
JF_HOST_DEVICE uint32_t bwd_drop_mask_word(const Dropout& d, const DropMaskThreshold& t, uint32_t batch,
                                           uint32_t head, uint32_t row, uint32_t chunk, uint32_t word) {
  const uint32_t r = drop_mask_half<0>(0u, d.bytes(batch, head, row, chunk, 2u * word), t);
  return drop_mask_half<1>(r, d.bytes(batch, head, row, chunk, 2u * word + 1u), t);
}

}  // namespace jax_flash::sm90
