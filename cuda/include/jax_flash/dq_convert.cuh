// Backward post-pass of both kernel families (fast mode): dq = scale *
// dq_accum, fp32 [batch, heads, seqlen_q_rounded, kPitch] -> the input dtype
// in q's layout. One thread converts 8 consecutive head-dim values (two
// 16-byte loads, one 16-byte store). Each family launches it after its main
// kernel (kPitch = BwdParams::head_dim_rounded, the workspace's row pitch).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/pack.cuh"
#include "jax_flash/params.h"

namespace jax_flash {

constexpr int kDqConvertThreads = 256;

struct DqConvertArgs {
  BwdParams p;
};

template <typename Element, int kPitch>
__global__ void __launch_bounds__(kDqConvertThreads) dq_convert_kernel(const __grid_constant__ DqConvertArgs args) {
  const BwdParams& p = args.p;
  const int head = blockIdx.y, batch = blockIdx.z;
  constexpr int kChunksPerRow = kPitch / 8;
  const int idx = blockIdx.x * kDqConvertThreads + threadIdx.x;
  const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
  if (r >= p.seqlen_q || c >= p.head_dim) return;
  const float* src = p.dq_accum +
                     ((int64_t(batch) * p.num_heads + head) * p.seqlen_q_rounded + r) * kPitch + c;
  const float4 a = *reinterpret_cast<const float4*>(src);
  const float4 b = *reinterpret_cast<const float4*>(src + 4);
  const float s = p.scale;
  uint4 out;
  out.x = Pack<Element>::pack(a.x * s, a.y * s);
  out.y = Pack<Element>::pack(a.z * s, a.w * s);
  out.z = Pack<Element>::pack(b.x * s, b.y * s);
  out.w = Pack<Element>::pack(b.z * s, b.w * s);
  Element* dq = static_cast<Element*>(p.dq) + batch * p.q_batch_stride + head * p.q_head_stride +
                r * p.q_row_stride + c;
  *reinterpret_cast<uint4*>(dq) = out;
}

// The launch grid: (row chunks, heads, batch).
inline dim3 dq_convert_grid(const BwdParams& p, int pitch) {
  const int64_t chunks = int64_t(p.seqlen_q) * (pitch / 8);
  return dim3(unsigned((chunks + kDqConvertThreads - 1) / kDqConvertThreads), p.num_heads, p.batch);
}

}  // namespace jax_flash
