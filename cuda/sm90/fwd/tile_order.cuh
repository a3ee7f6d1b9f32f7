// The forward's tile order for packed sequences: with segment ids the cost of
// a query block (its KV blocks, MaskInfo::kv_block_range through the tile
// spans) follows the documents, not the block index, so the positional
// heaviest-first order of TileOrder leaves heavy tiles for the end. This
// small kernel ranks each batch element's blocks by cost (heaviest first,
// ties: the later block first, as without packing) into the call's
// workspace; TileOrder::decode then reads the block of each rank.
#pragma once

#include <cuda_runtime.h>

#include "jax_flash/mask_info.h"

namespace jax_flash::sm90 {

constexpr int kTileOrderThreads = 512;
constexpr int kTileOrderMaxBlocks = 12288;  // costs in 48 KB of shared memory

// (A template, instantiated per tile shape: one definition in every
// translation unit that launches it.)
template <int kBlockM, int kBlockN>
__global__ void __launch_bounds__(kTileOrderThreads)
    packed_tile_order_kernel(const MaskInfo mask, int num_blocks, int* perm) {
  extern __shared__ int cost[];
  const int b = blockIdx.x;
  for (int m = threadIdx.x; m < num_blocks; m += blockDim.x) {
    int first, last;
    mask.kv_block_range(b, m * kBlockM, kBlockM, kBlockN, first, last);
    cost[m] = last - first;
  }
  __syncthreads();
  for (int m = threadIdx.x; m < num_blocks; m += blockDim.x) {
    const int c = cost[m];
    int rank = 0;
    for (int j = 0; j < num_blocks; ++j) {
      const int cj = cost[j];
      rank += (cj > c) || (cj == c && j > m);
    }
    perm[int64_t(b) * num_blocks + rank] = m;
  }
}

// Whether a call gets the packed order (else nullptr: the positional one).
inline const int* packed_tile_order(const MaskInfo& mask, int32_t* workspace, int num_blocks) {
  if (mask.q_span == nullptr || workspace == nullptr || num_blocks > kTileOrderMaxBlocks) return nullptr;
  return workspace;
}

template <int kBlockM, int kBlockN>
cudaError_t launch_packed_tile_order(const MaskInfo& mask, int batch, int num_blocks, int* perm,
                                     cudaStream_t stream) {
  // Costs rounded up to whole 16-byte words: ptxas reads the ranking loop's
  // tail (1-3 costs) with one LDS.128, which must stay inside the allocation.
  const size_t smem = size_t((num_blocks + 3) / 4 * 4) * sizeof(int);
  packed_tile_order_kernel<kBlockM, kBlockN>
      <<<batch, kTileOrderThreads, smem, stream>>>(mask, num_blocks, perm);
  return cudaGetLastError();
}

}  // namespace jax_flash::sm90
