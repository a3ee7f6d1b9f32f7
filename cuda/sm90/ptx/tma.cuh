// TMA (cp.async.bulk.tensor) wrappers and the proxy fence, PTX ISA 8.0.
// Tensor maps (CUtensorMap, 128 bytes) are built on the host with
// cuTensorMapEncodeTiled and passed as __grid_constant__ kernel parameters;
// the device takes their generic address.
//
// Loads land in shared memory in the map's swizzle pattern and signal an
// mbarrier with complete_tx (the full box size counts, including the part
// that lies out of bounds and is zero-filled). Stores read shared memory
// asynchronously: wait with bulk_wait_read<0>() before reusing the buffer.
// Coordinates are signed element indices, innermost first; out-of-bounds
// elements are zero-filled on load and skipped on store.
#pragma once

#include <cuda.h>  // CUtensorMap (type only; libcuda is not linked)

#include "common.cuh"

namespace jax_flash::sm90::ptx {

JF_DEVICE void prefetch_tmap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 4-d box load into shared memory, completing on mbarrier `bar`.
JF_DEVICE void tma_load_4d(const CUtensorMap* map, uint32_t bar, uint32_t dst, int c0, int c1,
                           int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

JF_DEVICE void tma_load_2d(const CUtensorMap* map, uint32_t bar, uint32_t dst, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

JF_DEVICE void tma_load_3d(const CUtensorMap* map, uint32_t bar, uint32_t dst, int c0, int c1,
                           int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// 4-d box store from shared memory (joins the thread's current bulk group).
JF_DEVICE void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

JF_DEVICE void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1)
      : "memory");
}

JF_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Until at most N of this thread's committed bulk groups still read shared memory.
template <int N>
JF_DEVICE void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Until at most N of this thread's bulk groups are incomplete (writes visible).
template <int N>
JF_DEVICE void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Orders this thread's generic-proxy shared-memory writes (st.shared) before
// later async-proxy accesses (TMA store, wgmma operand reads). Each writing
// thread fences, then a barrier, then the async consumer.
JF_DEVICE void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace jax_flash::sm90::ptx
