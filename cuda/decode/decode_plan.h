// The split-KV policy: how many splits of each sequence's keys a decoding
// call uses. Host only; Python asks for it (the module's decode_num_splits)
// to size the fp32 partials it passes as a workspace.
#pragma once

#include <algorithm>
#include <cstdint>

#include "decode/decode_params.h"
#include "jax_flash/head_dim.h"

namespace jax_flash::decode {

// CTAs of the decode kernel that fit an SM (shared memory is the limit).
inline int decode_ctas_per_sm(int head_dim_bucket, int m_tiles, bool fp8, int smem_per_sm) {
  const int bytes = decode_smem_bytes(head_dim_bucket, m_tiles, fp8) + 1024;  // + the per-CTA reserve
  return std::max(1, std::min(16, smem_per_sm / bytes));
}

// The split count. A decode CTA streams its keys at a rate set by the
// latency of each tile's work, so a call takes about as long as its busiest
// CTA slot: cost(s) = waves(s) * (tiles_per_split(s) + 1) tile times (the
// one: a CTA's start, the first tile's load, and its final merge), with
// waves(s) = ceil(blocks * s / slots) over the GPU's CTA slots. The plan
// takes the largest split count that runs in one wave (every CTA at once:
// the most CTAs streaming, each with the fewest tiles), or one split when the
// row blocks alone exceed the slots, unless the cheapest split count over
// several waves costs less than 85% of that (a wave's tail and the partials'
// traffic are not in the model). Only split counts that change the tiles per
// split count; one split when a sequence is a single tile.
//   blocks: CTAs of one split (row blocks times sequences' heads), tiles of
//   block_n keys, caches of max_seqlen keys, `slots` CTAs at once on the GPU.
inline int decode_num_splits_for(int64_t blocks, int max_seqlen, int block_n, int64_t slots) {
  const int tiles = (max_seqlen + block_n - 1) / block_n;
  if (blocks <= 0 || tiles <= 1 || slots <= 0) return 1;
  const int max_splits = std::min(kDecodeMaxSplits, tiles);
  auto per_split = [&](int s) { return int64_t((tiles + s - 1) / s); };
  auto waves = [&](int s) { return (blocks * s + slots - 1) / slots; };
  auto cost = [&](int s) { return waves(s) * (per_split(s) + 1); };
  auto eligible = [&](int s) { return s == 1 || per_split(s) != per_split(s - 1); };
  int one_wave = 1, several = 0;
  for (int s = 1; s <= max_splits; ++s) {
    if (!eligible(s)) continue;
    if (waves(s) == 1)
      one_wave = s;
    else if (several == 0 || cost(s) < cost(several))
      several = s;
  }
  if (several != 0 && cost(several) * 100 < cost(one_wave) * 85) return several;
  return one_wave;
}

// The plan of decode_tile's configuration: batch * heads_k (KV heads)
// sequences' heads, seqlen_q new tokens, group query heads per KV head.
inline int decode_num_splits(int64_t batch_heads_k, int seqlen_q, int group, int max_seqlen, int head_dim,
                             int num_sms, int smem_per_sm, bool fp8 = false) {
  const int bucket = rounded_head_dim(head_dim);
  const int m_tiles = decode_m_tiles(seqlen_q, group, bucket);
  return decode_num_splits_for(batch_heads_k * decode_row_blocks(seqlen_q, group, bucket), max_seqlen,
                               decode_tile(bucket, m_tiles, fp8).block_n,
                               int64_t(num_sms) * decode_ctas_per_sm(bucket, m_tiles, fp8, smem_per_sm));
}

}  // namespace jax_flash::decode
