// Warp-level GEMMs on m16n8k16 tiles: one warp accumulates a
// (kMT*16) x (kNT*8) block acc[kMT][kNT][4] in the C-fragment layout.
//
// Operand sources:
//   A from shared memory, stored [m][k] ("A") or [k][m] ("A^T", ldmatrix.trans),
//     or from registers (fragments already packed, e.g. P or dS);
//   B stored [n][k] (K for Q K^T: ldmatrix) or [k][n] (V for P V: ldmatrix.trans).
// All indices are compile-time after unrolling, so fragments stay in registers.
#pragma once

#include "mma.cuh"

namespace jax_flash::sm80 {

// Per-lane coordinates of the 8x8 sub-matrix row each lane addresses in an
// ldmatrix.x4 (see the lane -> matrix mapping in mma.cuh).
struct LdsmLane {
  int lane;
  JF_DEVICE int r8() const { return lane & 7; }                 // row within the 8x8
  JF_DEVICE int bit3() const { return ((lane >> 3) & 1) * 8; }  // matrices 1,3
  JF_DEVICE int bit4() const { return (lane >> 4) * 8; }        // matrices 2,3
};

constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

// Address of one lane's ldmatrix row for an operand whose (row, col) origin is
// only known at run time (warp position + lane part), displaced by
// compile-time (dr, dc), both multiples of 16.
//
// Fast path (kFast): the swizzle is linear over XOR and row displacements of
// 16 rows move whole 1024-byte swizzle periods, so
//   addr(dr, dc) = (base ^ ((dc % BC) * 2)) + (dc / BC) * block_bytes + dr * row_bytes
// with base = addr(0, 0): one LOP3 and immediates, a single live register per
// operand. It needs the column origin's bits disjoint from dc's, i.e. the
// origin is 0 or a multiple of a power-of-two column span, and tile bases
// aligned to 1024 bytes (all tiles are multiples of 1 KB from a 1 KB-aligned
// dynamic shared memory base).
// Slow path: the full swizzle per access (a few integer ops), for the odd
// 48-column spans of head dim 96.
template <typename Tile, bool kFast>
struct FragAddr {
  uint32_t tile_base;
  int row, col;
  uint32_t base;

  JF_DEVICE FragAddr(uint32_t tile_base_, int row_, int col_)
      : tile_base(tile_base_), row(row_), col(col_), base(tile_base_ + Tile::offset(row_, col_)) {
    // Opaque to the optimiser: the XOR-ed per-column variants of `base` are
    // then recomputed at each use (one LOP3) instead of being hoisted out of
    // the KV loop into extra live registers.
    asm volatile("" : "+r"(base));
  }

  JF_DEVICE uint32_t at(int dr, int dc) const {
    if constexpr (kFast) {
      return (base ^ uint32_t((dc % Tile::kBlockCols) * 2)) +
             uint32_t((dc / Tile::kBlockCols) * Tile::kBlockBytes + dr * Tile::kRowBytes);
    } else {
      return tile_base + Tile::offset(row + dr, col + dc);
    }
  }
};

// Lane addresses of the four operand kinds; the origin (m0 / n0) may be
// warp-dependent, the k origin is always 0 (whole-tile reductions).
//  A [m][k]:  rows m0 + r8 + bit3, cols bit4     (ldmatrix)
//  A^T [k][m]: rows r8 + bit4,     cols m0 + bit3 (ldmatrix.trans)
//  B [n][k]:  rows n0 + r8 + bit4, cols bit3     (ldmatrix)
//  B [k][n]:  rows r8 + bit3,      cols n0 + bit4 (ldmatrix.trans)
// b[0],b[1] receive n-tile n, b[2],b[3] n-tile n+8 (two n-tiles per load).
template <typename Tile>
JF_DEVICE FragAddr<Tile, true> addr_a(uint32_t base, int m0, LdsmLane l) {
  return {base, m0 + l.r8() + l.bit3(), l.bit4()};
}
template <typename Tile, bool kFast>
JF_DEVICE FragAddr<Tile, kFast> addr_a_trans(uint32_t base, int m0, LdsmLane l) {
  return {base, l.r8() + l.bit4(), m0 + l.bit3()};
}
template <typename Tile>
JF_DEVICE FragAddr<Tile, true> addr_b_nk(uint32_t base, int n0, LdsmLane l) {
  return {base, n0 + l.r8() + l.bit4(), l.bit3()};
}
template <typename Tile, bool kFast>
JF_DEVICE FragAddr<Tile, kFast> addr_b_kn(uint32_t base, int n0, LdsmLane l) {
  return {base, l.r8() + l.bit3(), n0 + l.bit4()};
}

template <int kMT, int kNT>
JF_DEVICE void zero(float (&acc)[kMT][kNT][4]) {
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.f;
}

// acc += A B over kK (a multiple of 16) reduction steps, A and B both in
// shared memory.
//   kATrans: A stored [k][m] instead of [m][k].
//   kBKN:    B stored [k][n] instead of [n][k].
//   kZeroColOrigin: the operand read along its columns with a warp origin
//     (A^T's m0, B[k][n]'s n0) is known to start at column 0 (enables the
//     fast address path whatever the span).
// m0 / n0: the warp's origin in A's m and B's n; the k origin is 0.
template <typename Element, int kMT, int kNT, int kK, bool kATrans, bool kBKN, typename ATile,
          typename BTile, bool kZeroColOrigin = false>
JF_DEVICE void gemm_ss(float (&acc)[kMT][kNT][4], uint32_t a_base, int m0, uint32_t b_base, int n0,
                       LdsmLane l) {
  static_assert(kNT % 2 == 0 && kK % 16 == 0, "warp tile must be 16-column granular");
  constexpr bool kFastA = kZeroColOrigin || is_pow2(kMT * 16);
  constexpr bool kFastB = kZeroColOrigin || is_pow2(kNT * 8);
  const auto fa = [&] {
    if constexpr (kATrans) return addr_a_trans<ATile, kFastA>(a_base, m0, l);
    else return addr_a<ATile>(a_base, m0, l);
  }();
  const auto fb = [&] {
    if constexpr (kBKN) return addr_b_kn<BTile, kFastB>(b_base, n0, l);
    else return addr_b_nk<BTile>(b_base, n0, l);
  }();
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
      if constexpr (kATrans)
        ldmatrix_x4_trans(a[m], fa.at(ks * 16, m * 16));
      else
        ldmatrix_x4(a[m], fa.at(m * 16, ks * 16));
    }
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      uint32_t b[4];
      if constexpr (kBKN)
        ldmatrix_x4_trans(b, fb.at(ks * 16, np * 16));
      else
        ldmatrix_x4(b, fb.at(np * 16, ks * 16));
#pragma unroll
      for (int m = 0; m < kMT; ++m) {
        Mma<Element>::run(acc[m][2 * np], a[m], b[0], b[1]);
        Mma<Element>::run(acc[m][2 * np + 1], a[m], b[2], b[3]);
      }
    }
  }
}

// acc += A B with A given as register fragments a[kMT][kK/16][4] (for example
// P packed from the previous product's accumulators), B in shared memory.
template <typename Element, int kMT, int kNT, int kK, bool kBKN, typename BTile,
          bool kZeroColOrigin = false>
JF_DEVICE void gemm_rs(float (&acc)[kMT][kNT][4], const uint32_t (&a)[kMT][kK / 16][4],
                       uint32_t b_base, int n0, LdsmLane l) {
  static_assert(kNT % 2 == 0 && kK % 16 == 0, "warp tile must be 16-column granular");
  constexpr bool kFastB = kZeroColOrigin || is_pow2(kNT * 8);
  const auto fb = [&] {
    if constexpr (kBKN) return addr_b_kn<BTile, kFastB>(b_base, n0, l);
    else return addr_b_nk<BTile>(b_base, n0, l);
  }();
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      uint32_t b[4];
      if constexpr (kBKN)
        ldmatrix_x4_trans(b, fb.at(ks * 16, np * 16));
      else
        ldmatrix_x4(b, fb.at(np * 16, ks * 16));
#pragma unroll
      for (int m = 0; m < kMT; ++m) {
        Mma<Element>::run(acc[m][2 * np], a[m][ks], b[0], b[1]);
        Mma<Element>::run(acc[m][2 * np + 1], a[m][ks], b[2], b[3]);
      }
    }
  }
}

// Pack fp32 accumulators acc[kMT][kNT][4] (C layout, kNT*8 columns) into A
// fragments a[kMT][kNT/2][4] (16-bit), the C -> A identity noted in mma.cuh.
template <typename Element, int kMT, int kNT>
JF_DEVICE void pack_c_to_a(uint32_t (&a)[kMT][kNT / 2][4], const float (&acc)[kMT][kNT][4]) {
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int j = 0; j < kNT / 2; ++j) {
      a[m][j][0] = Mma<Element>::pack(acc[m][2 * j][0], acc[m][2 * j][1]);
      a[m][j][1] = Mma<Element>::pack(acc[m][2 * j][2], acc[m][2 * j][3]);
      a[m][j][2] = Mma<Element>::pack(acc[m][2 * j + 1][0], acc[m][2 * j + 1][1]);
      a[m][j][3] = Mma<Element>::pack(acc[m][2 * j + 1][2], acc[m][2 * j + 1][3]);
    }
}

// Store fp32 accumulators (times `mul`) as 16-bit values into a tile stored
// [m][n] at origin (m0, n0): each lane writes 4-byte pairs; with the swizzle the
// 32 lanes of one store hit 32 distinct banks.
template <typename Element, int kMT, int kNT, typename Tile>
JF_DEVICE void store_c(char* base, const float (&acc)[kMT][kNT][4], int m0, int n0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const int r = m0 + m * 16 + g, c = n0 + n * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(base + Tile::offset(r, c)) =
          Mma<Element>::pack(acc[m][n][0], acc[m][n][1]);
      *reinterpret_cast<uint32_t*>(base + Tile::offset(r + 8, c)) =
          Mma<Element>::pack(acc[m][n][2], acc[m][n][3]);
    }
}

}  // namespace jax_flash::sm80
