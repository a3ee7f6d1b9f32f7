// Global-memory flags between CTAs (the deterministic backward's dQ-order
// semaphores): acquire loads, release stores, the generic <-> async proxy
// fence for global memory, a back-off sleep.
#pragma once

#include "common.cuh"

namespace jax_flash::sm90::ptx {

JF_DEVICE int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Polling load (no acquire: no L1 invalidation per poll; acquire once the
// value is seen, with ld_acquire_gpu).
JF_DEVICE int ld_relaxed_gpu(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

JF_DEVICE void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// Orders this thread's global-memory accesses through the generic proxy
// (flag loads / stores) with its accesses through the async proxy (bulk /
// TMA reductions), in both directions.
JF_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

JF_DEVICE uint32_t ld_shared_b32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

JF_DEVICE void nanosleep_ns(uint32_t ns) { asm volatile("nanosleep.u32 %0;\n" ::"r"(ns)); }

}  // namespace jax_flash::sm90::ptx
