// What the sm90 dispatchers (forward and backward) check before they accept a
// call: the current device (queried once per device and cached: both run on
// every attention call; jax_flash/device_attribute.h caches one attribute each
// but treats 0 as "not read yet", which a compute-capability minor of 0 is)
// and whether a tensor's layout can be described by a TMA tensor map.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/support.h"  // aligned16

namespace jax_flash::sm90 {

struct DeviceInfo {
  bool sm90 = false;   // compute capability exactly 9.0 (sm_90a code runs nowhere else)
  int smem_optin = 0;  // max dynamic shared memory per block with opt-in, bytes
};

inline DeviceInfo device_info() {
  static DeviceInfo cache[64];
  static bool filled[64] = {false};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return DeviceInfo{};
  if (!filled[dev]) {
    DeviceInfo d;
    int major = 0, minor = 0, optin = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess) {
      d.sm90 = major == 9 && minor == 0;
      d.smem_optin = optin;
    }
    cache[dev] = d;
    filled[dev] = true;
  }
  return cache[dev];
}

// TMA: strides are multiples of 16 bytes and below 2^40 bytes. A dimension
// with a single index may have any stride (the launcher substitutes one).
inline bool stride_ok(int64_t stride, int64_t size, int elem_bytes = 2) {
  if (size <= 1) return true;
  const int64_t bytes = stride * elem_bytes;
  return stride > 0 && bytes % 16 == 0 && bytes < (int64_t(1) << 40);
}

// A tensor of three strided dimensions (e.g. [batch, seq, heads, head_dim]:
// seq, heads, batch) with these element strides.
inline bool tensor_ok(const void* ptr, int64_t seq, int64_t heads, int64_t batch, int64_t rs,
                      int64_t hs, int64_t bs, int elem_bytes = 2) {
  return ptr != nullptr && aligned16(ptr) && stride_ok(rs, seq, elem_bytes) &&
         stride_ok(hs, heads, elem_bytes) && stride_ok(bs, batch, elem_bytes);
}

}  // namespace jax_flash::sm90
