// The decoding kernel's pieces: its shape (DecodeConfig), the rows and keys
// of one CTA (DecodeBlock), the page lookup, the 16-bit Q / K / V tile loads
// and the element mask. The kernel is decode_kernel.cuh.
#pragma once

#include "decode/decode_params.h"
#include "decode/page_div.h"
#include "jax_flash/block_info.h"
#include "jax_flash/seqlen_info.h"
#include "sm80/mask.cuh"
#include "sm80/smem_layout.cuh"

namespace jax_flash::decode {

// exp2_approx: jax_flash/fast_math.cuh on a GPU, sm80 emulation otherwise.
using namespace sm80;  // NOLINT: the sm80 primitives are this kernel's vocabulary

// The tile is decode_params.h's decode_tile; the self-test's benchmark
// passes others (block_n, stages, min_ctas) to time the alternatives.
template <int kHeadDim_, int kMT_, bool kFp8_ = false,
          int kTileN_ = decode_tile(kHeadDim_, kMT_, kFp8_).block_n,
          int kTileStages_ = decode_tile(kHeadDim_, kMT_, kFp8_).stages,
          int kTileCtas_ = decode_tile(kHeadDim_, kMT_, kFp8_).min_ctas,
          bool kQRegs_ = decode_q_in_registers(kHeadDim_, kMT_, kFp8_)>
struct DecodeConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMT = kMT_;    // m-tiles (16 rows) per warp
  static constexpr bool kFp8 = kFp8_;  // an e4m3 cache (decode_fp8.cuh)
  static constexpr int kRows = kMT * kDecodeMTileRows;
  static constexpr DecodeTile kTile = {kTileN_, kTileStages_, kTileCtas_};
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kWarps = kDecodeWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinCtas = kTile.min_ctas;
  static constexpr bool kQRegs = kQRegs_;  // Q's fragments in registers
  static_assert(!kQRegs || !kFp8, "FP8 reads Q from its fp16 copy");
  // Each warp's slice of a tile: 16 or 32 keys, kNS score n-tiles of 8, kKS
  // k-steps of 16 in P V.
  static constexpr int kKeysPerWarp = kBlockN / kWarps;
  static constexpr int kNS = kKeysPerWarp / 8;
  static constexpr int kKS = kKeysPerWarp / 16;
  static constexpr int kStages = kTile.stages;
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
  static constexpr int kStageBytes = decode_stage_bytes(kHeadDim, kBlockN, kFp8);  // K then V (then descales)
  static constexpr int kSmemStats = kSmemRing + kStages * kStageBytes;
  static constexpr int kSmemMerge = kSmemQ16;
  static constexpr int kSmemBytes = kSmemStats + 2 * kWarps * kRows * 4;  // row max, row sum
  static_assert(kSmemBytes == decode_smem_bytes(kHeadDim, kMT, kFp8, kTile), "decode_params.h's size");
  static_assert(kSmemMerge + kWarps * kRows * kMergePitch * 4 <= kSmemStats, "merge buffer fits");
  static_assert(kKeysPerWarp == 16 || kKeysPerWarp == 32, "16 or 32 keys per warp");
  static_assert(kStages >= 2, "a tile in flight while one is computed");
};

// Which rows and keys one CTA owns, and where its tiles need the element mask.
struct DecodeBlock {
  int b, hk, split;
  PageDiv page_div;          // keys to pages (16-bit tile loads)
  int r0;                    // first packed row of the CTA
  BlockInfo blk;             // the sequence's geometry; rows packed (blk.group query heads per token)
  int n_first, n_last;       // this split's KV tiles [n_first, n_last)
  int64_t full_lo, full_hi;  // keys that every row of the CTA sees

  JF_DEVICE bool tile_needs_mask(int n0, int bn) const { return n0 < full_lo || n0 + bn > full_hi; }
};

// Each sequence's keys: its seqlens entry, within the cache's capacity (no
// pages: no keys).
JF_HOST_DEVICE BatchSeqlens decode_seqlens(const DecodeParams& p) {
  BatchSeqlens s{p.seqlen_q, p.num_pages > 0 ? p.max_pages * p.page_size : 0};
  s.seqused_k = p.seqlens;
  return s;
}

JF_DEVICE DecodeBlock decode_block(const DecodeParams& p, int rows_per_cta, int bn) {
  DecodeBlock d{0, 0, 0, PageDiv(p.page_size)};
  d.b = blockIdx.y / p.num_heads_k;
  d.hk = blockIdx.y % p.num_heads_k;
  d.split = blockIdx.z;
  d.r0 = blockIdx.x * rows_per_cta;
  d.blk = make_block_info(decode_seqlens(p)(d.b), p.window_left, p.window_right, p.num_heads / p.num_heads_k);
  d.blk.packed_kv_block_range(d.r0, rows_per_cta, bn, d.n_first, d.n_last);
  BlockInfo::split_blocks(d.split, p.num_splits, d.n_first, d.n_last);
  d.blk.packed_full_keys(d.r0, rows_per_cta, d.full_lo, d.full_hi);
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
    const bool ok = pr < d.blk.packed_rows() && c < p.head_dim;
    const Element* src = q;
    if (ok) {
      const int t = pr / d.blk.group, h = d.hk * d.blk.group + pr % d.blk.group;
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
  const int page0 = d.page_div.div(n0);
  const int in_page0 = d.page_div.mod(n0, page0);
  // Block-uniform: the whole tile in one page (a contiguous cache, or pages
  // of a multiple of the tile) takes one table lookup.
  const bool one_page = in_page0 + Cfg::kBlockN <= ps;
  if constexpr (Cfg::kThreads % kChunks == 0) {
    // A thread copies one 16-byte column c of rows r0 + i * kRowsPerPass.
    // On one page (block-uniform branch) the rows' offsets are one base and
    // a step per pass: the per-chunk page lookup, division and 64-bit
    // products stay off the common path.
    constexpr int kRowsPerPass = Cfg::kThreads / kChunks;
    const int r0 = tid / kChunks, c = (tid % kChunks) * 8;
    const bool col_ok = c < p.head_dim;
    const int64_t head = int64_t(d.hk) * p.kv_head_stride + c;
    if (one_page) {
      const int64_t step = int64_t(kRowsPerPass) * p.kv_row_stride;
      int64_t row_off = page_base(p, table, page0) + int64_t(in_page0 + r0) * p.kv_row_stride + head;
#pragma unroll
      for (int i = 0; i < kTotal / Cfg::kThreads; ++i) {
        const bool ok = col_ok && n0 + r0 + i * kRowsPerPass < d.blk.seqlen_k;
        const int64_t off = ok ? row_off : 0;
        row_off += step;
        const uint32_t so = KTile::offset(r0 + i * kRowsPerPass, c);
        sm80::cp_async_16(sK + so, k + off, ok);
        sm80::cp_async_16(sV + so, v + off, ok);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kTotal / Cfg::kThreads; ++i) {
        const int j = n0 + r0 + i * kRowsPerPass;
        const bool ok = col_ok && j < d.blk.seqlen_k;
        int64_t off = 0;
        if (ok) {
          const int page = d.page_div.div(j);
          off = page_base(p, table, page) + int64_t(d.page_div.mod(j, page)) * p.kv_row_stride + head;
        }
        const uint32_t so = KTile::offset(r0 + i * kRowsPerPass, c);
        sm80::cp_async_16(sK + so, k + off, ok);
        sm80::cp_async_16(sV + so, v + off, ok);
      }
    }
  } else {
    // Rows whose chunks the threads do not divide (head_dim 96: 12 per row):
    // each chunk's row and column from its index.
    const int64_t tile_base =
        one_page ? page_base(p, table, page0) + int64_t(in_page0) * p.kv_row_stride : 0;
    const int64_t head = int64_t(d.hk) * p.kv_head_stride;
#pragma unroll
    for (int i = 0; i < kTotal / Cfg::kThreads; ++i) {
      const int idx = tid + i * Cfg::kThreads;
      const int r = idx / kChunks, c = (idx % kChunks) * 8;
      const int j = n0 + r;
      const bool ok = j < d.blk.seqlen_k && c < p.head_dim;
      int64_t off = 0;
      if (ok) {
        if (one_page) {
          off = tile_base + int64_t(r) * p.kv_row_stride;
        } else {
          const int page = d.page_div.div(j);
          off = page_base(p, table, page) + int64_t(d.page_div.mod(j, page)) * p.kv_row_stride;
        }
        off += head + c;
      }
      const uint32_t so = KTile::offset(r, c);
      sm80::cp_async_16(sK + so, k + off, ok);
      sm80::cp_async_16(sV + so, v + off, ok);
    }
  }
}

// The element mask of one warp's (kMT * 16) x (kNS * 8) score block (keys
// kb .. kb + kNS * 8 - 1), in the sm80 C layout (sm80/mask.cuh).
template <int kMT, int kNS>
JF_DEVICE void mask_scores(float (&s)[kMT][kNS][4], const DecodeBlock& d, int kb, int lane) {
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int lo, hi;
      d.blk.packed_row_bounds(d.r0 + m * 16 + g + 8 * h, lo, hi);
      sm80::mask_outside(s, m, h, lo, hi, kb + 2 * tq);
    }
}

}  // namespace jax_flash::decode
