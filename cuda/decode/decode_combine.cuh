// Split-KV combine: merges the num_splits normalised fp32 partials of each
// (batch, head, token) row by their LSE,
//   lse = log (sum_s exp(lse_s) + exp(sink)),   o = sum_s exp(lse_s - lse) o_s,
// and writes o in the output dtype and lse. The head's learnable sink
// (jax_flash/sinks.h; none: -inf) enters here once, never in a split's
// partial; a row that no split saw has O = 0 and LSE = the sink. One warp per
// row, two columns per lane and step; splits that saw no key (lse_s = -inf)
// weigh 0, and their partial rows (all written by the split kernel) never
// reach the output.
// The row's split LSEs are read once, all at a time (lane l holds splits l,
// l + 32, ...), and reach the sums through shuffles in split order: the
// partial rows' loads then depend on nothing but the address, so that a
// handful of them are in flight at once, where reading each LSE before its
// partial row would take two dependent memory round trips per split.
#pragma once

#include "decode/decode_params.h"
#include "sm80/mma.cuh"
#include "sm80/softmax.cuh"

namespace jax_flash::decode {

using namespace sm80;  // NOLINT: exp2_approx (fast_math.cuh, or its emulation)

constexpr int kCombineWarps = 4;

template <typename Element>
__global__ void __launch_bounds__(kCombineWarps * 32)
    decode_combine_kernel(const __grid_constant__ DecodeParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t rows = int64_t(p.batch) * p.num_heads * p.seqlen_q;
  const int64_t row = int64_t(blockIdx.x) * kCombineWarps + warp;  // (b * H + h) * T + t
  if (row >= rows) return;
  const int t = int(row % p.seqlen_q);
  const int64_t bh = row / p.seqlen_q;
  const int h = int(bh % p.num_heads), b = int(bh / p.num_heads);
  const float* lse_s = p.lse_partial + row;
  constexpr int kPerLane = kDecodeMaxSplits / 32;
  float lse_lane[kPerLane];  // splits lane + 32 i
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int s = lane + 32 * i;
    lse_lane[i] = s < p.num_splits ? __ldg(lse_s + int64_t(s) * rows) : -INFINITY;
    mx = fmaxf(mx, lse_lane[i]);
  }
#pragma unroll
  for (int d = 16; d >= 1; d /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  // Split s's entry of a per-lane array (warp-uniform s, no branch: the
  // shuffles stay outside any divergent code).
  auto of_split = [&](const float (&x)[kPerLane], int s) {
    float v = x[0];
#pragma unroll
    for (int i = 1; i < kPerLane; ++i)
      if (s >= 32 * i) v = x[i];
    return __shfl_sync(0xffffffffu, v, s % 32);
  };
  const float sink = sink_of(p.sinks, b, h, p.num_heads);
  float lse = sink;  // a row no split saw: O = 0, LSE = the sink (-inf without)
  if (mx != -INFINITY) {
    float sum = 0.f;
    for (int s = 0; s < p.num_splits; ++s) sum += exp2_approx((of_split(lse_lane, s) - mx) * kLog2e);
    lse = mx + __logf(sum);
    if (sink != -INFINITY) lse = lse_with_sink(lse, sink);
  }
  // Each split's weight exp(lse_s - lse); 0 for a split that saw no key.
  float w_lane[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    w_lane[i] = lse_lane[i] == -INFINITY ? 0.f : exp2_approx((lse_lane[i] - lse) * kLog2e);
  Element* o = static_cast<Element*>(p.o) + b * p.o_batch_stride + t * p.o_row_stride + h * p.o_head_stride;
  for (int c0 = 0; c0 < p.head_dim; c0 += 64) {  // warp-uniform: every lane shuffles
    const int c = c0 + 2 * lane;
    const bool in_row = c < p.head_dim;
    const float* partial = p.o_partial + row * p.head_dim + (in_row ? c : 0);
    float x = 0.f, y = 0.f;
    // kBatch splits' loads issued before their sums, unconditionally (a lane
    // past the row reads its column 0, splits past num_splits the last one):
    // all in flight at once. A row that weighs 0 (an empty split, or none)
    // is discarded by the select, NaN or not.
    constexpr int kBatch = 8;
    for (int s0 = 0; s0 < p.num_splits; s0 += kBatch) {
      float2 v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int s = min(s0 + j, p.num_splits - 1);
        v[j] = __ldg(reinterpret_cast<const float2*>(partial + s * rows * p.head_dim));
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float w_s = of_split(w_lane, (s0 + j) % kDecodeMaxSplits);
        const float w = s0 + j < p.num_splits ? w_s : 0.f;
        x = fmaf(w, w != 0.f ? v[j].x : 0.f, x);
        y = fmaf(w, w != 0.f ? v[j].y : 0.f, y);
      }
    }
    if (in_row) *reinterpret_cast<uint32_t*>(o + c) = Pack<Element>::pack(x, y);
  }
  if (lane == 0) p.lse[row] = lse;
}

}  // namespace jax_flash::decode
