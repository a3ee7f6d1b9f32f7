// The device side of the FP8 forward's V transpose (layout and work split in
// v_transpose.h): the transposer warps of the producer warpgroup turn each V
// stage (TMA, natural layout) into a V^T stage (the PV GEMM's K-major B
// operand), one stage per KV block, in the order the producer loaded them.
#pragma once

#include "sm90/ptx/common.cuh"
#include "sm90/ptx/gmem_sync.cuh"
#include "v_transpose.h"

namespace jax_flash::sm90 {

template <int kHeadDim, int kWarps>
struct VTranspose {
  using Layout = VTransposeLayout<kHeadDim>;

  // One stage, by warp w (< kWarps) of the transposer warps: 32-bit loads of
  // 4 keys x 4 bytes, a byte transpose, 32-bit stores (conflict-free, see
  // v_transpose.h), two units at a time so that eight loads are in flight
  // (the volatile shared accesses keep their program order). The caller
  // orders the stores before the async-proxy reads (fence.proxy.async) and
  // signals the consumers.
  JF_DEVICE static void run(uint32_t src, uint32_t dst, int w, int lane) {
    for (int s = w; s < Layout::kSteps; s += 2 * kWarps) {
      const bool second = s + kWarps < Layout::kSteps;  // warp-uniform
      uint32_t in[2][4];
      load(in[0], src, s, lane);
      if (second) load(in[1], src, s + kWarps, lane);
      store(in[0], dst, s, lane);
      if (second) store(in[1], dst, s + kWarps, lane);
    }
  }

 private:
  JF_DEVICE static void load(uint32_t (&in)[4], uint32_t src, int s, int lane) {
    const int q = Layout::quad(lane, s);
#pragma unroll
    for (int j = 0; j < 4; ++j) in[j] = ptx::ld_shared_b32(src + Layout::src_offset(Layout::load_key(lane, j), 4 * q));
  }
  JF_DEVICE static void store(const uint32_t (&in)[4], uint32_t dst, int s, int lane) {
    const int q = Layout::quad(lane, s);
    uint32_t keys[4] = {in[0], in[1], in[2], in[3]}, out[4];
    Layout::key_order(keys, lane);
    transpose_4x4_bytes(keys, out, [](uint32_t x, uint32_t y, uint32_t sel) { return __byte_perm(x, y, sel); });
#pragma unroll
    for (int j = 0; j < 4; ++j) ptx::st_shared_b32(dst + Layout::dst_offset(4 * q + j, 4 * lane), out[j]);
  }
};

}  // namespace jax_flash::sm90
