// Appending the new tokens' keys and values to a KV cache, the step before
// decoding against it (FlashAttention's k_new / v_new): one launch writes
// both caches in place and the lengths that the decoding kernels then read,
// where XLA would run a scatter per cache and the index arithmetic apart.
// Plain types only (host code includes it).
//
// Layouts as decode_params.h (head_dim contiguous, 16-bit elements):
//   k, v          [num_pages, page_size, heads_k, head_dim], written in place
//   k_new, v_new  [batch, seqlen_new, heads_k, head_dim]
// New token t of sequence b goes to position pos = seqlens[b] + t, i.e. page
// page_table[b, pos / page_size], slot pos % page_size; without a page table
// (a contiguous cache whose row b is sequence b, max_pages = 1) page b. Positions outside
// [0, max_pages * page_size) and page entries outside [0, num_pages) are
// dropped (written nowhere), as jax's scatter with mode="drop".
//   seqlens_out[b] = clamp(seqlens[b] + seqlen_new, 0, max_pages * page_size)
// (the keys the sequence then holds, as the decoding kernels clamp them).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_flash::decode {

struct AppendParams {
  void* k;
  void* v;
  const void* k_new;
  const void* v_new;
  const int32_t* page_table;  // [batch, max_pages], or nullptr: page b (max_pages 1)
  const int32_t* seqlens;     // [batch] keys held before the new ones
  int32_t* seqlens_out;       // [batch]; may be seqlens (updated in place)
  int batch, seqlen_new, num_heads_k, head_dim;
  int num_pages, page_size, max_pages;
};

// 16-bit elements, head_dim a multiple of 8 (whole 16-byte chunks), 16-byte
// aligned buffers, grid sizes within CUDA's limits. Nothing to write (an
// empty batch) is well-formed.
bool append_supported(const AppendParams& p);

// The append kernel on `stream` (cudaErrorInvalidValue if not supported).
cudaError_t run_append(const AppendParams& p, cudaStream_t stream);

}  // namespace jax_flash::decode
