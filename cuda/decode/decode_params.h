// Decoding against a KV cache: a few new query tokens per sequence attend to
// that sequence's cached keys. Plain types only (host code includes it).
//
// Layouts (strides in elements, head_dim contiguous):
//   q, o   [batch, seqlen_q, heads, head_dim]      seqlen_q = the new tokens
//   lse    [batch, heads, seqlen_q] float32 (natural log)
//   k, v   [num_pages, page_size, heads_k, head_dim], one stride set for both:
//          sequence b's key j lives in page page_table[b, j / page_size], slot
//          j % page_size. A contiguous cache [B_cache, S_max, ...] is the same
//          thing with page_size = S_max and one page per sequence.
// Masking is FwdParams' bottom-right convention per sequence: query row t
// sits at position t + seqlens[b] - seqlen_q; key j visible iff
//   j < seqlens[b] && (wl < 0 || j >= pos - wl) && (wr < 0 || j <= pos + wr)
// (causal is wr = 0). Rows that see no key: O = 0, LSE = -inf (the sink).
// Learnable sinks (jax_flash/sinks.h): e^{sink} joins each row's denominator
// and its LSE exactly once: in the finalize of a single split, else in the
// combine (the split partials never include it).
#pragma once

#include <cstdint>

#include "jax_flash/params.h"
#include "jax_flash/softmax_scale.h"

namespace jax_flash::decode {

struct DecodeParams {
  const void* q;
  void* o;
  float* lse;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;

  const void* k;
  const void* v;
  int64_t kv_page_stride, kv_row_stride, kv_head_stride;
  const int32_t* page_table;  // [batch, max_pages]; entries are clamped to [0, num_pages)
  // An FP8 (e4m3) cache (kv_fp8): k and v hold e4m3 values, each key's true
  // row is x8 * descale with one float32 descale per (page, head, slot):
  //   k_descale, v_descale [num_pages, heads_k, page_size]  (page_size % 4 == 0)
  // q, o and lse keep their types; the products run in fp16 (decode_fp8.cuh).
  bool kv_fp8;
  float q_scale;  // FP8: the softmax scale, applied to Q (sm then has scale 1)
  const float* k_descale;
  const float* v_descale;
  const int32_t* seqlens;     // [batch] keys per sequence; clamped to [0, max_pages * page_size]

  int batch, seqlen_q, num_heads, num_heads_k, head_dim;
  int num_pages, page_size, max_pages;
  int window_left, window_right;  // -1 = unbounded
  SoftmaxScale sm;
  DType dtype;
  const float* sinks;  // [batch, num_heads] float32 sink logits, or nullptr (none)

  // Split-KV: each sequence's keys are cut into num_splits ranges of whole
  // tiles, one CTA each. With num_splits > 1 the CTAs write fp32 partials,
  // normalised per split, that the combine kernel merges by their LSE:
  //   o_partial   [num_splits, batch, heads, seqlen_q, head_dim]
  //   lse_partial [num_splits, batch, heads, seqlen_q]
  // (XLA workspaces sized in Python, jax_flash/_src/decode_cuda.py).
  int num_splits;
  float* o_partial;
  float* lse_partial;
};

// The kernel that merges the splits (decode_combine.cuh: one warp per row,
// the splits in batches of 8 per 64 columns; decode_combine_cta.cuh: one CTA
// per row, its warps sharing the splits). A warp walks more than 8 splits
// in one memory round trip per batch and 64 columns, a CTA per row in two
// or three in all, so many splits take the CTA per row.
enum class CombineKind { kWarpPerRow, kCtaPerRow };
constexpr int kCombineCtaMinSplits = 9;
constexpr CombineKind decode_combine_kind(int num_splits) {
  return num_splits >= kCombineCtaMinSplits ? CombineKind::kCtaPerRow : CombineKind::kWarpPerRow;
}

// The decode kernel's shape (decode_kernel.cuh's DecodeConfig reads it from
// here; decode_plan.h sizes the grid with it). A CTA holds 16 or 32 packed
// query rows (one or two m-tiles per warp: 32 when a KV head has more than
// 16 rows and O still fits the registers, head_dim <= 128).
constexpr int kDecodeMTileRows = 16;
constexpr int kDecodeMinBlockN = 64;  // the fewest keys per pipeline stage (16 per warp)
constexpr int kDecodeWarps = 4;
constexpr int kDecodeMaxSplits = 128;

// The pipeline of one kernel configuration, sized for a 228 KB SM (H100,
// H200; decode_plan.h counts the CTAs that fit the SM at hand).
//   block_n:  keys per ring stage, split over the four warps (16 or 32 each)
//   stages:   ring depth
//   min_ctas: CTAs per SM the registers are bounded for (__launch_bounds__),
//             the ones the shared memory admits, so that registers never cut
//             the occupancy the split plan assumes
// 16-bit caches: 64 keys, two or three tiles in flight per CTA while one is
// computed, with two (128) or three (64, 96) CTAs per SM.
// An FP8 cache reads half the bytes per key, and the kernel is then bound by
// the work of each tile (loads issued, two dependent products with their
// e4m3 conversions, the softmax, one barrier), not by the bytes in flight:
// on the H200 (B=8 S=32k, B=1 S=128k, B=64 S=4k; selftest_decode --bench)
// 128-key tiles in two stages with 3 CTAs per SM (100 KB in flight) ran
// 1.42-1.53x the bf16 cache, 64-key tiles in four stages (148 KB in flight)
// 1.25-1.30x, 128 x 3 with 2 CTAs 1.36-1.41x. So the FP8 stages trade ring
// depth for CTAs per SM, and with 16-row CTAs (head_dim <= 128: registers to
// spare) each warp takes 32 keys per stage: twice the independent products
// per softmax step, barrier and page lookup.
//   head_dim 64:  128 keys x 3 stages (17 KB each), 4 CTAs; 32 rows: 64 x 6, 3 CTAs
//   head_dim 128: 128 keys x 2 stages (33 KB), 3 CTAs; 32 rows: 64 x 5, 2 CTAs
//   head_dim 256: 64 keys x 2 stages (33 KB), 2 CTAs
// (cuda/tests/selftest_decode.cu --bench times the alternatives.)
struct DecodeTile {
  int block_n, stages, min_ctas;
};
constexpr DecodeTile decode_tile(int head_dim_bucket, int m_tiles, bool fp8) {
  if (!fp8) return {64, head_dim_bucket <= 96 ? 4 : 3, 0};
  if (head_dim_bucket <= 64) return m_tiles == 1 ? DecodeTile{128, 3, 4} : DecodeTile{64, 6, 3};
  if (head_dim_bucket <= 128) return m_tiles == 1 ? DecodeTile{128, 2, 3} : DecodeTile{64, 5, 2};
  return {64, 2, 2};
}
// Q's A fragments held in registers for the whole call (read from shared
// memory once) instead of read again by every tile's product: 16-bit caches
// with 16-row CTAs up to head_dim 128 (32 registers at 128). The 32-row CTAs
// and head_dim 256 have no registers to spare; FP8 reads its fp16 copy of Q
// in its own order (decode_fp8.cuh).
constexpr bool decode_q_in_registers(int head_dim_bucket, int m_tiles, bool fp8) {
  return !fp8 && m_tiles == 1 && head_dim_bucket <= 128;
}
// One ring stage: K and V (16-bit, or e4m3 with a float descale per key).
constexpr int decode_stage_bytes(int head_dim_bucket, int block_n, bool fp8) {
  return fp8 ? 2 * block_n * (head_dim_bucket + 4) : 2 * block_n * head_dim_bucket * 2;
}
// Dynamic shared memory: the Q tile (FP8: and its fp16 copy), the ring, the
// per-warp row statistics of the final merge.
constexpr int decode_smem_bytes(int head_dim_bucket, int m_tiles, bool fp8, DecodeTile t) {
  return (fp8 ? 2 : 1) * m_tiles * kDecodeMTileRows * head_dim_bucket * 2 +
         t.stages * decode_stage_bytes(head_dim_bucket, t.block_n, fp8) +
         2 * kDecodeWarps * m_tiles * kDecodeMTileRows * 4;
}
constexpr int decode_smem_bytes(int head_dim_bucket, int m_tiles, bool fp8 = false) {
  return decode_smem_bytes(head_dim_bucket, m_tiles, fp8, decode_tile(head_dim_bucket, m_tiles, fp8));
}
// The FP8 configurations fit their min_ctas in 228 KB (1 KB reserved per CTA).
constexpr bool decode_fits_sm(int head_dim_bucket, int m_tiles, bool fp8) {
  return decode_tile(head_dim_bucket, m_tiles, fp8).min_ctas *
             (decode_smem_bytes(head_dim_bucket, m_tiles, fp8) + 1024) <= 228 * 1024;
}
static_assert(decode_fits_sm(64, 1, true) && decode_fits_sm(64, 2, true) && decode_fits_sm(128, 1, true) &&
                  decode_fits_sm(128, 2, true) && decode_fits_sm(256, 1, true),
              "FP8 decode configurations within a 228 KB SM");

// The packed rows of one KV head: row r is token r / group of query head
// head_k * group + r % group (pack-GQA: one CTA reads the keys once for every
// query head that shares them). m-tiles per CTA for seqlen_q * group rows.
constexpr int decode_m_tiles(int seqlen_q, int group, int head_dim_bucket) {
  return seqlen_q * group > kDecodeMTileRows && head_dim_bucket <= 128 ? 2 : 1;
}
inline int decode_row_blocks(int seqlen_q, int group, int head_dim_bucket) {
  const int rows = decode_m_tiles(seqlen_q, group, head_dim_bucket) * kDecodeMTileRows;
  return (seqlen_q * group + rows - 1) / rows;
}

}  // namespace jax_flash::decode
