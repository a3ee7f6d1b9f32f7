// The device side of the FP8 forward's V transpose (layout and work split in
// v_transpose.h): the transposer warps of the producer warpgroup turn each V
// stage (TMA, natural layout) into a V^T stage (the PV GEMM's K-major B
// operand), one stage per KV block, in the order the producer loaded them.
#pragma once

#include "sm90/ptx/common.cuh"
#include "sm90/ptx/smem_ops.cuh"
#include "v_transpose.h"

namespace jax_flash::sm90 {

template <int kHeadDim, int kBlockN, int kWarps, int kDepth>
struct VTranspose {
  using Layout = VTransposeLayout<kHeadDim, kBlockN>;
  static_assert(Layout::kSteps >= kWarps, "a step for every transposer warp");
  static_assert(kDepth >= 2, "at least one ldmatrix in flight behind the step being stored");

  // One stage, by warp w (< kWarps) of the transposer warps: its steps
  // (Layout::first_step), fully unrolled with compile-time address offsets,
  // each an ldmatrix.x4.trans, four byte permutes and an stmatrix.x4 (four
  // wavefronts each, see v_transpose.h). src and dst: the V and V^T stages
  // (1 KB aligned). The shared accesses are volatile: they keep their
  // program order (loads kDepth - 1 steps ahead of the stores). The caller
  // orders the stores before the async-proxy reads (fence.proxy.async) and
  // signals the consumers.
  JF_DEVICE static void run(uint32_t src, uint32_t dst, int w) {
    dispatch<0>(src, dst, w, ptx::opaque_tid() & 31);
  }

 private:
  template <int kW>
  JF_DEVICE static void dispatch(uint32_t src, uint32_t dst, int w, int lane) {
    if constexpr (kW + 1 < kWarps) {
      if (w != kW) {  // warp-uniform
        dispatch<kW + 1>(src, dst, w, lane);
        return;
      }
    }
    steps<Layout::first_step(kW, kWarps), Layout::first_step(kW + 1, kWarps)>(src, dst, lane);
  }

  template <int kBegin, int kEnd>
  JF_DEVICE static void steps(uint32_t src, uint32_t dst, int lane) {
    const uint32_t src_lane = Layout::src_lane(lane);
    const uint32_t dst_lane = Layout::dst_lane(lane);
    const uint32_t sel = Layout::sel(lane);
    uint32_t r[kDepth][4];
#pragma unroll
    for (int i = 0; i < kDepth - 1; ++i)
      if (kBegin + i < kEnd) load(r[i], src, src_lane, kBegin + i);
#pragma unroll
    for (int s = kBegin; s < kEnd; ++s) {
      const int ahead = s + kDepth - 1;
      if (ahead < kEnd) load(r[(ahead - kBegin) % kDepth], src, src_lane, ahead);
      store(r[(s - kBegin) % kDepth], dst, dst_lane, s, sel);
    }
  }

  // The address forms keep one lane-dependent value per chunk live (steps
  // go chunk-major): loads (lane ^ chunk XOR) + stage base + immediate,
  // stores (lane + stage base + chunk rows + atom) ^ group XOR. A form that shared
  // one XOR'd value between steps further apart would have the compiler
  // keep each such value live, which the producer warpgroup's 24 registers
  // do not allow.
  JF_DEVICE static void load(uint32_t (&r)[4], uint32_t src, uint32_t src_lane, int s) {
    ptx::ldmatrix_x4_trans(r, Layout::load_addr(src, src_lane, s));
  }
  JF_DEVICE static void store(const uint32_t (&r)[4], uint32_t dst, uint32_t dst_lane, int s, uint32_t sel) {
    uint32_t o[4];
    transpose_pairs(r, o, sel, [](uint32_t x, uint32_t y, uint32_t sl) { return __byte_perm(x, y, sl); });
    ptx::stmatrix_x4(Layout::store_addr(dst, dst_lane, s), o[0], o[1], o[2], o[3]);
  }
};

}  // namespace jax_flash::sm90
