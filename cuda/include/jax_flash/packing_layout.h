// The packing buffer: everything the kernels know about segment ids beyond
// the ids themselves, written by the tile-span pre-pass (cuda/packing/) and
// read through MaskInfo (mask_info.h). int32 offsets; Python sizes the buffer
// with the same rule (jax_flash/_src/cuda_backend.py packing_ints).
//   q_span   [batch, ceil(seqlen_q / 64), 8]  per 64 query rows: key span
//   kv_span  [batch, ceil(seqlen_k / 64), 8]  per 64 keys: query-row span
//            (each {lo, hi, full_lo, full_hi, exact, 0, 0, 0}, mask_info.h)
//   q_iv     [batch, seqlen_q, 2]  the keys [lo, hi) each row sees (its id's
//                                  run within the band; exact groups only)
//   kv_iv    [batch, seqlen_k, 2]  the rows [lo, hi) that see each key
//   q_shift  [batch, seqlen_q]     with diagonal shifts only
//   kv_shift [batch, seqlen_k]
#pragma once

#include <cstdint>

namespace jax_flash {

constexpr int kSpanRows = 64;   // rows (keys) per span group
constexpr int kSpanInts = 8;    // int32 per span entry (32 bytes)

struct PackingLayout {
  int64_t q_span, kv_span, q_iv, kv_iv, q_shift, kv_shift, total;
};

inline PackingLayout packing_layout(int batch, int seqlen_q, int seqlen_k, bool has_shifts) {
  const int64_t b = batch;
  const int64_t gq = (int64_t(seqlen_q) + kSpanRows - 1) / kSpanRows;
  const int64_t gk = (int64_t(seqlen_k) + kSpanRows - 1) / kSpanRows;
  PackingLayout l;
  l.q_span = 0;
  l.kv_span = l.q_span + b * gq * kSpanInts;
  l.q_iv = l.kv_span + b * gk * kSpanInts;
  l.kv_iv = l.q_iv + b * seqlen_q * 2;
  l.q_shift = l.kv_iv + b * seqlen_k * 2;
  l.kv_shift = l.q_shift + (has_shifts ? b * seqlen_q : 0);
  l.total = l.kv_shift + (has_shifts ? b * seqlen_k : 0);
  return l;
}

}  // namespace jax_flash
