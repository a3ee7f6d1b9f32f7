// Epilogue of the sm90 backward, one consumer warpgroup: its part of dK
// (times the softmax scale) and dV -> 16-bit -> the K / V tiles (the
// 128B-swizzled [D/64][kBlockN][64] layout the TMA loads used) -> TMA store,
// which clips the seq and head-dim tails. The work split (Mainloop::Split)
// gives the WG's part: kKvRows rows x kKvCols columns of the tile (key split:
// its 64 keys, every column; column split: every key, its 128 columns; the
// head-dim pair: every key, the column blocks the split names per WG).
#pragma once

#include "bwd_tile.cuh"
#include "sm90/ptx/barrier.cuh"
#include "sm90/ptx/smem_ops.cuh"
#include "sm90/ptx/tma.cuh"
#include "sm90/ptx/wgmma.cuh"
#include "sm90/common/tma_desc.h"

namespace jax_flash::sm90 {

template <typename Mainloop>
struct BwdEpilogue {
  using Element = typename Mainloop::Element;
  using Cfg = typename Mainloop::Cfg;
  using Split = typename Mainloop::Split;
  static constexpr int kD = Cfg::kHeadDim;
  static constexpr int kBN = Cfg::kBlockN;
  static constexpr int kKR = Split::kKR;  // dK registers per thread
  static constexpr int kVR = Split::kVR;  // dV registers per thread
  // Rows / column blocks between consecutive WGs' parts (0: the WGs share them).
  static constexpr int kRowStep = Split::kKvRows == kBN ? 0 : Split::kKvRows;
  static constexpr int kColBlockStep = Split::kKvCols == kD ? 0 : Split::kKvCols / 64;
  static_assert(Cfg::kDkvSwapAB ||
                    (kKR == Split::kKvCols / 2 && (Cfg::kPair || kVR == kKR) && Split::kKvRows == 64),
                "a WG's part: 64 rows x kKvCols");
  // Rows of the dK / dV TMA store boxes: a WG's part (dKV_swapAB: its keys).
  static constexpr int kStoreRows = Cfg::kDkvSwapAB ? Split::kKvRows : 64;

  // ---------------------------------------------------------------- host -> device
  struct Arguments {
    GmemTensor dk, dv;  // dK / dV: the layouts (strides) of K / V
    float scale;        // softmax scale (dK is multiplied by it)
  };
  static bool to_params(const Arguments& a, BwdKernelArgs& p) {
    if (!encode_bshd(&p.tm_dk, tma_element<Element>(), a.dk, kStoreRows) ||
        !encode_bshd(&p.tm_dv, tma_element<Element>(), a.dv, kStoreRows))
      return false;
    p.scale = a.scale;
    p.head_dim = a.dk.head_dim;
    return true;
  }

  // ---------------------------------------------------------------- device
  // Byte offset in the tile of the packed pair acc[4j + 2h], acc[4j + 2h + 1]
  // (key 16 warp + g + 8h, column 8j + 2t of the WG's part).
  static JF_DEVICE uint32_t kv_offset(int wg, int warp, int lane, int j, int h) {
    return kv_offset_at(kRowStep * wg, kColBlockStep * wg, warp, lane, j, h);
  }
  // ... in the part whose first row is row0 and first column block cblk0.
  static JF_DEVICE uint32_t kv_offset_at(int row0, int cblk0, int warp, int lane, int j, int h) {
    const int row = row0 + 16 * warp + lane / 4;  // h = 0; row % 8 == lane / 4
    const uint32_t row_addr = uint32_t(row * 128 + 4 * (lane % 4));
    const uint32_t sw = uint32_t(lane / 4) << 4;
    return row_addr + uint32_t((cblk0 + j / 8) * kBN * 128) + ((uint32_t(j % 8) << 4) ^ sw) +
           uint32_t(h * 8 * 128);
  }
  JF_DEVICE static void store_kv_tile(const Split& c, const float (&acc)[kKR], uint32_t tile) {
#pragma unroll
    for (int j = 0; j < Split::kKvCols / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        ptx::st_shared_b32(tile + kv_offset(c.wg, c.warp, c.lane, j, h),
                           ptx::pack2<Element>(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
  }

  // The head-dim pair: the first `blocks` column blocks of acc (every key)
  // to column blocks [cblk0, cblk0 + blocks) of the tile.
  template <int kR>
  JF_DEVICE static void store_kv_blocks(const Split& c, const float (&acc)[kR], uint32_t tile, int cblk0,
                                        int blocks) {
#pragma unroll
    for (int j = 0; j < kR / 4; ++j)
      if (j / 8 < blocks) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
          ptx::st_shared_b32(tile + kv_offset_at(0, cblk0, c.warp, c.lane, j, h),
                             ptx::pack2<Element>(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
      }
  }

  // Stores the part of dK (scaled here) and dV of consumer warpgroup c (its
  // work split's view); all 128 threads of the WG.
  JF_DEVICE static void store(const Split& c, const BwdTile& w, float (&dk)[kKR], const float (&dv)[kVR]) {
    if constexpr (Cfg::kDkvSwapAB) {
      store_swapped(c, w, dk, dv);
    } else if constexpr (Cfg::kPair) {
      store_pair(c, w, dk, dv);
    } else {
      store_parts(c, w, dk, dv);
    }
  }
  // The buckets: the WG's part (kKvRows x kKvCols) of both tiles.
  JF_DEVICE static void store_parts(const Split& c, const BwdTile& w, float (&dk)[kKR], const float (&dv)[kVR]) {
    using namespace ptx;
    const BwdKernelArgs& a = c.a;
    const BwdSmem<Cfg>& sm = c.sm;
    const int n0 = w.n_block * kBN;
    const float scale = a.scale;
#pragma unroll
    for (int i = 0; i < kKR; ++i) dk[i] *= scale;
    named_bar_sync(kBwdBarEpi, 256);  // both WGs are past their last GEMM on K and V
    store_kv_tile(c, dk, sm.k());
    store_kv_tile(c, dv, sm.v());
    fence_proxy_async_smem();
    named_bar_sync(kBwdBarEpiWG + c.wg, 128);
    if constexpr (Cfg::kVarlen) {
      store_parts_varlen(c, w, n0);
      return;
    }
    // Parts entirely past seqlen_k (key split) or head_dim (column split,
    // head_dim <= 192: block 3 is padding) are not stored.
    if (c.warp == 0 && c.lane == 0 && (kRowStep == 0 || n0 + kRowStep * c.wg < a.mask.seqlen_k)) {
#pragma unroll
      for (int cb = 0; cb < Split::kKvCols / 64; ++cb) {
        const int cblk = kColBlockStep * c.wg + cb;  // column block of the tile
        if (kColBlockStep == 0 || 64 * cblk < a.head_dim) {
          tma_store_4d(&a.tm_dk, sm.k() + cblk * kBN * 128 + kRowStep * c.wg * 128, 64 * cblk,
                       n0 + kRowStep * c.wg, w.head_k, w.batch);
          tma_store_4d(&a.tm_dv, sm.v() + cblk * kBN * 128 + kRowStep * c.wg * 128, 64 * cblk,
                       n0 + kRowStep * c.wg, w.head_k, w.batch);
        }
      }
      bulk_commit();
      bulk_wait<0>();  // stores done before the CTA's shared memory goes away
    }
    __syncwarp();
  }

  // Varlen: the WG's staged part (rows from row0 = n0 + kRowStep wg of the
  // sequence) by TMA when it lies inside the sequence; the part that runs
  // past its end by guarded 16-byte row stores (a TMA box would overwrite
  // the next sequence's rows), rows below len_k and columns below head_dim.
  JF_DEVICE static void store_parts_varlen(const Split& c, const BwdTile& w, int n0) {
    using namespace ptx;
    const BwdKernelArgs& a = c.a;
    const BwdSmem<Cfg>& sm = c.sm;
    const BwdVarlenTile& vw = bwd_varlen<Cfg>(w);
    const int part_row = kRowStep * c.wg;  // the part's first row in the tile
    const int row0 = n0 + part_row;
    const int rows = vw.seq.len_k - row0;  // rows of the part inside the sequence
    if (rows <= 0) return;                 // WG-uniform
    if (rows >= Split::kKvRows) {
      if (c.warp == 0 && c.lane == 0) {
#pragma unroll
        for (int cb = 0; cb < Split::kKvCols / 64; ++cb) {
          const int cblk = kColBlockStep * c.wg + cb;
          if (kColBlockStep == 0 || 64 * cblk < a.head_dim) {
            tma_store_4d(&a.tm_dk, sm.k() + cblk * kBN * 128 + part_row * 128, 64 * cblk,
                         vw.seq.offset_k + row0, w.head_k, w.batch);
            tma_store_4d(&a.tm_dv, sm.v() + cblk * kBN * 128 + part_row * 128, 64 * cblk,
                         vw.seq.offset_k + row0, w.head_k, w.batch);
          }
        }
        bulk_commit();
        bulk_wait<0>();  // stores done before the CTA's shared memory goes away
      }
      __syncwarp();
      return;
    }
    // 8 chunks of 16 bytes per row and column block; 128 threads.
    constexpr int kChunks = Split::kKvRows * (Split::kKvCols / 64) * 8;
    const int tid = 32 * c.warp + c.lane;
    for (int i = tid; i < kChunks; i += 128) {
      const int r = i / ((Split::kKvCols / 64) * 8);
      const int cb = (i / 8) % (Split::kKvCols / 64), ch = i % 8;
      const int cblk = kColBlockStep * c.wg + cb;
      const int col = 64 * cblk + 8 * ch;
      if (r >= rows || col >= a.head_dim) continue;
      const uint32_t off = sw128_offset<kBN>(part_row + r, col);  // the staged tile's layout
      const int64_t row = vw.seq.offset_k + row0 + r;
      const GmemTensor* t[2] = {vw.dk, vw.dv};
      const uint32_t tile[2] = {sm.k(), sm.v()};
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const uint4 v = ld_shared_v4_u32(tile[x] + off);
        char* dst = static_cast<char*>(const_cast<void*>(t[x]->ptr)) +
                    (int64_t(w.batch) * t[x]->batch_stride + row * t[x]->row_stride +
                     int64_t(w.head_k) * t[x]->head_stride + col) *
                        int64_t(sizeof(Element));
        *reinterpret_cast<uint4*>(dst) = v;
      }
    }
  }

  // The head-dim pair (column split): WG wg's dK blocks [dk_block0, +dk_blocks)
  // and dV block dv_block (Split), every key; head_dim and head_dim_v exact.
  JF_DEVICE static void store_pair(const Split& c, const BwdTile& w, float (&dk)[kKR], const float (&dv)[kVR]) {
    using namespace ptx;
    const BwdKernelArgs& a = c.a;
    const BwdSmem<Cfg>& sm = c.sm;
    const int n0 = w.n_block * kBN;
    const float scale = a.scale;
#pragma unroll
    for (int i = 0; i < kKR; ++i) dk[i] *= scale;
    const int kb0 = Split::dk_block0(c.wg), kbs = Split::dk_blocks(c.wg), vb = Split::dv_block(c.wg);
    named_bar_sync(kBwdBarEpi, 256);  // both WGs are past their last GEMM on K and V
    store_kv_blocks(c, dk, sm.k(), kb0, kbs);
    store_kv_blocks(c, dv, sm.v(), vb, 1);
    fence_proxy_async_smem();
    named_bar_sync(kBwdBarEpiWG + c.wg, 128);
    if (c.warp == 0 && c.lane == 0) {
      for (int cb = kb0; cb < kb0 + kbs; ++cb)
        tma_store_4d(&a.tm_dk, sm.k() + cb * kBN * 128, 64 * cb, n0, w.head_k, w.batch);
      tma_store_4d(&a.tm_dv, sm.v() + vb * kBN * 128, 64 * vb, n0, w.head_k, w.batch);
      bulk_commit();
      bulk_wait<0>();  // stores done before the CTA's shared memory goes away
    }
    __syncwarp();
  }

  // dKV_swapAB (BwdPairSplit): the WG's dK^T / dV^T column blocks (its
  // keys, every column), packed and written back transposed into the K / V
  // tiles with the split's stmatrix.trans (rows = its keys), stored by TMA
  // boxes of its kKvRows keys; head_dim and head_dim_v exact, TMA clips the
  // keys past seqlen_k.
  JF_DEVICE static void store_swapped(const Split& c, const BwdTile& w, float (&dk)[kKR], const float (&dv)[kVR]) {
    using namespace ptx;
    const BwdKernelArgs& a = c.a;
    const BwdSmem<Cfg>& sm = c.sm;
    const int row0 = Split::kKvRows * c.wg;  // the WG's first key in the tile
    const int n0 = w.n_block * kBN + row0;
    const float scale = a.scale;
#pragma unroll
    for (int i = 0; i < kKR; ++i) dk[i] *= scale;
    named_bar_sync(kBwdBarEpi, 256);  // both WGs are past their last GEMM on K and V
#pragma unroll
    for (int cb = 0; cb < Split::kKB; ++cb) {
      uint32_t f[Split::kPK][4];
      acc_to_a<Element>(Split::block(dk, cb), f);
      c.store_t(f, sm.k() + cb * kBN * 128);
    }
#pragma unroll
    for (int cb = 0; cb < Split::kVB; ++cb) {
      uint32_t f[Split::kPK][4];
      acc_to_a<Element>(Split::block(dv, cb), f);
      c.store_t(f, sm.v() + cb * kBN * 128);
    }
    fence_proxy_async_smem();
    named_bar_sync(kBwdBarEpiWG + c.wg, 128);
    if (c.warp == 0 && c.lane == 0 && n0 < a.mask.seqlen_k) {  // no box entirely past seqlen_k
#pragma unroll
      for (int cb = 0; cb < Split::kKB; ++cb)
        tma_store_4d(&a.tm_dk, sm.k() + cb * kBN * 128 + row0 * 128, 64 * cb, n0, w.head_k, w.batch);
#pragma unroll
      for (int cb = 0; cb < Split::kVB; ++cb)
        tma_store_4d(&a.tm_dv, sm.v() + cb * kBN * 128 + row0 * 128, 64 * cb, n0, w.head_k, w.batch);
      bulk_commit();
      bulk_wait<0>();  // stores done before the CTA's shared memory goes away
    }
    __syncwarp();
  }
};

}  // namespace jax_flash::sm90
