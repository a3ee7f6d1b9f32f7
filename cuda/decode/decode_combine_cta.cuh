// Split-KV combine with one CTA per (batch, head, token) row: the merge of
// decode_combine.cuh (same formula, same sink and empty-split rules) for
// many splits. The warp-per-row combine walks the splits in batches of 8
// per 64 columns, one memory round trip each (at 33 splits and head_dim 128:
// ten after the LSEs), on a grid of rows / 4 CTAs (B=1: 8 CTAs). Here the
// CTA's threads read the row's split LSEs at once (thread s: split s), and
// its warps split the partial rows among themselves (warp w: splits w,
// w + 4, ...; lane l: columns 4 l, 4 l + 128, ... as float4), all of a
// warp's loads issued before their sums; the four warps' sums then meet in
// shared memory. Two or three round trips per row, and one CTA per row.
#pragma once

#include "decode/decode_params.h"
#include "sm80/mma.cuh"
#include "sm80/softmax.cuh"

namespace jax_flash::decode {

using namespace sm80;  // NOLINT: exp2_approx (fast_math.cuh, or its emulation)

constexpr int kCombineCtaWarps = 4;
constexpr int kCombineCtaThreads = kCombineCtaWarps * 32;
static_assert(kCombineCtaThreads >= kDecodeMaxSplits, "one thread per split LSE");
// Partial rows in flight per warp and column group.
constexpr int kCombineCtaBatch = 12;

// Dynamic shared memory: the split weights (zero past the last split, as
// far as a warp's batch reaches: the weights are read unconditionally, no
// branch between the loads), the block reduction's two rows of per-warp
// values, the warps' column sums [warps][head_dim].
constexpr int kCombineCtaWeights = kDecodeMaxSplits + kCombineCtaWarps * kCombineCtaBatch;
constexpr int decode_combine_cta_smem(int head_dim) {
  return (kCombineCtaWeights + 2 * kCombineCtaWarps + kCombineCtaWarps * head_dim) * 4;
}
static_assert((kCombineCtaWeights + 2 * kCombineCtaWarps) % 4 == 0, "the column sums are float4-aligned");
static_assert(kCombineCtaWeights <= 2 * kCombineCtaThreads, "two weights per thread at most");

// (A minimum of one CTA per SM: with occupancy as its aim, ptxas fits the
// kernel in 32 registers by consuming each partial row's load before
// issuing the next; bounded for one CTA it issues a warp's 12 at once.)
template <typename Element>
__global__ void __launch_bounds__(kCombineCtaThreads, 1)
    decode_combine_cta_kernel(const __grid_constant__ DecodeParams p) {
  JF_SMEM(smem);
  float* weight = reinterpret_cast<float*>(smem);      // [kCombineCtaWeights]
  float* red = weight + kCombineCtaWeights;            // [2][kCombineCtaWarps]
  float* sums = red + 2 * kCombineCtaWarps;            // [kCombineCtaWarps][head_dim]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t rows = int64_t(p.batch) * p.num_heads * p.seqlen_q;
  const int64_t row = blockIdx.x;  // (b * H + h) * T + t
  const int t = int(row % p.seqlen_q);
  const int64_t bh = row / p.seqlen_q;
  const int h = int(bh % p.num_heads), b = int(bh / p.num_heads);

  // The row's LSE over the splits, and each split's weight exp(lse_s - lse)
  // (0 for a split that saw no key).
  const float lse_s = tid < p.num_splits ? __ldg(p.lse_partial + int64_t(tid) * rows + row) : -INFINITY;
  float mx = lse_s;
#pragma unroll
  for (int d = 16; d >= 1; d /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int w = 1; w < kCombineCtaWarps; ++w) mx = fmaxf(mx, red[w]);
  float e = lse_s == -INFINITY ? 0.f : exp2_approx((lse_s - mx) * kLog2e);
#pragma unroll
  for (int d = 16; d >= 1; d /= 2) e += __shfl_xor_sync(0xffffffffu, e, d);
  if (lane == 0) red[kCombineCtaWarps + warp] = e;
  __syncthreads();
  const float sink = sink_of(p.sinks, b, h, p.num_heads);
  float lse = sink;  // a row no split saw: O = 0, LSE = the sink (-inf without)
  if (mx != -INFINITY) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kCombineCtaWarps; ++w) sum += red[kCombineCtaWarps + w];
    lse = mx + __logf(sum);
    if (sink != -INFINITY) lse = lse_with_sink(lse, sink);
  }
  weight[tid] = lse_s == -INFINITY ? 0.f : exp2_approx((lse_s - lse) * kLog2e);
  if (tid + kCombineCtaThreads < kCombineCtaWeights) weight[tid + kCombineCtaThreads] = 0.f;
  __syncthreads();

  // This warp's splits, float4 columns. Loads are unconditional (a lane past
  // the row reads its column 0, a split past the last the last one) and a
  // split of weight 0 (empty, or past the last) is discarded by a select,
  // NaN or not.
  const int chunks = p.head_dim / 4;
  const float* base = p.o_partial + row * p.head_dim;
  for (int c4 = lane; c4 - lane < chunks; c4 += 32) {  // warp-uniform bound
    const int col = c4 < chunks ? 4 * c4 : 0;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = warp; s0 < p.num_splits; s0 += kCombineCtaWarps * kCombineCtaBatch) {
      float4 v[kCombineCtaBatch];
      float wt[kCombineCtaBatch];
#pragma unroll
      for (int j = 0; j < kCombineCtaBatch; ++j) {
        const int s = s0 + j * kCombineCtaWarps;
        v[j] = __ldg(reinterpret_cast<const float4*>(base + int64_t(min(s, p.num_splits - 1)) * rows * p.head_dim +
                                                     col));
        wt[j] = weight[s];  // 0 past the last split
      }
#pragma unroll
      for (int j = 0; j < kCombineCtaBatch; ++j) {
        const float w = wt[j];
        const bool use = w != 0.f;
        acc.x = fmaf(w, use ? v[j].x : 0.f, acc.x);
        acc.y = fmaf(w, use ? v[j].y : 0.f, acc.y);
        acc.z = fmaf(w, use ? v[j].z : 0.f, acc.z);
        acc.w = fmaf(w, use ? v[j].w : 0.f, acc.w);
      }
    }
    if (c4 < chunks) *reinterpret_cast<float4*>(sums + warp * p.head_dim + 4 * c4) = acc;
  }
  __syncthreads();

  Element* o = static_cast<Element*>(p.o) + b * p.o_batch_stride + t * p.o_row_stride + h * p.o_head_stride;
  for (int c4 = tid; c4 < chunks; c4 += kCombineCtaThreads) {
    float4 x = *reinterpret_cast<const float4*>(sums + 4 * c4);
#pragma unroll
    for (int w = 1; w < kCombineCtaWarps; ++w) {
      const float4 y = *reinterpret_cast<const float4*>(sums + w * p.head_dim + 4 * c4);
      x.x += y.x; x.y += y.y; x.z += y.z; x.w += y.w;
    }
    uint2 packed;
    packed.x = Pack<Element>::pack(x.x, x.y);
    packed.y = Pack<Element>::pack(x.z, x.w);
    *reinterpret_cast<uint2*>(o + 4 * c4) = packed;
  }
  if (tid == 0) p.lse[row] = lse;
}

}  // namespace jax_flash::decode
