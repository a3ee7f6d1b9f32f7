// Forward epilogue: normalised O (fp32 registers) -> 16-bit -> shared memory
// (swizzled, conflict free) -> 16-byte coalesced global stores; LSE per row.
#pragma once

#include "smem_layout.cuh"
#include "warp_gemm.cuh"

namespace jax_flash::sm80 {

template <typename Element, typename Cfg>
JF_DEVICE void write_output(char* smem_o, const float (&acc_o)[Cfg::kMT][Cfg::kNT_O][4],
                            const float (&lse_rows)[Cfg::kMT][2], Element* o, int64_t o_row_stride,
                            float* lse, int rows_valid, int head_dim_v, int wrow, int tid) {
  const int lane = tid % 32;
  store_c<Element, Cfg::kMT, Cfg::kNT_O, typename Cfg::OTile>(smem_o, acc_o, wrow, 0, lane);
  if ((lane & 3) == 0) {  // one lane per quad owns the row's statistics
#pragma unroll
    for (int i = 0; i < Cfg::kMT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wrow + i * 16 + (lane >> 2) + 8 * h;
        if (r < rows_valid) lse[r] = lse_rows[i][h];
      }
  }
  __syncthreads();
  store_tile<typename Cfg::OTile, Cfg::kThreads>(smem_o, o, o_row_stride, rows_valid, head_dim_v, tid);
}

// A query block that sees no key at all: O = 0, LSE = -inf (or the head's
// sink logit, jax_flash/sinks.h).
template <typename Element, typename Cfg>
JF_DEVICE void write_empty_rows(Element* o, int64_t o_row_stride, float* lse, int rows_valid,
                                int head_dim_v, int tid, float sink = -INFINITY) {
  constexpr int kChunksPerRow = Cfg::kHeadDimV / 8;
  for (int idx = tid; idx < Cfg::kBlockM * kChunksPerRow; idx += Cfg::kThreads) {
    const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
    if (r < rows_valid && c < head_dim_v)
      *reinterpret_cast<uint4*>(o + r * o_row_stride + c) = make_uint4(0, 0, 0, 0);
  }
  for (int r = tid; r < Cfg::kBlockM; r += Cfg::kThreads)
    if (r < rows_valid) lse[r] = sink;
}

}  // namespace jax_flash::sm80
