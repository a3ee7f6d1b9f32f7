// Host helpers shared by the standalone CUDA tests (self-tests, primitive
// tests, benchmarks): the CUDA error check and float <-> 16-bit (bf16 / fp16)
// bit conversions, rounding to nearest even.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CHECK_CUDA(x)                                                                    \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, \
                   __LINE__, cudaGetErrorString(e_));                                    \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

inline uint16_t to_bits(float x, bool fp16) {
  if (fp16) {
    __half h = __float2half_rn(x);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  __nv_bfloat16 h = __float2bfloat16_rn(x);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
inline float from_bits(uint16_t b, bool fp16) {
  if (fp16) {
    __half h;
    std::memcpy(&h, &b, 2);
    return __half2float(h);
  }
  __nv_bfloat16 h;
  std::memcpy(&h, &b, 2);
  return __bfloat162float(h);
}
