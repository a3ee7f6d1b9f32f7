// The tile-span pre-pass: reads the segment ids (and diagonal shifts) once
// per 64-row group and writes the packing buffer (jax_flash/packing_layout.h)
// in one launch: per group the span of the other axis it can see (the same
// values as jax_flash/_src/tile_spans.py) and whether every id of the group
// occupies one run on the other side ("exact"), and then per token of an
// exact group the interval it sees (its id's run within the band), so that
// the kernels' masks test one interval instead of the other side's ids.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_flash::packing {

struct TileSpanArgs {
  const int32_t* q_seg;     // [batch, seqlen_q]
  const int32_t* kv_seg;    // [batch, seqlen_k]
  const int32_t* q_shift;   // [batch, seqlen_q] or nullptr (no shifts)
  const int32_t* kv_shift;  // [batch, seqlen_k] or nullptr
  int batch, seqlen_q, seqlen_k;
  int window_left, window_right;  // -1 = unbounded (bottom-right aligned)
  int32_t* out;                   // packing_layout(...).total int32
};

cudaError_t tile_spans(const TileSpanArgs& a, cudaStream_t stream);

}  // namespace jax_flash::packing
