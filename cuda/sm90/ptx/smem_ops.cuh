// Shared-memory and bulk-reduction wrappers used by the sm90 backward
// (PTX ISA 8.0, sm_90): vector ld/st.shared, stmatrix (plain and .trans),
// ldmatrix (the forward's Q in registers, wgmma.cuh), and the
// non-tensor bulk reduction cp.reduce.async.bulk ... .add.f32 (the one the
// sm80 backward's kBulkDq path uses on Hopper, validated there), and its
// tensor form cp.reduce.async.bulk.tensor (through a TMA descriptor).
#pragma once

#include <cuda.h>  // CUtensorMap (type only)

#include "common.cuh"

namespace jax_flash::sm90::ptx {

// volatile + "memory": never hoisted above an mbarrier wait or a bar.sync.
JF_DEVICE float2 ld_shared_v2_f32(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}
JF_DEVICE uint2 ld_shared_v2_u32(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}
JF_DEVICE float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
JF_DEVICE uint4 ld_shared_v4_u32(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
JF_DEVICE void st_shared_v4_zero(uint32_t addr) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0u));
}
JF_DEVICE void st_shared_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
JF_DEVICE void st_shared_v2_f32(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

// ldmatrix.m8n8.x4 (not transposed): lanes 8 i .. 8 i + 7 give the addresses
// of rows 0..7 of 8x8 16-bit matrix i (8 consecutive elements each); register
// r[i] of lane l receives row l / 4, columns 2 (l % 4), 2 (l % 4) + 1 of
// matrix i (lower column in the low half).
JF_DEVICE void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// ldmatrix.m8n8.x4.trans: lanes 8 i .. 8 i + 7 give the addresses of rows
// 0..7 of 8x8 16-bit matrix i (8 consecutive elements each); register r[i]
// of lane l receives column l / 4 of matrix i, rows 2 (l % 4) (low half) and
// 2 (l % 4) + 1 (high half).
JF_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// stmatrix.m8n8.x4.trans: four 8x8 16-bit matrices, stored transposed.
// Register r_i of lane l holds row l / 4, columns 2 (l % 4), 2 (l % 4) + 1 of
// matrix i (the mma / wgmma accumulator layout of one 8x8 block); lane
// 8 i + c gives the address of row c of the stored (transposed) matrix i,
// i.e. of column c of the register matrix: 8 consecutive 16-bit elements.
JF_DEVICE void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// stmatrix.m8n8.x4 (not transposed): register r_i of lane l holds row l / 4,
// columns 2 (l % 4), 2 (l % 4) + 1 of matrix i; lane 8 i + c gives the
// address of row c of matrix i (8 consecutive 16-bit elements).
JF_DEVICE void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// global[dst .. dst + bytes) += shared[src .. src + bytes) (fp32, element-wise,
// performed by the copy engine; joins the thread's current bulk group).
// dst, src 16-byte aligned, bytes a multiple of 16.
JF_DEVICE void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(src), "r"(bytes)
               : "memory");
}

}  // namespace jax_flash::sm90::ptx

namespace jax_flash::sm90::ptx {

// Tensor (TMA) reduction: the box at coordinates {c0..c3} of `map` +=
// shared[src ..] (the map's element type; out-of-bounds elements skipped),
// in the map's swizzle layout. Joins the thread's current bulk group.
JF_DEVICE void tma_reduce_add_4d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

}  // namespace jax_flash::sm90::ptx
