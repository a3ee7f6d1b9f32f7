// Attributes of the current CUDA device, queried once per device and cached:
// launchers and FFI handlers run on every attention call and should not ask
// the driver each time.
#pragma once

#include <cuda_runtime.h>

namespace jax_flash {

// The value of kAttr on the current device, or `fallback` when it cannot be
// read (no device, query failure, device index beyond the cache).
template <cudaDeviceAttr kAttr>
inline int device_attribute(int fallback) {
  static int cache[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return fallback;
  if (cache[dev] == 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, kAttr, dev) != cudaSuccess || v <= 0) return fallback;
    cache[dev] = v;
  }
  return cache[dev];
}

}  // namespace jax_flash
