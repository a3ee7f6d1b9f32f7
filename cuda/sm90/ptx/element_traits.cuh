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
#include <cuda_fp8.h>

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
  // The online softmax's P range (softmax.cuh): P = 2^(x - m + offset), the
  // max raised lazily by more than the threshold. 16-bit P takes up to 2^8.
  static constexpr int kPOffsetLog2 = 0;
  static constexpr int kLazyThresholdLog2 = 8;
  // One softmax scale per call (no per-block descales).
  static constexpr bool kBlockScales = false;
};

template <>
struct ElementTraits<__nv_bfloat16> : ElementTraits16<__nv_bfloat16, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16> {};
template <>
struct ElementTraits<__half> : ElementTraits16<__half, CU_TENSOR_MAP_DATA_TYPE_FLOAT16> {};

// e4m3 (FP8 forward): wgmma reads 8-bit operands K-major only, so the B
// operand of O += P V is V transposed ([head_dim][keys], keys contiguous; the
// quantisation pre-pass writes it so, scheme.py's v_kernel_layout). P is
// e4m3 too: its exponentials are offset by 2^8 into e4m3's range (max 448)
// and the max moves with every increase (threshold 0: O is rescaled only when
// some row of the warp raised its max).
template <>
struct ElementTraits<__nv_fp8_e4m3> {
  static constexpr int kBytes = 1;
  static constexpr int kMmaK = 32;
  static constexpr int kSwizzleRow = 128;
  static constexpr bool kTransposeV = true;
  static constexpr CUtensorMapDataType kTmaType = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  static constexpr int kPOffsetLog2 = 8;
  static constexpr int kLazyThresholdLog2 = 0;
  // Q and K descales per block, folded into each KV block's softmax scale.
  static constexpr bool kBlockScales = true;
};

}  // namespace jax_flash::sm90
