// The request checks that every kernel family makes (host side): problem
// shape, head dim, options and the backward's buffers. A family adds only
// what is its own (alignment of its loads, TMA layouts, shared memory,
// devices, workspaces it alone uses).
#pragma once

#include <cstdint>

#include "jax_flash/head_dim.h"
#include "jax_flash/params.h"

namespace jax_flash {

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// Shapes, head dims and options the kernels are written for: head_dim and
// head_dim_v multiples of 8 (16-byte rows of 16-bit elements) up to 256
// (whether a family has kernels for head_dim_v != head_dim is its own
// check), GQA groups,
// heads and batch within a grid dimension (65535), segment ids both or
// neither, scale > 0, softcap >= 0 (0 = off). Zero lengths and an empty batch
// are well-formed (the launchers then have little or nothing to do).
inline bool problem_ok(const FwdParams& p) {
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.num_heads <= 0 || p.num_heads_k <= 0)
    return false;
  if (p.num_heads % p.num_heads_k != 0) return false;
  if (p.head_dim <= 0 || p.head_dim > 256 || p.head_dim % 8 != 0) return false;
  if (p.head_dim_v <= 0 || p.head_dim_v > 256 || p.head_dim_v % 8 != 0) return false;
  if (p.num_heads > 65535 || p.batch > 65535) return false;  // grid y / z
  if ((p.q_segment == nullptr) != (p.kv_segment == nullptr)) return false;
  if (!(p.scale > 0.f) || !(p.softcap >= 0.f)) return false;
  return true;
}

// The backward's inputs and the dq_accum workspace (its pitch is
// rounded_head_dim in both families).
inline bool bwd_buffers_ok(const BwdParams& p) {
  const int pitch = rounded_head_dim(p.head_dim, p.head_dim_v);
  if (pitch == 0 || p.head_dim_rounded != pitch) return false;
  if (p.lse == nullptr || p.delta == nullptr) return false;
  return true;
}
inline bool dq_accum_ok(const BwdParams& p) {
  return p.dq_accum != nullptr && aligned16(p.dq_accum) && p.seqlen_q_rounded >= p.seqlen_q;
}

}  // namespace jax_flash
