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

// Block m's rank: the blocks costlier than m plus the blocks as costly after
// it. A team of threads (a power of two, as many as the CTA's threads allow,
// at most a warp) counts for one block, each lane over every team-th 4-cost
// word, then the team sums with shuffles: with few blocks the whole CTA
// works (the costs are in shared memory, read as whole 16-byte words: the
// padding holds costs below any block's, counted by no rank).
// (A template, instantiated per tile shape: one definition in every
// translation unit that launches it.)
template <int kBlockM, int kBlockN>
__global__ void __launch_bounds__(kTileOrderThreads)
    packed_tile_order_kernel(const MaskInfo mask, int num_blocks, int* perm) {
  extern __shared__ int4 cost4[];
  int* cost = reinterpret_cast<int*>(cost4);
  const int b = blockIdx.x;
  const int words = (num_blocks + 3) / 4;
  for (int m = threadIdx.x; m < 4 * words; m += kTileOrderThreads) {
    int c = -1;
    if (m < num_blocks) {
      int first, last;
      mask.kv_block_range(b, m * kBlockM, kBlockM, kBlockN, first, last);
      c = last - first;
    }
    cost[m] = c;
  }
  __syncthreads();
  int team = 32;
  while (team > 1 && team * num_blocks > kTileOrderThreads) team /= 2;
  const int per_pass = kTileOrderThreads / team, sub = threadIdx.x % team;
  const int passes = (num_blocks + per_pass - 1) / per_pass;
  for (int p = 0; p < passes; ++p) {  // warp-uniform trip count (shuffles)
    const int m = p * per_pass + int(threadIdx.x) / team;
    const int c = m < num_blocks ? cost[m] : 0;
    int rank = 0;
    if (m < num_blocks) {
      for (int w = sub; w < words; w += team) {
        const int4 cw = cost4[w];
        const int j = 4 * w;
        rank += (cw.x > c) || (cw.x == c && j > m);
        rank += (cw.y > c) || (cw.y == c && j + 1 > m);
        rank += (cw.z > c) || (cw.z == c && j + 2 > m);
        rank += (cw.w > c) || (cw.w == c && j + 3 > m);
      }
    }
    for (int d = team / 2; d > 0; d /= 2) rank += __shfl_xor_sync(0xffffffffu, rank, d);
    if (m < num_blocks && sub == 0) perm[int64_t(b) * num_blocks + rank] = m;
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
  // Costs in whole 16-byte words (the ranks read them so), the tail padded.
  const size_t smem = size_t((num_blocks + 3) / 4) * sizeof(int4);
  packed_tile_order_kernel<kBlockM, kBlockN>
      <<<batch, kTileOrderThreads, smem, stream>>>(mask, num_blocks, perm);
  return cudaGetLastError();
}

}  // namespace jax_flash::sm90
