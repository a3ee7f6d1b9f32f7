// The shared-memory tile layout of the sm90 kernels.
//
// Every tile (Q, K, V, O) is kept in the layout that TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B and a box of one 128-byte row (kSwizzleRow =
// 128 / bytes elements, ElementTraits) x `rows` rows, one box per column block
// of kSwizzleRow columns of the head dim:
//   [head_dim / kSwizzleRow][rows][kSwizzleRow] elements, 128 bytes per row,
//   and within each 1024-byte group of 8 rows the 16-byte chunk c of row r
//   sits at chunk c ^ (r % 8).
// This is also the canonical 128B-swizzle layout wgmma reads: K-major for Q
// (A) and K (B of S = Q K^T), MN-major for V (B of O = P V, N = head dim
// contiguous). See ptx/wgmma.cuh for the descriptors. Every tile starts 1 KB
// aligned (the swizzle pattern repeats every 1024 bytes).
#pragma once

#include <cstdint>

namespace jax_flash::sm90 {

// Byte offset of element (r, c) in a [cols / kRowElems][kRows][kRowElems]
// 128B-swizzled tile of kBytes-byte elements (kRowElems = 128 / kBytes).
template <int kRows, int kBytes = 2>
__host__ __device__ constexpr uint32_t sw128_offset(int r, int c) {
  constexpr int kRowElems = 128 / kBytes;
  constexpr int kChunkElems = 16 / kBytes;
  return uint32_t((c / kRowElems) * kRows * 128 + r * 128 +
                  ((((c % kRowElems) / kChunkElems) ^ (r % 8)) * 16) + (c % kChunkElems) * kBytes);
}

}  // namespace jax_flash::sm90
