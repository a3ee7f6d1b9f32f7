// Plain parameter structs shared by the FFI handlers and every kernel family.
// No CUDA/CUTLASS types here so that host-only code can include it.
#pragma once

#include <cstdint>

#include "jax_flash/head_dim.h"  // rounded_head_dim: BwdParams::head_dim_rounded

namespace jax_flash {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat8E4M3 = 2 };

// Attention dropout on P (jax_flash/_src/core/dropout.py; the kernels' side
// is philox.h's Dropout): element (b, h, i, j) is kept iff its Philox byte is
// >= threshold, kept elements are scaled by 256 / (256 - threshold). The key
// comes from a traced jax.random key, so it is device data.
struct DropoutArgs {
  // device [6]: key0, key1 and the call's origin in the whole request,
  // batch0, head0, row0, col0 (col0 a multiple of 64: philox.h Dropout).
  const uint32_t* words = nullptr;
  uint32_t threshold = 0;           // round(rate * 256); 0 = no dropout
  bool broadcast = false;           // one mask for every (batch, head)
  constexpr bool enabled() const { return threshold != 0; }
};

// Forward: O = softmax(scale * Q K^T + mask) V, LSE = logsumexp (natural log).
// Layout [batch, seq, heads, head_dim], head_dim contiguous; v and o (dv and
// dout) have head_dim_v columns. Strides are in elements. Masking convention (bottom-right aligned, see spec.py):
//   query row i sits at position i + (seqlen_k - seqlen_q);
//   key j visible iff (window_left  < 0 || j >= i + off - window_left)
//                  && (window_right < 0 || j <= i + off + window_right)
//                  && (!q_segment || q_segment[b, i] == kv_segment[b, j]),
// with off shifted by q_shift[b, i] for packed sequences (see below).
// Causal is window_right = 0 (folded in Python); kernels that specialise on
// it derive it from the window (BlockInfo::causal_like). Fully masked rows:
// O = 0, LSE = -inf.
struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // [batch, heads, seqlen_q]

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;

  int batch;
  int seqlen_q;
  int seqlen_k;
  int num_heads;
  int num_heads_k;  // num_heads % num_heads_k == 0 (GQA/MQA)
  int head_dim;     // the real head dim of q and k (<= the kernel's padded kHeadDim)
  int head_dim_v;   // of v and o: head_dim, or the other half of a head-dim
                    // pair that has kernels of its own (head_dim.h)

  float scale;       // multiplier of q.k
  float softcap;     // 0 = off; else scores = softcap * tanh(scale*qk/softcap)
  int window_left;   // -1 = unbounded
  int window_right;  // -1 = unbounded

  const int32_t* q_segment;   // [batch, seqlen_q] or nullptr
  const int32_t* kv_segment;  // [batch, seqlen_k] or nullptr
  // With segment ids, optional (nullptr): the parts of the packing buffer
  // (jax_flash/packing_layout.h, 32-byte aligned spans): the tile spans, the
  // runs of each token's id, and the diagonal shifts [batch, seqlen_q] /
  // [batch, seqlen_k] of packed sequences: row i sits at key
  // i + seqlen_k - seqlen_q + q_shift[b, i].
  const int32_t* q_span = nullptr;
  const int32_t* kv_span = nullptr;
  const int32_t* q_iv = nullptr;
  const int32_t* kv_iv = nullptr;
  const int32_t* q_shift = nullptr;
  const int32_t* kv_shift = nullptr;

  DType dtype;
  int num_sms;  // filled by the handler (for persistent schedulers)

  // O = (P * Z / (1 - rate)) V with the LSE of the undropped P; the backward
  // draws the same Z (BwdParams inherits it).
  DropoutArgs dropout;

  // Learnable sinks (jax_flash/sinks.h): [batch, num_heads] float32 logits
  // that join every row's softmax denominator, or nullptr. The forward's LSE includes
  // them, so the backward (which inherits the pointer) ignores them.
  const float* sinks = nullptr;

  // sm90 dynamic tile scheduler workspace (jax_flash::sm90 only): device
  // pointer to ONE int32 (4 bytes, 4-byte aligned), contents undefined on
  // entry; the launcher zeroes it on the stream (cudaMemsetAsync) before the
  // kernel, so a call must have it to itself while it runs (an XLA workspace
  // output per call is fine: graph replays and concurrent streams then never
  // share a counter). Needed only by the configurations with the dynamic
  // scheduler (sm90::fwd_needs_tile_counter); nullptr otherwise.
  int32_t* sm90_tile_counter = nullptr;
  // With segment ids (tile spans): [batch, ceil(seqlen_q / 64)] int32 after
  // the counter in the same workspace, where the sm90 forward ranks each
  // batch element's query blocks by cost (sm90/fwd/tile_order.cuh); nullptr:
  // the positional order.
  int32_t* sm90_tile_order = nullptr;
};

// Variable-length sequences (sm90::run_fwd_varlen): FwdParams' tensors,
// each batch row holding num_seqs sequences: sequence s has the query rows
// [cu_seqlens_q[b, s], cu_seqlens_q[b, s + 1]) and the keys [cu_seqlens_k[b,
// s], cu_seqlens_k[b, s + 1]) ([batch, num_seqs + 1] int32 each) and attends
// within itself, bottom-right aligned per sequence; no segment ids. Rows
// outside every sequence get O = 0 and LSE = -inf (the sink) only with
// varlen_outside (else the caller knows there are none).
struct VarlenFwdParams : FwdParams {
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int num_seqs = 0;
  bool varlen_outside = false;
};

// FP8 forward (sm90; the scheme of jax_flash/_src/fp8/scheme.py): q, k, v
// e4m3 [batch, seq, heads, head_dim] in their natural layouts (FwdParams'
// fields and strides, dtype kFloat8E4M3; the kernel transposes V in shared
// memory); o in out_dtype (bf16 or fp16). The descales are float32: the true
// inputs are q8 * q_descale (per 64 query rows), k8 * k_descale (per 128
// keys), v8 * v_descale (per channel). head_dim is the kernel's bucket.
struct Fp8FwdParams : FwdParams {
  const float* q_descale;  // [batch, heads, ceil(seqlen_q / 64)]
  const float* k_descale;  // [batch, heads_k, ceil(seqlen_k / 128)]
  const float* v_descale;  // [batch, heads_k, head_dim]
  DType out_dtype;
};

// Backward with recomputation. delta = rowsum(dO * O) - dLSE (fp32,
// [batch, heads, seqlen_q]) is computed by the caller (XLA) beforehand.
struct BwdParams : FwdParams {
  const void* dout;     // same layout/strides as o
  const float* delta;   // [batch, heads, seqlen_q]
  void* dq;             // q layout (same strides as q)
  void* dk;             // k layout
  void* dv;             // v layout
  // Workspaces, allocated by XLA as extra outputs (sizes computed in Python):
  // Rounded sizes (rounded_seqlen below, rounded_head_dim in head_dim.h; Python uses the
  // same rule in jax_flash/_src/cuda_backend.py to size the workspaces).
  int seqlen_q_rounded;   // round_up(seqlen_q, 128)
  int seqlen_k_rounded;   // round_up(seqlen_k, 128)
  int head_dim_rounded;   // the kernel's kHeadDim: rounded_head_dim(head_dim, head_dim_v)
  float* dq_accum;  // [batch, heads, seqlen_q_rounded, head_dim_rounded] fp32;
                    // uninitialised on entry: the launcher zeroes it (async, on the stream)
  float* dk_accum;  // [batch, heads_k, seqlen_k_rounded, head_dim_rounded] fp32,
  float* dv_accum;  // [.., rounded_head_dim(head_dim_v)], only when num_heads !=
                    // num_heads_k (GQA sums); else nullptr
  bool deterministic;   // fixed dQ accumulation order
  // sm90 deterministic-mode workspace (jax_flash::sm90::run_bwd with
  // deterministic only): device pointer to sm90_bwd_semaphore_ints(batch,
  // num_heads, seqlen_q) int32 (4-byte aligned), contents undefined on entry;
  // the launcher zeroes the part it uses on the stream (cudaMemsetAsync)
  // before the kernel, so a call must have it to itself while it runs (an XLA
  // workspace output per call). Holds one dQ-order semaphore per (batch, q
  // head, 64-row query block) and the kernel's tile-claim counter. nullptr:
  // sm90::bwd_supported is false for deterministic requests (sm80 serves them).
  int32_t* sm90_dq_semaphore = nullptr;
};

// Variable-length backward (cu_seqlens, FA3's varlen; sm90): the packed
// tensors are one batch row of seqlen_q / seqlen_k tokens (batch rows > 1:
// one packing each, offsets [batch, num_seqs + 1]); lse and delta
// [batch, heads, seqlen_q] per packed row.
struct VarlenBwdParams : BwdParams {
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int num_seqs = 0;
};

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }
// Size (int32 elements) of BwdParams::sm90_dq_semaphore: a semaphore per
// (batch, q head, query block of 64 rows: the smallest kBlockM of the sm90
// backward) + the tile-claim counter. Python mirrors it (cuda_backend.py).
inline int64_t sm90_bwd_semaphore_ints(int batch, int num_heads, int seqlen_q) {
  return int64_t(batch) * num_heads * ((int64_t(seqlen_q) + 63) / 64) + 1;
}
inline int rounded_seqlen(int n) { return round_up(n, 128); }

}  // namespace jax_flash
