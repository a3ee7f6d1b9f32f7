// Entry points of the FA3-style Hopper forward (sm_90a only).
#pragma once

#include <cuda_runtime.h>

#include "jax_flash/params.h"

namespace jax_flash::sm90 {

// True when run_fwd can serve `params` on the current device: an sm_90 GPU
// (the code is built for sm_90a), bf16/fp16 (if compiled), head_dim a multiple
// of 8 up to 256 (buckets 64 / 128 / 256, zero-padded) with head_dim_v ==
// head_dim, or a (head_dim, head_dim_v) pair of Sm90FwdHeadDimPairs (192 /
// 128, DeepSeek MLA; served exactly; other pairs run in sm80), 16-byte aligned
// base pointers, strides that are multiples of 8 elements (TMA: 16-byte strides),
// enough opt-in shared memory, the tile counter workspace where the
// configuration needs one (fwd_needs_tile_counter). Everything else
// (causal, windows, GQA/MQA, segment ids, softcap, any seqlen) is supported.
bool fwd_supported(const FwdParams& params);

// Launches on `stream`; cudaErrorNotSupported when !fwd_supported(params)
// (callers fall back to jax_flash::sm80::run_fwd), else the launch error.
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream);

// Whether the configuration that serves `params` (fwd_tuning.h, per head-dim
// bucket and mask: causal-like masks) uses the dynamic tile scheduler, which
// needs params.sm90_tile_counter: a device workspace of kFwdTileCounterBytes
// per call, zeroed by run_fwd on the stream (fwd_supported is false without it).
constexpr size_t kFwdTileCounterBytes = 4;
bool fwd_needs_tile_counter(const FwdParams& params);

// Variable-length sequences (VarlenFwdParams: cu_seqlens_q / _k, num_seqs; FA3's
// varlen): each tile one query block of one sequence, loads at its offsets,
// rows stored up to its end; the tile order decoded from the offsets in the
// kernel (jax_flash/varlen_order.h). True when run_fwd_varlen can serve
// `params`: fwd_supported's shapes and layout rules, the offsets, the tile
// counter (always: the dynamic varlen scheduler), no segment ids, no dropout.
// Causal, windows, GQA/MQA, softcap, sinks are supported.
bool fwd_varlen_supported(const VarlenFwdParams& params);
cudaError_t run_fwd_varlen(const VarlenFwdParams& params, cudaStream_t stream);

// The variable-length backward (VarlenBwdParams; jax_flash/varlen_bwd_order.h):
// a CTA per (sequence, KV block of its own length, kv head), heaviest first,
// loads at the sequence's offsets, dQ / dK / dV rows of that sequence only.
// True when run_bwd_varlen can serve `params`: bwd_supported's shapes and
// layout rules, the offsets, a bucket of Sm90BwdVarlenHeadDims, no segment
// ids, no dropout, not deterministic, v's head dim equal to q's.
bool bwd_varlen_supported(const VarlenBwdParams& params);
cudaError_t run_bwd_varlen(const VarlenBwdParams& params, cudaStream_t stream);

// FP8 forward (e4m3 q, k, V^T; Fp8FwdParams in params.h): true when
// run_fwd_fp8 can serve `params`: an sm_90 GPU, head_dim 128 or 256, out_dtype
// bf16 or fp16 (if compiled), the TMA layout rules (16-byte aligned bases,
// 16-byte strides), non-null descales, the tile counter where the
// configuration needs one (fwd_fp8_needs_tile_counter). Causal, windows,
// GQA/MQA, segment ids, softcap and any seqlen are supported.
bool fwd_fp8_supported(const Fp8FwdParams& params);
cudaError_t run_fwd_fp8(const Fp8FwdParams& params, cudaStream_t stream);
bool fwd_fp8_needs_tile_counter(const Fp8FwdParams& params);

// Backward (FA3 style, bwd_*.cuh): true when run_bwd can serve `params`: an
// sm_90 GPU, bf16/fp16, head_dim a multiple of 8 up to 256 (buckets 64 / 128 /
// 256; head_dim_rounded must be rounded_head_dim(head_dim), the dq_accum pitch)
// with head_dim_v == head_dim, or a (head_dim, head_dim_v) pair of
// Sm90BwdHeadDimPairs (192 / 128, DeepSeek MLA; served exactly, pitch 192;
// without dropout: other pairs and the pair's dropout run in sm80),
// deterministic only with params.sm90_dq_semaphore (sm90_bwd_semaphore_ints
// int32, params.h; then dQ is added in a fixed order, bitwise reproducible), the
// TMA layout rules of fwd_supported for q, k, v, dout (o strides), dk (k
// strides), dv (v strides), non-null lse / delta / dq_accum (16-byte aligned).
// Causal, windows, GQA/MQA, segment ids, softcap, any seqlen are supported.
bool bwd_supported(const BwdParams& params);

// dQ, dK, dV on `stream` (zeroes dq_accum first, then the main kernel and
// the dq_convert pass); cudaErrorNotSupported when !bwd_supported(params)
// (callers fall back to jax_flash::sm80::run_bwd), else the launch error.
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream);

}  // namespace jax_flash::sm90
