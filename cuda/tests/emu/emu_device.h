// Host emulation of the few CUDA device features the sm80 kernels use, so the
// unmodified kernel source can be compiled by g++ and run on a CPU:
//   - every CUDA thread is a coroutine (ucontext); a CTA runs on one OS thread;
//   - __syncthreads, ldmatrix, mma.sync, shfl are collectives: each lane
//     deposits its operands and yields until the whole warp / block arrived;
//   - cp.async copies are queued per thread and performed at cp.async.wait_group
//     (so reading a tile before waiting for it reads stale data and fails);
//   - shared memory is a 1 KB-aligned host buffer filled with NaN bytes.
// Fragment layouts follow the PTX ISA, written independently of the kernels'
// own description, so a layout mistake in the kernels shows up as wrong
// numbers here. Force-included before every kernel source by build_emu.sh
// (g++ -include), with JAX_FLASH_HOST_EMULATION defined. Not for speed: ~1e5
// collectives per second.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <functional>

#include "jax_flash/tanh_rational.h"

#define __launch_bounds__(...)
#define JF_DEVICE inline

namespace jf_emu {

uint3 thread_idx();
uint3 block_idx();
dim3 block_dim();
dim3 grid_dim();
char* smem_base();
void syncthreads();
[[noreturn]] void trap(const char* why);

void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool fp16);
void ldmatrix(uint32_t (&r)[4], uint32_t addr, bool trans);
float shfl_xor(float v, int mask);
float shfl_idx(float v, int src_lane);
void cp_async(uint32_t dst, const void* src, bool valid);
void cp_async_commit();
void cp_async_wait(int n);
void bulk_reduce_add_f32(float* dst, uint32_t src, int bytes);
void bulk_commit();
void bulk_wait(int n);

// Runs body() once per thread of every CTA of the grid (CTAs in order).
cudaError_t launch(dim3 grid, dim3 block, size_t smem_bytes, const void* func,
                   const std::function<void()>& body);

template <typename Kernel>
struct Launch {
  dim3 grid, block;
  size_t smem;
  Kernel kernel;
  template <typename Args>
  void operator()(const Args& args) const {
    launch(grid, block, smem, reinterpret_cast<const void*>(kernel), [&] { kernel(args); });
  }
};

}  // namespace jf_emu

#define threadIdx (::jf_emu::thread_idx())
#define blockIdx (::jf_emu::block_idx())
#define blockDim (::jf_emu::block_dim())
#define gridDim (::jf_emu::grid_dim())
#define __syncthreads() ::jf_emu::syncthreads()
#define __trap() ::jf_emu::trap("__trap")
#define JF_SMEM(name) char* name = ::jf_emu::smem_base()
#define JF_LAUNCH(kernel, grid, block, smem, stream) \
  ::jf_emu::Launch<decltype(kernel)>{dim3(grid), dim3(block), size_t(smem), kernel}

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
// Full-warp shuffles of a float (the only ones the kernels use).
inline float __shfl_xor_sync(unsigned, float v, int mask) { return jf_emu::shfl_xor(v, mask); }
inline float __shfl_sync(unsigned, float v, int src_lane) { return jf_emu::shfl_idx(v, src_lane); }
// Full-warp vote: an OR over the lanes by butterfly shuffles.
inline int __any_sync(unsigned, int pred) {
  float v = pred ? 1.f : 0.f;
  for (int mask = 1; mask < 32; mask <<= 1) v = std::fmax(v, jf_emu::shfl_xor(v, mask));
  return v != 0.f;
}
inline float atomicAdd(float* p, float v) {  // one OS thread: a plain add is atomic
  const float old = *p;
  *p = old + v;
  return old;
}
// Integer shuffles and shared atomics (the packing pre-pass, cuda/packing/):
// the shuffle moves the bits through the float collective.
namespace jf_emu {
inline int shfl_xor_bits(int v, int mask) {
  float f;
  std::memcpy(&f, &v, 4);
  f = shfl_xor(f, mask);
  std::memcpy(&v, &f, 4);
  return v;
}
}  // namespace jf_emu
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}
inline int atomicMin(int* p, int v) {
  const int old = *p;
  *p = old < v ? old : v;
  return old;
}
inline int atomicMax(int* p, int v) {
  const int old = *p;
  *p = old > v ? old : v;
  return old;
}
// A warp barrier: every lane arrives before any goes on (a collective).
inline void __syncwarp(unsigned = 0xffffffffu) { (void)jf_emu::shfl_xor(0.f, 0); }
inline float __logf(float x) { return std::log(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __uint_as_float(uint32_t x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
using std::memcpy;
using std::max;
using std::min;

namespace jax_flash {

// jax_flash/pack.cuh
template <typename Element>
struct Pack;
template <>
struct Pack<__nv_bfloat16> {
  static uint32_t pack(float lo, float hi) {
    __nv_bfloat16 l = __float2bfloat16_rn(lo), h = __float2bfloat16_rn(hi);
    uint16_t lb, hb;
    std::memcpy(&lb, &l, 2);
    std::memcpy(&hb, &h, 2);
    return uint32_t(lb) | (uint32_t(hb) << 16);
  }
};
template <>
struct Pack<__half> {
  static uint32_t pack(float lo, float hi) {
    __half l = __float2half_rn(lo), h = __float2half_rn(hi);
    uint16_t lb, hb;
    std::memcpy(&lb, &l, 2);
    std::memcpy(&hb, &h, 2);
    return uint32_t(lb) | (uint32_t(hb) << 16);
  }
};

}  // namespace jax_flash

namespace jax_flash::sm80 {

template <typename Element>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    jf_emu::mma(c, a, b0, b1, false);
  }
  static uint32_t pack(float lo, float hi) { return Pack<__nv_bfloat16>::pack(lo, hi); }
};
template <>
struct Mma<__half> {
  static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    jf_emu::mma(c, a, b0, b1, true);
  }
  static uint32_t pack(float lo, float hi) { return Pack<__half>::pack(lo, hi); }
};

inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { jf_emu::ldmatrix(r, addr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { jf_emu::ldmatrix(r, addr, true); }
inline uint32_t smem_addr(const void* p) {
  return uint32_t(static_cast<const char*>(p) - jf_emu::smem_base());
}
inline void cp_async_16(uint32_t dst, const void* src, bool valid) { jf_emu::cp_async(dst, src, valid); }
inline void cp_async_commit() { jf_emu::cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
  jf_emu::cp_async_wait(N);
}
inline float exp2_approx(float x) { return std::exp2(x); }
inline void fence_proxy_async_smem() {}
inline void bulk_reduce_add_f32(float* dst, uint32_t src, int bytes) { jf_emu::bulk_reduce_add_f32(dst, src, bytes); }
inline void bulk_commit() { jf_emu::bulk_commit(); }
inline void bulk_wait_read_all() { jf_emu::bulk_wait(0); }
inline void bulk_wait_all() { jf_emu::bulk_wait(0); }
inline void atomic_add2(float* p, float a, float b) { atomicAdd(p, a); atomicAdd(p + 1, b); }
inline float tanh_approx(float x) {  // the kernels' (fast_math.cuh)
  float p, q;
  jax_flash::tanh_rational_parts(x, p, q);
  return p / q;
}
inline void check_smem_alignment(const void* smem) {
  if (reinterpret_cast<uintptr_t>(smem) & 1023u) jf_emu::trap("smem alignment");
}
inline int launder(int x) { return x; }
inline int opaque_tid() { return int(jf_emu::thread_idx().x); }
inline float quad_max(float x) {
  x = std::fmax(x, jf_emu::shfl_xor(x, 1));
  x = std::fmax(x, jf_emu::shfl_xor(x, 2));
  return x;
}
inline float quad_sum(float x) {
  x += jf_emu::shfl_xor(x, 1);
  x += jf_emu::shfl_xor(x, 2);
  return x;
}

}  // namespace jax_flash::sm80
