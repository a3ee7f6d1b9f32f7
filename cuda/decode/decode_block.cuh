// The decoding kernel's pieces: its shape (DecodeConfig), the rows and keys
// of one CTA (DecodeBlock), the page lookup, the 16-bit Q / K / V tile loads
// and the element mask. The kernel is decode_kernel.cuh.
#pragma once

#include "decode/decode_params.h"
#include "jax_flash/block_info.h"  // min64, max64
#include "sm80/smem_layout.cuh"

namespace jax_flash::decode {

// exp2_approx: jax_flash/fast_math.cuh on a GPU, sm80 emulation otherwise.
using namespace sm80;  // NOLINT: the sm80 primitives are this kernel's vocabulary

template <int kHeadDim_, int kMT_, bool kFp8_ = false>
struct DecodeConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMT = kMT_;    // m-tiles (16 rows) per warp
  static constexpr bool kFp8 = kFp8_;  // an e4m3 cache (decode_fp8.cuh)
  static constexpr int kRows = kMT * kDecodeMTileRows;
  static constexpr int kBlockN = kDecodeBlockN;
  static constexpr int kWarps = kDecodeWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKeysPerWarp = kBlockN / kWarps;  // 16: one k-step of P V
  static constexpr int kStages = decode_stages(kHeadDim, kFp8);
  using QTile = SmemTile<kRows, kHeadDim>;
  using KTile = SmemTile<kBlockN, kHeadDim>;
  static constexpr int kNT_O = kHeadDim / 8;
  // Layout: Q, (FP8: Q in fp16, head dim permuted), the ring, the row
  // statistics. The fp32 merge buffer [warps][rows][kHeadDim + 4] (the pad
  // spreads the fragment stores over the banks) reuses everything after Q.
  static constexpr int kMergePitch = kHeadDim + 4;
  static constexpr int kSmemQ = 0;
  static constexpr int kSmemQ16 = kSmemQ + QTile::kBytes;
  static constexpr int kSmemRing = kSmemQ16 + (kFp8 ? QTile::kBytes : 0);
  static constexpr int kStageBytes = decode_stage_bytes(kHeadDim, kFp8);  // K then V (then descales)
  static constexpr int kSmemStats = kSmemRing + kStages * kStageBytes;
  static constexpr int kSmemMerge = kSmemQ16;
  static constexpr int kSmemBytes = kSmemStats + 2 * kWarps * kRows * 4;  // row max, row sum
  static_assert(kSmemBytes == decode_smem_bytes(kHeadDim, kMT, kFp8), "decode_params.h's size");
  static_assert(kSmemMerge + kWarps * kRows * kMergePitch * 4 <= kSmemStats, "merge buffer fits");
  static_assert(kKeysPerWarp == 16, "one 16-key slice per warp");
};

// Which rows and keys one CTA owns, and where its tiles need the element mask.
struct DecodeBlock {
  int b, hk, split;
  int group;       // query heads per KV head
  int r0, rows;    // first packed row of the CTA; packed rows in total
  int seqlen_k;    // this sequence's keys
  int off;         // query token t sits at key position t + off
  int n_first, n_last;    // this split's KV tiles [n_first, n_last)
  int64_t full_lo, full_hi;  // keys that every row of the CTA sees

  JF_DEVICE bool tile_needs_mask(int n0, int bn) const { return n0 < full_lo || n0 + bn > full_hi; }
};

JF_DEVICE DecodeBlock decode_block(const DecodeParams& p, int rows_per_cta, int bn) {
  DecodeBlock d;
  d.b = blockIdx.y / p.num_heads_k;
  d.hk = blockIdx.y % p.num_heads_k;
  d.split = blockIdx.z;
  d.group = p.num_heads / p.num_heads_k;
  d.rows = p.seqlen_q * d.group;
  d.r0 = blockIdx.x * rows_per_cta;
  const int cap = p.num_pages > 0 ? p.max_pages * p.page_size : 0;  // no pages: no keys
  d.seqlen_k = max(0, min(__ldg(p.seqlens + d.b), cap));
  d.off = d.seqlen_k - p.seqlen_q;
  const int64_t t_lo = d.r0 / d.group;
  const int64_t t_hi = (min(d.r0 + rows_per_cta, d.rows) - 1) / d.group;
  int64_t lo = 0, hi = d.seqlen_k;
  d.full_lo = 0;
  d.full_hi = d.seqlen_k;
  if (p.window_left >= 0) {
    lo = max64(0, t_lo + d.off - p.window_left);
    d.full_lo = t_hi + d.off - p.window_left;
  }
  if (p.window_right >= 0) {
    hi = min64(hi, t_hi + d.off + p.window_right + 1);
    d.full_hi = min64(d.full_hi, t_lo + d.off + p.window_right + 1);
  }
  int first = 0, last = 0;
  if (hi > lo) {
    first = int(lo / bn);
    last = int((hi + bn - 1) / bn);
  }
  const int per = (last - first + p.num_splits - 1) / p.num_splits;
  d.n_first = min(last, first + d.split * per);
  d.n_last = min(last, d.n_first + per);
  return d;
}

// Q tile: packed row r of the CTA is token (r0 + r) / group of head
// hk * group + (r0 + r) % group. Rows past the packed rows and columns past
// head_dim are zero-filled.
template <typename Element, typename Cfg>
JF_DEVICE void load_q_tile(uint32_t sQ, const DecodeParams& p, const DecodeBlock& d, int tid) {
  constexpr int kChunks = Cfg::kHeadDim / 8;
  const Element* q = static_cast<const Element*>(p.q);
  for (int idx = tid; idx < Cfg::kRows * kChunks; idx += Cfg::kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int pr = d.r0 + r;
    const bool ok = pr < d.rows && c < p.head_dim;
    const Element* src = q;
    if (ok) {
      const int t = pr / d.group, h = d.hk * d.group + pr % d.group;
      src = q + d.b * p.q_batch_stride + t * p.q_row_stride + h * p.q_head_stride + c;
    }
    sm80::cp_async_16(sQ + Cfg::QTile::offset(r, c), src, ok);
  }
}

// The pool index of a sequence's page `page` (clamped into the pool), and
// where that page's rows start.
JF_DEVICE int page_id(const DecodeParams& p, const int32_t* table, int page) {
  return min(max(__ldg(table + page), 0), p.num_pages - 1);
}
JF_DEVICE int64_t page_base(const DecodeParams& p, const int32_t* table, int page) {
  return int64_t(page_id(p, table, page)) * p.kv_page_stride;
}

// K and V rows n0 .. n0 + kBlockN - 1 of sequence b, head hk, into one ring
// stage. Keys past seqlen_k and columns past head_dim are zero-filled (the
// mask removes those keys; zero V rows add nothing).
template <typename Element, typename Cfg>
JF_DEVICE void load_kv_tile(uint32_t sK, uint32_t sV, const DecodeParams& p, const DecodeBlock& d,
                            int n0, int tid) {
  using KTile = typename Cfg::KTile;
  constexpr int kChunks = Cfg::kHeadDim / 8;
  constexpr int kTotal = Cfg::kBlockN * kChunks;
  static_assert(kTotal % Cfg::kThreads == 0, "whole passes");
  const Element* k = static_cast<const Element*>(p.k);
  const Element* v = static_cast<const Element*>(p.v);
  const int32_t* table = p.page_table + int64_t(d.b) * p.max_pages;
  const int ps = p.page_size;
  const int page0 = n0 / ps;
  // Block-uniform: the whole tile in one page (a contiguous cache, or pages
  // of a multiple of the tile) takes one table lookup.
  const bool one_page = (n0 + Cfg::kBlockN - 1) / ps == page0;
  const int64_t tile_base = one_page ? page_base(p, table, page0) + int64_t(n0 - page0 * ps) * p.kv_row_stride : 0;
  const int64_t head = int64_t(d.hk) * p.kv_head_stride;
#pragma unroll
  for (int i = 0; i < kTotal / Cfg::kThreads; ++i) {
    const int idx = tid + i * Cfg::kThreads;
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int j = n0 + r;
    const bool ok = j < d.seqlen_k && c < p.head_dim;
    int64_t off = 0;
    if (ok) {
      off = one_page ? tile_base + int64_t(r) * p.kv_row_stride
                     : page_base(p, table, j / ps) + int64_t(j % ps) * p.kv_row_stride;
      off += head + c;
    }
    const uint32_t so = KTile::offset(r, c);
    sm80::cp_async_16(sK + so, k + off, ok);
    sm80::cp_async_16(sV + so, v + off, ok);
  }
}

// The element mask of one warp's (kMT * 16) x 16 score block (keys kb .. kb + 15).
template <int kMT>
JF_DEVICE void mask_scores(float (&s)[kMT][2][4], const DecodeParams& p, const DecodeBlock& d, int kb,
                           int lane) {
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t pos = int64_t((d.r0 + m * 16 + g + 8 * h) / d.group) + d.off;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int key = kb + n * 8 + 2 * tq + j;
          const bool vis = key < d.seqlen_k && (p.window_left < 0 || key >= pos - p.window_left) &&
                           (p.window_right < 0 || key <= pos + p.window_right);
          if (!vis) s[m][n][2 * h + j] = -INFINITY;
        }
    }
}

}  // namespace jax_flash::decode
