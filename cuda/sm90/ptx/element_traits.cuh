// What the sm90 kernels need to know about an input element type, in one
// place: the shared-memory layout, the k-steps of the GEMMs, the TMA
// descriptors and the wgmma wrappers all read it from here, so another input
// type (e.g. an 8-bit one: 1-byte elements, wgmma k = 32, V transposed in
// shared memory for the PV GEMM) is a new specialisation rather than a copy
// of the kernels.
#pragma once

#include <cuda.h>  // CUtensorMapDataType (type only; libcuda is not linked)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jax_flash::sm90 {

template <typename Element>
struct ElementTraits;  // only the specialisations below exist

// Common to the 16-bit types: wgmma reads them K-major or MN-major (tnspB),
// so V feeds O += P V straight from its TMA tile.
template <typename Element, CUtensorMapDataType kTma>
struct ElementTraits16 {
  static constexpr int kBytes = 2;
  // k of one wgmma.mma_async (32 bytes of k per instruction).
  static constexpr int kMmaK = 16;
  // Elements in one 128-byte row of the 128B swizzle atom: the TMA box width
  // and the column-block width of every shared-memory tile.
  static constexpr int kSwizzleRow = 128 / kBytes;
  // Whether V must be transposed in shared memory before it can be wgmma's B
  // operand of O += P V (the MN-major B form exists for 16-bit types only).
  static constexpr bool kTransposeV = false;
  static constexpr CUtensorMapDataType kTmaType = kTma;
};

template <>
struct ElementTraits<__nv_bfloat16> : ElementTraits16<__nv_bfloat16, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16> {};
template <>
struct ElementTraits<__half> : ElementTraits16<__half, CU_TENSOR_MAP_DATA_TYPE_FLOAT16> {};

}  // namespace jax_flash::sm90
