// The FP8 attention's quantisation pre-pass (jax_flash/_src/fp8/scheme.py,
// the same values as jax_flash/_src/fp8/quantize.py up to the rounding of the
// rotation's sums): 16-bit Q, K, V [batch, seq, heads, head_dim] in, e4m3 in
// the same layouts + float32 descales out.
//   Q, K: optional rotation along head_dim (x * signs, fast Walsh-Hadamard
//         transform, / sqrt(D)), one descale per 64 (Q) or fp8_k_block(D)
//         (K; jax_flash/fp8_scheme.h) rows of a head;
//   V:    one descale per (batch, head, channel) over the whole sequence.
// Two launches on the caller's stream, both memory-bound:
//   1. clusters of 4 CTAs (fp8/prepass_layout.h), each one unit of work:
//      a K descale block split over the 4 CTAs (over 2 for Q at D = 256; at
//      D <= 128 a Q unit is 4 blocks, one per CTA), the parts' maxima
//      exchanged through distributed shared memory, so that a thread holds at
//      most 32 rotated values and the whole kernel fits in 64 registers (4
//      CTAs of 256 threads per SM, for every kind: one kernel has one
//      register count); or 4 chunks of V's keys (partial channel maxima, to
//      the workspace). K and Q units alternate, V's come last;
//   2. V: one CTA per (256 keys, head, batch), from the last (batch, head)
//      back (the keys launch 1 read last are the likeliest still in L2),
//      reduces the partial maxima of its (batch, head), writes the descales
//      (the CTA of the first keys) and the e4m3 values with 16-byte stores.
// Q and K are read once, V twice (the second time partly from L2); no
// memset, no atomics.
//
// Workspace (v_partial, float32): batch * heads_k * v_chunks(seqlen_k) *
// head_dim elements, v_chunks(s) = min(ceil(s / 512), 32) (the chunks of keys
// of one (batch, head); jax_flash/_src/fp8/cuda.py computes the same).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "jax_flash/params.h"

namespace jax_flash::fp8 {

constexpr int kVChunkKeys = 512;  // the fewest keys per chunk (unless s is smaller)
constexpr int kVMaxChunks = 32;   // the most chunks per (batch, head)

inline int v_chunks(int seqlen_k) {
  const int c = (seqlen_k + kVChunkKeys - 1) / kVChunkKeys;
  return c < kVMaxChunks ? c : kVMaxChunks;
}

inline size_t v_partial_elements(int batch, int heads_k, int seqlen_k, int head_dim) {
  return size_t(batch) * size_t(heads_k) * size_t(v_chunks(seqlen_k)) * size_t(head_dim);
}

// q [batch, seqlen_q, heads, head_dim], k and v [batch, seqlen_k, heads_k,
// head_dim] (contiguous, one dtype) -> q8, k8, v8 (the same shapes, e4m3) and
// descales q [batch, heads, ceil(seqlen_q / 64)], k [batch, heads_k,
// ceil(seqlen_k / fp8_k_block(head_dim))], v [batch, heads_k, head_dim]. signs: [head_dim] +-1
// or nullptr (no rotation). head_dim 64, 128 or 256; every pointer 16-byte
// aligned.
struct PrepassArgs {
  const void* q;
  const void* k;
  const void* v;
  DType dtype;  // kBFloat16 or kFloat16
  const float* signs;
  void* q8;
  float* q_descale;
  void* k8;
  float* k_descale;
  void* v8;
  float* v_descale;
  float* v_partial;  // workspace, v_partial_elements(...) floats
  int batch, seqlen_q, seqlen_k, heads, heads_k, head_dim;
};
bool prepass_supported(const PrepassArgs& a);
cudaError_t prepass(const PrepassArgs& a, cudaStream_t stream);

}  // namespace jax_flash::fp8
