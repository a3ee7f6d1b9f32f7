// Thin wrappers over the sm80 PTX instructions the kernels are built from:
//   mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate), ldmatrix (plain and
//   .trans), cp.async (16 bytes, zero-filling when predicated off), ex2/tanh
//   approximations and fp32 -> 16-bit packing.
//
// Fragment layouts of m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"),
// with g = lane / 4 (the "group") and t = lane % 4 (the "thread in group"):
//   A (16x16, row-major) 4 x b32: a[0] = (row g,   cols 2t..2t+1)
//                                  a[1] = (row g+8, cols 2t..2t+1)
//                                  a[2] = (row g,   cols 2t+8..2t+9)
//                                  a[3] = (row g+8, cols 2t+8..2t+9)
//   B (16x8, k x n)       2 x b32: b[0] = (k 2t..2t+1,   col g)
//                                  b[1] = (k 2t+8..2t+9, col g)
//   C (16x8, fp32)        4 x f32: c[0..1] = (row g,   cols 2t, 2t+1)
//                                  c[2..3] = (row g+8, cols 2t, 2t+1)
// Two neighbouring C tiles (cols 16j..16j+15), packed to 16-bit pairs, are
// exactly an A fragment: this is how P (and dS) stay in registers and feed the
// next mma without a round trip through shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "jax_flash/pack.cuh"

// Host emulation (cuda/tests/emu): the same kernel source compiled by a host
// C++ compiler, with the PTX below replaced by a warp-level interpreter, so
// that the kernels can be run and checked on a machine without a GPU. Its
// build force-includes the replacements (g++ -include emu_device.h), so no
// kernel header depends on the test code.
#ifndef JAX_FLASH_HOST_EMULATION
#include "jax_flash/fast_math.cuh"
// Dynamic shared memory (1 KB aligned: the swizzle address arithmetic of
// warp_gemm.cuh XORs address bits 4-6 and relies on tiles starting on 1 KB).
#define JF_SMEM(name) extern __shared__ __align__(1024) char name[]
#define JF_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#endif

namespace jax_flash::sm80 {

#ifndef JF_DEVICE
#define JF_DEVICE __device__ __forceinline__
#endif

#ifndef JAX_FLASH_HOST_EMULATION

// ---------------------------------------------------------------- mma.sync
template <typename Element>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  JF_DEVICE static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // Pack two floats into one b32 holding (lo, hi) as bf16, round to nearest.
  JF_DEVICE static uint32_t pack(float lo, float hi) { return Pack<__nv_bfloat16>::pack(lo, hi); }
};

template <>
struct Mma<__half> {
  JF_DEVICE static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  JF_DEVICE static uint32_t pack(float lo, float hi) { return Pack<__half>::pack(lo, hi); }
};

// ---------------------------------------------------------------- ldmatrix
// Lanes 0-7 / 8-15 / 16-23 / 24-31 give the row addresses of matrices 0..3;
// r[i] receives matrix i. Addresses are 32-bit shared-window addresses.
JF_DEVICE void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
JF_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

JF_DEVICE uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------- cp.async
// 16-byte global -> shared copy through L2 only (.cg). When !valid the source
// size is 0: nothing is read and the 16 destination bytes are zero-filled.
// This is how rows past the sequence end and columns past head_dim become 0.
JF_DEVICE void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
JF_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
JF_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------- math
// exp2_approx, tanh_approx: jax_flash/fast_math.cuh (shared with sm90).

// Adds (a, b) to the two consecutive floats at p (8-byte aligned). sm90 has
// vector float atomics (RED.E.ADD.F32x2): half the L2 atomic operations of two
// scalar adds, which is what the fused dQ accumulation of the backward is
// bound by. JF_SCALAR_ATOMICS forces the scalar form (for A/B timing).
JF_DEVICE void atomic_add2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(JF_SCALAR_ATOMICS)
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// ---------------------------------------------------------------- bulk (sm90)
// Shared -> global reduction by the copy engine (cp.reduce.async.bulk, sm90):
// adds `bytes` of fp32 from shared memory into global memory in L2, one
// instruction per row instead of one atomic per element. Completion is
// tracked per thread in bulk groups: the issuing thread must wait (.read) before
// the source is overwritten and (full) before it exits. Writers of the source
// fence the generic->async proxy before the barrier that precedes the issue.
JF_DEVICE void fence_proxy_async_smem() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
JF_DEVICE void bulk_reduce_add_f32(float* dst, uint32_t src, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(dst), "r"(src), "r"(bytes) : "memory");
#else
  __trap();  // launchers use the bulk path only on sm90+
#endif
}
JF_DEVICE void bulk_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
JF_DEVICE void bulk_wait_read_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}
JF_DEVICE void bulk_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// threadIdx.x, re-read each time (volatile): lane-derived addresses computed
// from it inside a loop are rematerialised each iteration (a few integer ops)
// instead of being hoisted and held in registers for the whole KV sweep,
// where the accumulators need every register.
JF_DEVICE int opaque_tid() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

// Returns x as a value the optimiser cannot see through: expressions built
// from it inside a loop are recomputed there instead of being hoisted (and
// kept live in registers across the loop). Measured with -Xptxas -v: this
// removes the last spills of the sm_80 build, while the sm_90 register
// allocator does better when CTA-uniform values stay visible as uniform (it
// keeps them in uniform registers), so it is a no-op there.
JF_DEVICE int launder(int x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  asm volatile("" : "+r"(x));
#endif
  return x;
}

// The fast swizzled addressing (warp_gemm.cuh) assumes 1 KB-aligned dynamic
// shared memory; fail loudly (launch error) rather than compute garbage.
JF_DEVICE void check_smem_alignment(const void* smem) {
  if (smem_addr(smem) & 1023u) __trap();
}

// Reductions across the 4 lanes of a quad (the lanes that share a C row).
JF_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}
JF_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

#endif  // !JAX_FLASH_HOST_EMULATION

}  // namespace jax_flash::sm80
