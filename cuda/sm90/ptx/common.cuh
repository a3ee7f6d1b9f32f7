// Shared bits of the sm90 PTX wrappers: the device-function macro and the
// generic -> shared-window address conversion every async instruction needs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#ifndef JF_DEVICE
#define JF_DEVICE __device__ __forceinline__
#endif

namespace jax_flash::sm90::ptx {

// 32-bit address in the shared-memory window (what every .shared operand takes).
JF_DEVICE uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

JF_DEVICE int lane_id() { return threadIdx.x & 31; }

// Warp index broadcast from lane 0: the compiler then knows it is warp-uniform
// (keeps role branches free of divergence bookkeeping).
JF_DEVICE int warp_id_uniform() { return __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0); }

}  // namespace jax_flash::sm90::ptx

namespace jax_flash::sm90::ptx {

JF_DEVICE void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

}  // namespace jax_flash::sm90::ptx

namespace jax_flash::sm90::ptx {

// threadIdx.x re-read each time (volatile): lane-derived addresses computed
// from it inside the tile loop are rematerialised where they are used instead
// of being hoisted and kept live across the mainloop (where the accumulators
// need every register; measured with -Xptxas -v on the hdim-256 kernel).
JF_DEVICE int opaque_tid() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

}  // namespace jax_flash::sm90::ptx
