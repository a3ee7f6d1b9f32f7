// Shared-memory tile layout (swizzled, bank-conflict free for ldmatrix) and the
// cooperative global -> shared / shared -> global copies of whole tiles.
//
// A tile is kRows x kCols 16-bit elements. It is stored as column blocks of
// kBlockCols elements (64 = 128 bytes per row, or 32 = 64 bytes per row when
// kCols is not a multiple of 64, i.e. head dim 96); each block is row-major and
// contiguous. Inside a block the byte offset has bits [4,7) (the 16-byte chunk
// within a 128-byte line) XORed with bits [7,10) (the line index mod 8).
//
// Why: ldmatrix and the mma operand loads always read "8 consecutive rows
// (starting at a multiple of 8), the same 16-byte chunk column". Without the
// XOR those 8 chunks sit in the same 4 banks (row pitch is a multiple of 128
// bytes), an 8-way conflict. With it, the 8 chunks land in 8 distinct 16-byte
// bank groups: for 128-byte rows the XOR key is row % 8; for 64-byte rows two
// rows share a line and the key is (row / 2) % 8, which still spreads the 8
// chunks over 8 groups ({c, c^1, c^2, c^3} in one half-line, the same +4 in the
// other). The host emulator (cuda/tests/emu) counts ldmatrix wavefronts and
// reports exactly 1 per 8x8 matrix for every kernel and head dim.
#pragma once

#include <cstdint>

#include "mma.cuh"

namespace jax_flash::sm80 {

template <int kRows_, int kCols_>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kBlockCols = (kCols % 64 == 0) ? 64 : 32;
  static_assert(kCols % kBlockCols == 0, "tile width must be a multiple of 32");
  static_assert(kRows % 8 == 0, "tile height must be a multiple of 8");
  static constexpr int kRowBytes = kBlockCols * 2;
  static constexpr int kBlockBytes = kRows * kRowBytes;
  static constexpr int kBytes = kRows * kCols * 2;

  // Byte offset of element (r, c). Valid for any c (the swizzle only moves
  // whole 16-byte chunks), so it serves both 16-byte chunk copies and the
  // 4-byte fragment stores of the epilogues.
  JF_DEVICE static uint32_t offset(int r, int c) {
    const uint32_t lin = uint32_t(r) * kRowBytes + uint32_t(c % kBlockCols) * 2;
    return uint32_t(c / kBlockCols) * kBlockBytes + (lin ^ (((lin >> 7) & 7u) << 4));
  }
};

// Thread -> chunk mapping of the cooperative tile copies. The tile is walked
// column block by column block; inside a block a thread always owns the same
// 16-byte chunk column and rows tid / kChunksPerRow + i * kRowsPerPass. Because
// kRowsPerPass is a multiple of the swizzle period (8 rows of 128 bytes, 16 of
// 64 bytes), every (block, pass) shared-memory address is the thread's base
// plus a compile-time immediate, and the global address is one pointer plus a
// per-pass stride: a handful of registers instead of one address per chunk.
// Global accesses: consecutive threads read consecutive 16-byte chunks of a
// row (a 128- or 64-byte contiguous segment per row).
template <typename Tile, int kThreads>
struct TileCopy {
  static constexpr int kChunksPerRow = Tile::kBlockCols / 8;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static constexpr int kPasses = Tile::kRows / kRowsPerPass;
  static constexpr int kBlocks = Tile::kCols / Tile::kBlockCols;
  static constexpr int kSwizzlePeriod = 1024 / Tile::kRowBytes;
  static_assert(kThreads % kChunksPerRow == 0, "threads must cover whole rows");
  static_assert(kRowsPerPass % kSwizzlePeriod == 0, "passes must keep the swizzle phase");
  static_assert(Tile::kRows % kRowsPerPass == 0, "tile rows must split into passes");

  int row, col;          // the thread's first row and its column inside a block
  uint32_t smem_off;     // Tile::offset(row, col)

  JF_DEVICE explicit TileCopy(int tid)
      : row(tid / kChunksPerRow), col((tid % kChunksPerRow) * 8), smem_off(Tile::offset(row, col)) {}

  JF_DEVICE static constexpr uint32_t imm(int b, int i) {
    return uint32_t(b * Tile::kBlockBytes + i * kRowsPerPass * Tile::kRowBytes);
  }
};

// Cooperative copy of a tile from global memory (row pitch `row_stride`
// elements, 16-byte aligned rows) into a SmemTile with 16-byte cp.async. Row r
// is loaded iff r < rows_valid, columns iff c < cols_valid (head_dim, a
// multiple of 8); everything else is zero-filled, so padded rows and columns
// contribute exactly 0 to every product.
template <typename Tile, int kThreads, typename Element>
JF_DEVICE void load_tile_async(uint32_t smem_base, const Element* gmem, int64_t row_stride,
                               int rows_valid, int cols_valid, int tid) {
  using C = TileCopy<Tile, kThreads>;
  const C cp(tid);
  const Element* src = gmem + cp.row * row_stride + cp.col;
  const uint32_t dst = smem_base + cp.smem_off;
  // Compare against immediates: no per-pass row index stays live.
  const int rows_left = rows_valid - cp.row, cols_left = cols_valid - cp.col;
#pragma unroll
  for (int i = 0; i < C::kPasses; ++i) {
    const bool row_ok = i * C::kRowsPerPass < rows_left;
#pragma unroll
    for (int b = 0; b < C::kBlocks; ++b) {
      const bool ok = row_ok && b * Tile::kBlockCols < cols_left;
      // An invalid chunk still needs a legal address: use the tile base.
      cp_async_16(dst + C::imm(b, i), ok ? src + b * Tile::kBlockCols : gmem, ok);
    }
    src += C::kRowsPerPass * row_stride;
  }
}

// Cooperative copy of a tile from shared memory to global memory with 16-byte
// stores, skipping rows >= rows_valid and columns >= cols_valid.
template <typename Tile, int kThreads, typename Element>
JF_DEVICE void store_tile(const char* smem_base, Element* gmem, int64_t row_stride, int rows_valid,
                          int cols_valid, int tid) {
  using C = TileCopy<Tile, kThreads>;
  const C cp(tid);
  Element* dst = gmem + cp.row * row_stride + cp.col;
  const int rows_left = rows_valid - cp.row, cols_left = cols_valid - cp.col;
#pragma unroll
  for (int i = 0; i < C::kPasses; ++i) {
    const bool row_ok = i * C::kRowsPerPass < rows_left;
#pragma unroll
    for (int b = 0; b < C::kBlocks; ++b) {
      if (row_ok && b * Tile::kBlockCols < cols_left) {
        const uint4 v = *reinterpret_cast<const uint4*>(smem_base + cp.smem_off + C::imm(b, i));
        *reinterpret_cast<uint4*>(dst + b * Tile::kBlockCols) = v;
      }
    }
    dst += C::kRowsPerPass * row_stride;
  }
}

}  // namespace jax_flash::sm80
