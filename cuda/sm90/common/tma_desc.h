// Host side of the sm90 TMA tensor maps: the [batch, seq, heads, head_dim]
// tensors of the kernels as 4-d maps with the 128B (or 64B) swizzle.
//
// cuTensorMapEncodeTiled is a driver API function; it is fetched through the
// runtime (cudaGetDriverEntryPointByVersion) so that the extension, which
// links cudart statically, never links libcuda.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "jax_flash/params.h"
#include "sm90/ptx/element_traits.cuh"

namespace jax_flash::sm90 {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// Stride in bytes of a dimension of `size` elements: any valid value when the
// dimension has a single index (the stride is then never used).
inline cuuint64_t stride_bytes(int64_t stride_elems, int64_t size, int elem_bytes = 2) {
  const int64_t b = stride_elems * elem_bytes;
  if (size <= 1 && (b <= 0 || b % 16 != 0 || b >= (int64_t(1) << 40))) return 16;
  return cuuint64_t(b);
}

// A [batch, seq, heads, head_dim] tensor in global memory (strides in elements).
struct GmemTensor {
  const void* ptr;
  int head_dim, seqlen, heads, batch;
  int64_t row_stride, head_stride, batch_stride;
};

// The element type as TMA sees it.
struct TmaElement {
  CUtensorMapDataType type;
  int bytes;
};
template <typename Element>
constexpr TmaElement tma_element() {
  return TmaElement{ElementTraits<Element>::kTmaType, ElementTraits<Element>::kBytes};
}
inline TmaElement tma_element(DType dtype) {
  return dtype == DType::kFloat16 ? tma_element<__half>() : tma_element<__nv_bfloat16>();
}

// 4-d map (head_dim, seq, heads, batch), box {one row of row_bytes, box_rows,
// 1, 1} with the swizzle of that row (128B, or 64B for the 64-byte rows of an
// 8-bit head dim of 64); out-of-bounds reads are 0, out-of-bounds writes
// dropped.
inline bool encode_bshd(CUtensorMap* map, TmaElement elem, const GmemTensor& t, int box_rows,
                        int row_bytes = 128) {
  if (row_bytes != 128 && row_bytes != 64) return false;
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const int seq = std::max(t.seqlen, 1);  // never loaded when 0, but dims must be > 0
  cuuint64_t dims[4] = {cuuint64_t(t.head_dim), cuuint64_t(seq), cuuint64_t(t.heads),
                        cuuint64_t(t.batch)};
  cuuint64_t strides[3] = {stride_bytes(t.row_stride, seq, elem.bytes),
                           stride_bytes(t.head_stride, t.heads, elem.bytes),
                           stride_bytes(t.batch_stride, t.batch, elem.bytes)};
  cuuint32_t box[4] = {cuuint32_t(row_bytes / elem.bytes), cuuint32_t(box_rows), 1, 1};
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, elem.type, 4, const_cast<void*>(t.ptr), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            row_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// The positional form the backward launcher uses (16-bit dtypes).
inline bool encode_bshd(CUtensorMap* map, DType dtype, const void* ptr, int head_dim, int seqlen,
                        int heads, int batch, int64_t row_stride, int64_t head_stride,
                        int64_t batch_stride, int box_rows) {
  return encode_bshd(map, tma_element(dtype),
                     GmemTensor{ptr, head_dim, seqlen, heads, batch, row_stride, head_stride,
                                batch_stride},
                     box_rows);
}

// The q / k / v / o tensors of a forward call (v and o: head_dim_v columns).
inline GmemTensor fwd_q(const FwdParams& p) {
  return {p.q, p.head_dim, p.seqlen_q, p.num_heads, p.batch, p.q_row_stride, p.q_head_stride,
          p.q_batch_stride};
}
inline GmemTensor fwd_k(const FwdParams& p) {
  return {p.k, p.head_dim, p.seqlen_k, p.num_heads_k, p.batch, p.k_row_stride, p.k_head_stride,
          p.k_batch_stride};
}
inline GmemTensor fwd_v(const FwdParams& p) {
  return {p.v, p.head_dim_v, p.seqlen_k, p.num_heads_k, p.batch, p.v_row_stride, p.v_head_stride,
          p.v_batch_stride};
}
inline GmemTensor fwd_o(const FwdParams& p) {
  return {p.o, p.head_dim_v, p.seqlen_q, p.num_heads, p.batch, p.o_row_stride, p.o_head_stride,
          p.o_batch_stride};
}

}  // namespace jax_flash::sm90
