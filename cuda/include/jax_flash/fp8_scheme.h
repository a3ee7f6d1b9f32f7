// The FP8 (e4m3) scheme's descale blocks: the C++ side of
// jax_flash/_src/fp8/scheme.py (Q_BLOCK, k_block; tests/test_fp8_blocks.py
// checks that the two sides agree). Q has one descale per kFp8QBlock rows (one
// consumer warpgroup of the sm90 FP8 forward), K one per fp8_k_block(head_dim)
// keys: the forward's KV tile at that head dim (fwd_tuning.h asserts that its
// policy takes it), so that each KV block folds one K descale into its softmax
// scale. Used by the pre-pass (cuda/fp8/quantize.cu) and the forward.
#pragma once

namespace jax_flash {

constexpr int kFp8QBlock = 64;

// Keys per K descale at a padded head dim (64, 128 or 256; 0 for any other):
// FlashAttention-3's FP8 KV tiles (hopper/tile_size.h).
constexpr int fp8_k_block(int head_dim) {
  return head_dim == 64 ? 160 : head_dim == 128 ? 224 : head_dim == 256 ? 128 : 0;
}

}  // namespace jax_flash
