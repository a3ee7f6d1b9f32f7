// Backward post-pass (fast mode): dq = scale * dq_accum, fp32
// [batch, heads, seqlen_q_rounded, kHeadDim] -> input dtype in q's layout.
// One thread converts 8 consecutive head-dim values (two 16-byte loads, one
// 16-byte store).
#pragma once

#include "bwd_kernel.cuh"

namespace jax_flash::sm80 {

constexpr int kConvertThreads = 256;

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kConvertThreads) dq_convert_kernel(const __grid_constant__ BwdKernelArgs args) {
  const BwdParams& p = args.p;
  const int head = blockIdx.y, batch = blockIdx.z;
  constexpr int kChunksPerRow = kHeadDim / 8;
  const int idx = blockIdx.x * kConvertThreads + threadIdx.x;
  const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
  if (r >= p.seqlen_q || c >= p.head_dim) return;
  const float* src = p.dq_accum +
                     ((int64_t(batch) * p.num_heads + head) * p.seqlen_q_rounded + r) * kHeadDim + c;
  const float4 a = *reinterpret_cast<const float4*>(src);
  const float4 b = *reinterpret_cast<const float4*>(src + 4);
  const float s = args.sm.scale;
  uint4 out;
  out.x = Mma<Element>::pack(a.x * s, a.y * s);
  out.y = Mma<Element>::pack(a.z * s, a.w * s);
  out.z = Mma<Element>::pack(b.x * s, b.y * s);
  out.w = Mma<Element>::pack(b.z * s, b.w * s);
  Element* dq = static_cast<Element*>(p.dq) + batch * p.q_batch_stride + head * p.q_head_stride +
                r * p.q_row_stride + c;
  *reinterpret_cast<uint4*>(dq) = out;
}

}  // namespace jax_flash::sm80
