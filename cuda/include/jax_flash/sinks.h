// Learnable attention sinks (jax_flash/_src/autodiff/sinks.py): one logit per
// head joins every row's softmax denominator and takes no value,
//   out = sum_j e^{x_j} v_j / (sum_j e^{x_j} + e^{sink}),
//   lse = log(sum_j e^{x_j} + e^{sink}),
// and the backward needs nothing else: P = e^{x - lse} with this lse, and
// d sink = -sum over rows of e^{sink - lse} * (rowsum(dO * O) - dLSE)
// (computed in JAX from the saved LSE). Shared by the sm80 and sm90 forwards' finalize
// and the decoding kernels' finalize and split combine (cuda/decode).
#pragma once

#include <cmath>
#include <cstdint>

namespace jax_flash {

// log(e^{lse_keys} + e^{sink}) for a row whose keys' LSE is finite; stable
// for any sink: log(e^a + e^b) = max + log1p(e^{-|a - b|}).
__device__ __forceinline__ float lse_with_sink(float lse_keys, float sink) {
  const float hi = fmaxf(lse_keys, sink), lo = fminf(lse_keys, sink);
  return hi + log1pf(__expf(lo - hi));
}

// A row's online-softmax result with the sink folded in. m_ln: the max (in
// natural-log logit units) that the row's sum l and its O accumulator are
// relative to (l = sum_j e^{x_j - m_ln}); l = 0 for a row that saw no
// visible key. Returns in lse the row's LSE and in o_factor the factor of the
// O accumulator (e^{m_ln - lse}; 0 for an empty row, whose LSE is the sink).
__device__ __forceinline__ void finish_row_with_sink(float m_ln, float l, float sink, float& lse,
                                                     float& o_factor) {
  if (!(l > 0.f)) {
    lse = sink;
    o_factor = 0.f;
    return;
  }
  lse = lse_with_sink(m_ln + __logf(l), sink);
  o_factor = __expf(m_ln - lse);
}

// The sink logit of (batch, head) in sinks [batch, heads] (-inf: none, the
// plain softmax). Per batch element: jax.vmap folds its axis into the batch.
__device__ __forceinline__ float sink_of(const float* sinks, int batch, int head, int num_heads) {
  return sinks == nullptr ? -INFINITY : __ldg(sinks + int64_t(batch) * num_heads + head);
}

}  // namespace jax_flash
