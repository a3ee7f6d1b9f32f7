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

// FlashAttention-2's rule over the CTA slots of the GPU: with `blocks` CTAs
// per split, s splits fill waves = blocks * s / slots; their efficiency is
// waves / ceil(waves). Take the fewest splits within 85% of the best (fewer
// splits: less partial traffic and a cheaper combine), among split counts
// that change the tiles per split. One split when the blocks alone fill the
// GPU or a sequence is a single tile.
//   batch * heads_k (KV heads) sequences' heads, seqlen_q new tokens, group
//   query heads per KV head, caches of max_seqlen keys.
inline int decode_num_splits(int64_t batch_heads_k, int seqlen_q, int group, int max_seqlen, int head_dim,
                             int num_sms, int smem_per_sm, bool fp8 = false) {
  const int bucket = rounded_head_dim(head_dim);
  const int64_t blocks = batch_heads_k * decode_row_blocks(seqlen_q, group, bucket);
  const int tiles = (max_seqlen + kDecodeBlockN - 1) / kDecodeBlockN;
  const int64_t slots =
      int64_t(num_sms) * decode_ctas_per_sm(bucket, decode_m_tiles(seqlen_q, group, bucket), fp8, smem_per_sm);
  if (blocks <= 0 || tiles <= 1 || slots <= 0 || blocks * 10 >= slots * 8) return 1;
  const int max_splits = std::min(kDecodeMaxSplits, tiles);
  auto efficiency = [&](int s) {
    const double waves = double(blocks) * s / double(slots);
    return waves / double(int64_t(waves) + (waves > double(int64_t(waves)) ? 1 : 0));
  };
  auto eligible = [&](int s) {
    return s == 1 || (tiles + s - 1) / s != (tiles + s - 2) / (s - 1);
  };
  double best = 0.0;
  for (int s = 1; s <= max_splits; ++s)
    if (eligible(s)) best = std::max(best, efficiency(s));
  for (int s = 1; s <= max_splits; ++s)
    if (eligible(s) && efficiency(s) >= 0.85 * best) return s;
  return 1;
}

}  // namespace jax_flash::decode
