// Split-KV combine: merges the num_splits normalised fp32 partials of each
// (batch, head, token) row by their LSE,
//   lse = log (sum_s exp(lse_s) + exp(sink)),   o = sum_s exp(lse_s - lse) o_s,
// and writes o in the output dtype and lse. The head's learnable sink
// (jax_flash/sinks.h; none: -inf) enters here once, never in a split's
// partial; a row that no split saw has O = 0 and LSE = the sink. One warp per row, two columns per
// lane and step; splits that saw no key (lse_s = -inf) are skipped, so their
// partial rows are never read.
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
  float mx = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, lse_s[s * rows]);
  const float sink = sink_of(p.sinks, b, h, p.num_heads);
  float lse = sink;  // a row no split saw: O = 0, LSE = the sink (-inf without)
  if (mx != -INFINITY) {
    float sum = 0.f;
    for (int s = 0; s < p.num_splits; ++s) sum += exp2_approx((lse_s[s * rows] - mx) * kLog2e);
    lse = mx + __logf(sum);
    if (sink != -INFINITY) lse = lse_with_sink(lse, sink);
  }
  Element* o = static_cast<Element*>(p.o) + b * p.o_batch_stride + t * p.o_row_stride + h * p.o_head_stride;
  for (int c = 2 * lane; c < p.head_dim; c += 64) {
    float x = 0.f, y = 0.f;
    if (lse != -INFINITY) {
      for (int s = 0; s < p.num_splits; ++s) {
        const float l = lse_s[s * rows];
        if (l == -INFINITY) continue;
        const float w = exp2_approx((l - lse) * kLog2e);
        const float2 v = *reinterpret_cast<const float2*>(p.o_partial + (s * rows + row) * p.head_dim + c);
        x = fmaf(w, v.x, x);
        y = fmaf(w, v.y, y);
      }
    }
    *reinterpret_cast<uint32_t*>(o + c) = Pack<Element>::pack(x, y);
  }
  if (lane == 0) p.lse[row] = lse;
}

}  // namespace jax_flash::decode
