// fp32 pairs -> one b32 of two 16-bit values (lo in the low half), rounded to
// nearest: how every kernel family writes 16-bit results. The host emulator
// (cuda/tests/emu/emu_device.h) defines the same names for its builds.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jax_flash {

template <typename Element>
struct Pack;

#ifndef JAX_FLASH_HOST_EMULATION
template <>
struct Pack<__nv_bfloat16> {
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

template <>
struct Pack<__half> {
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};
#endif  // !JAX_FLASH_HOST_EMULATION

}  // namespace jax_flash
