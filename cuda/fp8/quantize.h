// The FP8 attention's quantisation pre-pass (jax_flash/_src/fp8/scheme.py,
// the same values as jax_flash/_src/fp8/quantize.py up to the rounding of the
// rotation's sums): 16-bit Q, K, V in, e4m3 + float32 descales out.
//   Q, K: optional rotation along head_dim (x * signs, fast Walsh-Hadamard
//         transform, / sqrt(D)), one descale per `block` rows of a head;
//   V:    one descale per (head, channel) over the sequence, written
//         transposed [batch, heads, head_dim, seq_pad] with the keys of each
//         group of 32 permuted (scheme.py v_key_permutation).
// Each launcher reads its input once (V: twice, its amax pass first); all
// are memory-bound and run on the caller's stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_flash/params.h"

namespace jax_flash::fp8 {

// x [batch, n, heads, head_dim] (contiguous) -> x8 (same layout, e4m3) and
// descale [batch, heads, ceil(n / block)]. signs: [head_dim] +-1 or nullptr
// (no rotation). head_dim 64, 128 or 256; block 64 or 128.
struct RowsArgs {
  const void* x;
  DType dtype;  // kBFloat16 or kFloat16
  const float* signs;
  void* x8;
  float* descale;
  int batch, n, heads, head_dim, block;
};
bool quantize_rows_supported(const RowsArgs& a);
cudaError_t quantize_rows(const RowsArgs& a, cudaStream_t stream);

// v [batch, s, heads, head_dim] -> vt8 [batch, heads, head_dim, s_pad] and
// descale [batch, heads, head_dim]; amax: a [batch, heads, head_dim] uint32
// workspace (zeroed here on the stream).
struct ChannelsArgs {
  const void* v;
  DType dtype;
  void* vt8;
  float* descale;
  uint32_t* amax;
  int batch, s, s_pad, heads, head_dim;
};
bool quantize_v_supported(const ChannelsArgs& a);
cudaError_t quantize_v(const ChannelsArgs& a, cudaStream_t stream);

}  // namespace jax_flash::fp8
