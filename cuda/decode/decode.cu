// Request checks and the dtype dispatch of the decoding kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "decode/decode.h"
#include "jax_flash/head_dim.h"
#include "jax_flash/support.h"

namespace jax_flash::decode {

template <typename Element>
cudaError_t launch_decode_split(const DecodeParams& p, cudaStream_t stream);
template <typename Element>
cudaError_t launch_decode_combine(const DecodeParams& p, cudaStream_t stream, CombineKind kind);
extern template cudaError_t launch_decode_split<__nv_bfloat16>(const DecodeParams&, cudaStream_t);
extern template cudaError_t launch_decode_split<__half>(const DecodeParams&, cudaStream_t);
extern template cudaError_t launch_decode_combine<__nv_bfloat16>(const DecodeParams&, cudaStream_t, CombineKind);
extern template cudaError_t launch_decode_combine<__half>(const DecodeParams&, cudaStream_t, CombineKind);

bool decode_supported(const DecodeParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
  if (p.batch < 0 || p.seqlen_q < 0 || p.num_heads <= 0 || p.num_heads_k <= 0) return false;
  if (p.num_heads % p.num_heads_k != 0) return false;
  if (p.head_dim <= 0 || p.head_dim > 256 || p.head_dim % 8 != 0) return false;
  if (p.page_size <= 0 || p.max_pages < 0 || p.num_pages < 0) return false;
  if (p.num_splits < 1 || p.num_splits > kDecodeMaxSplits) return false;
  if (p.num_splits > 1 && (p.o_partial == nullptr || p.lse_partial == nullptr)) return false;
  // Grid: x = row blocks, y = batch * heads_k, z = splits (65535 each).
  if (int64_t(p.batch) * p.num_heads_k > 65535) return false;
  if (decode_row_blocks(p.seqlen_q, p.num_heads / p.num_heads_k, rounded_head_dim(p.head_dim)) > 65535)
    return false;
  if (int64_t(p.max_pages) * p.page_size > (int64_t(1) << 31) - 1) return false;
  // The combine's grid: a CTA per (batch, head, token) row with many splits.
  if (p.num_splits > 1 && int64_t(p.batch) * p.num_heads * p.seqlen_q > (int64_t(1) << 31) - 1) return false;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.o)) return false;
  if (p.kv_fp8) {  // descales loaded four keys at a time; 16-element chunks of e4m3
    if (p.page_size % 4 != 0 || p.head_dim % 16 != 0) return false;
    if (rounded_head_dim(p.head_dim) == 96) return false;  // e4m3 pairs in 32-column blocks
    if (p.k_descale == nullptr || p.v_descale == nullptr) return false;
    if (!aligned16(p.k_descale) || !aligned16(p.v_descale)) return false;
    if (!(p.q_scale > 0.f)) return false;
  }
  return true;
}

namespace {

// Both launches of run_decode, or one of them (a checked request).
enum Launches { kSplit = 1, kCombine = 2 };
template <typename Element>
cudaError_t launch(const DecodeParams& p, int launches, CombineKind kind, cudaStream_t stream) {
  if (launches & kSplit) {
    const cudaError_t err = launch_decode_split<Element>(p, stream);
    if (err != cudaSuccess) return err;
  }
  return launches & kCombine ? launch_decode_combine<Element>(p, stream, kind) : cudaSuccess;
}

cudaError_t checked_launch(const DecodeParams& p, int launches, CombineKind kind, cudaStream_t stream) {
  if (!decode_supported(p)) return cudaErrorInvalidValue;
  const int64_t rows = int64_t(p.batch) * p.num_heads * p.seqlen_q;
  if (rows == 0) return cudaSuccess;  // nothing to write
  return p.dtype == DType::kBFloat16 ? launch<__nv_bfloat16>(p, launches, kind, stream)
                                     : launch<__half>(p, launches, kind, stream);
}

}  // namespace

cudaError_t run_decode(const DecodeParams& p, cudaStream_t stream) {
  return checked_launch(p, kSplit | kCombine, decode_combine_kind(p.num_splits), stream);
}

cudaError_t run_decode_split(const DecodeParams& p, cudaStream_t stream) {
  return checked_launch(p, kSplit, CombineKind::kWarpPerRow, stream);
}

cudaError_t run_decode_combine(const DecodeParams& p, CombineKind kind, cudaStream_t stream) {
  return checked_launch(p, kCombine, kind, stream);
}

}  // namespace jax_flash::decode
