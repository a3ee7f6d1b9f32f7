// XLA FFI handlers: validate -> fill params -> launch -> check the launch.
//
// Python (jax_flash/_src/cuda_backend.py) validates everything first, so the
// checks here are a second line of defence that turn a mismatch into an
// InvalidArgument error with a readable message instead of a bad launch.
// Workspaces are extra results sized in Python, so no handler allocates
// memory and every handler can be captured in a CUDA graph
// (kCmdBufferCompatible).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "ffi/handler_util.h"
#include "jax_flash/device_attribute.h"
#include "jax_flash/head_dim.h"
#include "jax_flash/packing_layout.h"
#include "jax_flash/params.h"
#include "packing/tile_spans.h"
#include "sm80/launch.h"
#ifdef JAX_FLASH_HAS_SM90
#include "sm90/launch.h"
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace {

// "(192, 128), ...": the head-dim pairs of a family.
template <typename... Pairs>
std::string PairList(HeadDimPairs<Pairs...>) {
  std::string s;
  ((s += (s.empty() ? "(" : ", (") + std::to_string(Pairs::kHeadDim) + ", " +
         std::to_string(Pairs::kHeadDimV) + ")"),
   ...);
  return s;
}

// Q/K/V/O: rank-4 [batch, seq, heads, head_dim], contiguous; v (and o) may
// have a head dim of their own where the sm80 kernels have that pair.
ffi::Error CheckQkv(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                    const ffi::AnyBuffer& v, DType* dtype) {
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4 ||
      v.dimensions().size() != 4) {
    return Invalid("q, k, v must be rank 4 [batch, seq, heads, head_dim]; got " +
                   ShapeStr(q) + ", " + ShapeStr(k) + ", " + ShapeStr(v));
  }
  auto t = q.element_type();
  if (t != ffi::DataType::BF16 && t != ffi::DataType::F16) {
    return Invalid("dtype must be bfloat16 or float16");
  }
  if (k.element_type() != t || v.element_type() != t) {
    return Invalid("q, k, v must have the same dtype");
  }
  *dtype = t == ffi::DataType::BF16 ? DType::kBFloat16 : DType::kFloat16;
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  for (int i = 0; i < 3; ++i) {
    if (kd[i] != vd[i]) return Invalid("k and v differ in batch, length or heads: " + ShapeStr(k) + " vs " + ShapeStr(v));
  }
  if (qd[0] != kd[0]) return Invalid("batch of q and k differ");
  if (qd[3] != kd[3]) return Invalid("head_dim of q and k differ");
  if (qd[3] < 1 || qd[3] > 256) return Invalid("head_dim must be in 1..256, got " + std::to_string(qd[3]));
  if (vd[3] != qd[3] && !Sm80HeadDimPairs::contains(static_cast<int>(qd[3]), static_cast<int>(vd[3]))) {
    return Invalid("no kernel for head_dim " + std::to_string(qd[3]) + " with value head_dim " +
                   std::to_string(vd[3]) + "; the (head_dim, value head_dim) pairs with kernels: " +
                   PairList(Sm80HeadDimPairs{}));
  }
  // Zero heads (an empty call) only on both sides: q heads without kv heads
  // have nothing to attend to, and kv heads without q heads would still owe
  // their (zero) gradients.
  if (kd[2] < 1 ? qd[2] != 0 : qd[2] % kd[2] != 0) {
    return Invalid("q heads must be a multiple of kv heads");
  }
  return ffi::Error::Success();
}

// o and dout: q's batch, length and heads, v's head dim, q's dtype.
bool IsOutputShape(const ffi::AnyBuffer& q, const ffi::AnyBuffer& v, const ffi::AnyBuffer& o) {
  auto qd = q.dimensions(), vd = v.dimensions(), od = o.dimensions();
  return od.size() == 4 && od[0] == qd[0] && od[1] == qd[1] && od[2] == qd[2] && od[3] == vd[3] &&
         o.element_type() == q.element_type();
}

// Forward kernel family: 0 = the best that serves the request (sm90 on an
// sm_90 GPU when jax_flash::sm90::fwd_supported, else sm80), 80 or 90 = that
// family only (90 fails with a message when it cannot serve the call).
ffi::Error LaunchForward(const FwdParams& p, int32_t family, cudaStream_t stream) {
  if (family != 0 && family != 80 && family != 90) {
    return Invalid("kernel_family must be 0 (auto), 80 or 90; got " + std::to_string(family));
  }
#ifdef JAX_FLASH_HAS_SM90
  if (family != 80 && sm90::fwd_supported(p)) return LaunchError(sm90::run_fwd(p, stream), "sm90 forward");
#endif
  if (family == 90) {
    return Invalid("the sm90 forward cannot serve this call (needs an sm_90 GPU, a build with "
                   "sm90, 16-byte aligned rows, v's head_dim equal to q's or one of the (head_dim, "
                   "value head_dim) pairs " + PairList(Sm90FwdHeadDimPairs{}) +
                   "); use kernel_family 0 or 80");
  }
  return LaunchError(sm80::run_fwd(p, stream), "forward");
}

// Backward kernel family, as LaunchForward: sm90 (FA3-style) when it serves the
// call (sm_90 GPU, hdim <= 256; deterministic with its semaphore workspace),
// else sm80.
ffi::Error LaunchBackward(const BwdParams& p, int32_t family, cudaStream_t stream) {
  if (family != 0 && family != 80 && family != 90) {
    return Invalid("kernel_family must be 0 (auto), 80 or 90; got " + std::to_string(family));
  }
#ifdef JAX_FLASH_HAS_SM90
  if (family != 80 && sm90::bwd_supported(p)) return LaunchError(sm90::run_bwd(p, stream), "sm90 backward");
#endif
  if (family == 90) {
    return Invalid("the sm90 backward cannot serve this call (needs an sm_90 GPU, a build with sm90, "
                   "head_dim <= 256, v's head_dim equal to q's or one of the (head_dim, value head_dim) "
                   "pairs " + PairList(Sm90BwdHeadDimPairs{}) + " without dropout, 16-byte aligned rows; "
                   "deterministic=True needs the dq_semaphore workspace); use kernel_family 0 or 80");
  }
  return LaunchError(sm80::run_bwd(p, stream), "backward");
}

ffi::Error FwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                   ffi::AnyBuffer packing, ffi::Buffer<ffi::U32> dropout_words,
                   ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> o,
                   ffi::Result<ffi::Buffer<ffi::F32>> lse,
                   ffi::Result<ffi::Buffer<ffi::S32>> tile_counter, float scale,
                   float softcap, int32_t window_left, int32_t window_right,
                   bool has_segment_ids, bool has_shifts, int32_t dropout_threshold,
                   bool dropout_broadcast, bool has_sinks, int32_t kernel_family) {
  FwdParams p{};
  if (auto err = CheckQkv(q, k, v, &p.dtype); err.failure()) return err;
  FillShapes(p, q, k, v);
  if (auto err = FillDropout(p, dropout_words, dropout_threshold, dropout_broadcast); err.failure())
    return err;
  if (has_sinks) {
    if (sinks.element_count() != static_cast<size_t>(p.batch) * p.num_heads)
      return Invalid("sinks must be float32 [batch, heads] = [" + std::to_string(p.batch) + ", " +
                     std::to_string(p.num_heads) + "]; got " + std::to_string(sinks.element_count()) +
                     " elements");
    p.sinks = sinks.typed_data();
  }
  if (!IsOutputShape(q, v, *o)) return Invalid("o must have q's shape with v's head_dim, and q's dtype");
  if (lse->element_count() != static_cast<size_t>(p.batch) * p.num_heads * p.seqlen_q) {
    return Invalid("lse must be [batch, heads, seqlen_q] float32");
  }
  if (auto err = FillOptions(p, scale, softcap, window_left, window_right,
                             has_segment_ids, q_seg, kv_seg);
      err.failure()) {
    return err;
  }
  if (auto err = FillPacking(p, packing, has_shifts); err.failure()) return err;
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  // Workspace of the sm90 dynamic tile scheduler (one int32, zeroed by the
  // launcher on the stream when a schedule needs it; unused otherwise).
  if (tile_counter->element_count() < 1) return Invalid("tile_counter workspace must hold one int32");
  p.sm90_tile_counter = tile_counter->typed_data();
  // With tile spans, room after the counter for the packed tile order.
  const size_t order_ints = static_cast<size_t>(p.batch) * ((p.seqlen_q + kSpanRows - 1) / kSpanRows);
  if (p.q_span != nullptr && tile_counter->element_count() >= 1 + order_ints)
    p.sm90_tile_order = tile_counter->typed_data() + 1;
  // Empty batch, zero heads or no query rows: no element to write, and the
  // kernels' grids would have a zero dimension (an invalid launch).
  if (lse->element_count() == 0) return ffi::Error::Success();
  Poison(p.o, o->size_bytes(), stream);
  Poison(p.lse, lse->size_bytes(), stream);
  return LaunchForward(p, kernel_family, stream);
}

ffi::Error BwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse,
                   ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> delta,
                   ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer packing,
                   ffi::Buffer<ffi::U32> dropout_words,
                   ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                   ffi::Result<ffi::AnyBuffer> dv,
                   ffi::Result<ffi::Buffer<ffi::F32>> dq_accum,
                   ffi::Result<ffi::Buffer<ffi::F32>> dk_accum,
                   ffi::Result<ffi::Buffer<ffi::F32>> dv_accum,
                   ffi::Result<ffi::Buffer<ffi::S32>> dq_semaphore, float scale,
                   float softcap, int32_t window_left, int32_t window_right,
                   bool has_segment_ids, bool has_shifts, int32_t dropout_threshold,
                   bool dropout_broadcast, bool deterministic, int32_t kernel_family) {
  BwdParams p{};
  if (auto err = CheckQkv(q, k, v, &p.dtype); err.failure()) return err;
  FillShapes(p, q, k, v);
  if (auto err = FillDropout(p, dropout_words, dropout_threshold, dropout_broadcast); err.failure())
    return err;
  if (!IsOutputShape(q, v, o) || !IsOutputShape(q, v, dout)) {
    return Invalid("o and dout must have q's shape with v's head_dim, and q's dtype");
  }
  if (!SameShape(q, *dq) || !SameShape(k, *dk) || !SameShape(v, *dv)) {
    return Invalid("dq, dk and dv must have the shapes and dtypes of q, k and v");
  }
  const size_t rows = static_cast<size_t>(p.batch) * p.num_heads * p.seqlen_q;
  if (lse.element_count() != rows || delta.element_count() != rows) {
    return Invalid("lse and delta must be [batch, heads, seqlen_q] float32");
  }
  if (auto err = FillOptions(p, scale, softcap, window_left, window_right,
                             has_segment_ids, q_seg, kv_seg);
      err.failure()) {
    return err;
  }
  if (auto err = FillPacking(p, packing, has_shifts); err.failure()) return err;
  p.seqlen_q_rounded = rounded_seqlen(p.seqlen_q);
  p.seqlen_k_rounded = rounded_seqlen(p.seqlen_k);
  p.head_dim_rounded = rounded_head_dim(p.head_dim, p.head_dim_v);
  const size_t dq_need = static_cast<size_t>(p.batch) * p.num_heads *
                         p.seqlen_q_rounded * p.head_dim_rounded;
  if (dq_accum->element_count() < dq_need) {
    return Invalid("dq_accum workspace too small: " +
                   std::to_string(dq_accum->element_count()) + " < " +
                   std::to_string(dq_need));
  }
  const bool gqa = p.num_heads != p.num_heads_k;
  const size_t kv_rows = static_cast<size_t>(p.batch) * p.num_heads_k * p.seqlen_k_rounded;
  const bool have_dkv_accum =
      dk_accum->element_count() >= kv_rows * p.head_dim_rounded &&
      dv_accum->element_count() >= kv_rows * rounded_head_dim(p.head_dim_v);
  p.o = const_cast<void*>(o.untyped_data());
  p.lse = const_cast<float*>(lse.typed_data());
  p.dout = dout.untyped_data();
  p.delta = delta.typed_data();
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.dq_accum = dq_accum->typed_data();
  p.dk_accum = gqa && have_dkv_accum ? dk_accum->typed_data() : nullptr;
  p.dv_accum = gqa && have_dkv_accum ? dv_accum->typed_data() : nullptr;
  p.deterministic = deterministic;
  // Deterministic mode of the sm90 backward: dQ-order semaphores + tile-claim
  // counter (sm90_bwd_semaphore_ints; Python sizes it only when deterministic,
  // else 1 element). Too small: the sm90 family declines (sm80 serves the call).
  p.sm90_dq_semaphore =
      deterministic && static_cast<int64_t>(dq_semaphore->element_count()) >=
                           sm90_bwd_semaphore_ints(p.batch, p.num_heads, p.seqlen_q)
          ? dq_semaphore->typed_data()
          : nullptr;
  // Empty batch or zero heads: no gradient element to write (dK / dV of keys
  // that no query sees are zeros written by the kernels, so only all three
  // empty skips the launch).
  if (dq->element_count() == 0 && dk->element_count() == 0 && dv->element_count() == 0) {
    return ffi::Error::Success();
  }
  Poison(p.dq, dq->size_bytes(), stream);
  Poison(p.dk, dk->size_bytes(), stream);
  Poison(p.dv, dv->size_bytes(), stream);
  return LaunchBackward(p, kernel_family, stream);
}

// The varlen offsets of the forward and backward (VarlenFwdParams,
// VarlenBwdParams): both [batch, num_seqs + 1] int32, num_seqs >= 1.
template <typename Params>
ffi::Error FillCuSeqlens(Params& p, ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k) {
  const auto cq = cu_q.dimensions(), ck = cu_k.dimensions();
  if (cq.size() != 2 || ck.size() != 2 || cq[0] != p.batch || ck[0] != p.batch || cq[1] != ck[1] || cq[1] < 2)
    return Invalid("cu_seqlens_q and cu_seqlens_k must be int32 [batch, num_seqs + 1] with num_seqs >= 1");
  p.cu_seqlens_q = cu_q.typed_data();
  p.cu_seqlens_k = cu_k.typed_data();
  p.num_seqs = static_cast<int>(cq[1] - 1);
  return ffi::Error::Success();
}

// Variable-length sequences (sm90 only; Python routes here only on sm90):
// cu_seqlens_q / _k [batch, num_seqs + 1] int32 offsets into each batch row
// of q [batch, total_q, H, D] and k, v [batch, total_k, H_kv, D(_v)].
// may_have_outside: some rows may lie outside every sequence (they then get
// o = 0 and lse = -inf or the sink); false only when Python knows there are
// none.
ffi::Error FwdVarlenImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k,
                         ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> o,
                         ffi::Result<ffi::Buffer<ffi::F32>> lse,
                         ffi::Result<ffi::Buffer<ffi::S32>> tile_counter, float scale, float softcap,
                         int32_t window_left, int32_t window_right, bool has_sinks,
                         bool may_have_outside) {
  VarlenFwdParams p{};
  if (auto err = CheckQkv(q, k, v, &p.dtype); err.failure()) return err;
  FillShapes(p, q, k, v);
  if (has_sinks) {
    if (sinks.element_count() != static_cast<size_t>(p.batch) * p.num_heads)
      return Invalid("sinks must be float32 [batch, heads]");
    p.sinks = sinks.typed_data();
  }
  if (!IsOutputShape(q, v, *o)) return Invalid("o must have q's shape with v's head_dim, and q's dtype");
  if (lse->element_count() != static_cast<size_t>(p.batch) * p.num_heads * p.seqlen_q)
    return Invalid("lse must be [batch, heads, seqlen_q] float32");
  if (auto err = FillCuSeqlens(p, cu_q, cu_k); err.failure()) return err;
  if (auto err = FillOptions(p, scale, softcap, window_left, window_right, false, q, q); err.failure())
    return err;
  p.varlen_outside = may_have_outside;
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  if (tile_counter->element_count() < 1) return Invalid("tile_counter workspace must hold one int32");
  p.sm90_tile_counter = tile_counter->typed_data();
  if (lse->element_count() == 0) return ffi::Error::Success();
  Poison(p.o, o->size_bytes(), stream);
  Poison(p.lse, lse->size_bytes(), stream);
#ifdef JAX_FLASH_HAS_SM90
  if (sm90::fwd_varlen_supported(p)) return LaunchError(sm90::run_fwd_varlen(p, stream), "sm90 varlen forward");
#endif
  return Invalid("the sm90 varlen forward cannot serve this call (needs an sm_90 GPU, a build with sm90, "
                 "bf16/fp16, head_dim a multiple of 8 up to 256 or a pair " + PairList(Sm90FwdHeadDimPairs{}) +
                 ", 16-byte aligned rows)");
}

// The variable-length backward (sm90 only; Python routes here only where
// the sm90 varlen backward serves the call): the packed tensors and
// cu_seqlens as FwdVarlenImpl's, o / dout / lse / delta of the varlen
// forward's layout; dq_accum as BwdImpl's.
ffi::Error BwdVarlenImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                         ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::S32> cu_q, ffi::Buffer<ffi::S32> cu_k,
                         ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                         ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> dq_accum,
                         float scale, float softcap, int32_t window_left, int32_t window_right) {
  VarlenBwdParams p{};
  if (auto err = CheckQkv(q, k, v, &p.dtype); err.failure()) return err;
  FillShapes(p, q, k, v);
  if (!IsOutputShape(q, v, o) || !IsOutputShape(q, v, dout))
    return Invalid("o and dout must have q's shape with v's head_dim, and q's dtype");
  if (!SameShape(q, *dq) || !SameShape(k, *dk) || !SameShape(v, *dv))
    return Invalid("dq, dk and dv must have the shapes and dtypes of q, k and v");
  const size_t rows = static_cast<size_t>(p.batch) * p.num_heads * p.seqlen_q;
  if (lse.element_count() != rows || delta.element_count() != rows)
    return Invalid("lse and delta must be [batch, heads, seqlen_q] float32");
  if (auto err = FillCuSeqlens(p, cu_q, cu_k); err.failure()) return err;
  if (auto err = FillOptions(p, scale, softcap, window_left, window_right, false, q, q); err.failure())
    return err;
  p.seqlen_q_rounded = rounded_seqlen(p.seqlen_q);
  p.seqlen_k_rounded = rounded_seqlen(p.seqlen_k);
  p.head_dim_rounded = rounded_head_dim(p.head_dim, p.head_dim_v);
  const size_t dq_need = static_cast<size_t>(p.batch) * p.num_heads * p.seqlen_q_rounded * p.head_dim_rounded;
  if (dq_accum->element_count() < dq_need)
    return Invalid("dq_accum workspace too small: " + std::to_string(dq_accum->element_count()) + " < " +
                   std::to_string(dq_need));
  p.o = const_cast<void*>(o.untyped_data());
  p.lse = const_cast<float*>(lse.typed_data());
  p.dout = dout.untyped_data();
  p.delta = delta.typed_data();
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.dq_accum = dq_accum->typed_data();
  if (dq->element_count() == 0 && dk->element_count() == 0 && dv->element_count() == 0)
    return ffi::Error::Success();
  Poison(p.dq, dq->size_bytes(), stream);
  Poison(p.dk, dk->size_bytes(), stream);
  Poison(p.dv, dv->size_bytes(), stream);
#ifdef JAX_FLASH_HAS_SM90
  if (sm90::bwd_varlen_supported(p)) return LaunchError(sm90::run_bwd_varlen(p, stream), "sm90 varlen backward");
#endif
  return Invalid("the sm90 varlen backward cannot serve this call (needs an sm_90 GPU, a build with sm90, "
                 "bf16/fp16, head_dim a multiple of 8 up to 256 equal to v's, no dropout, not deterministic, "
                 "16-byte aligned rows)");
}

// The tile-span pre-pass (cuda/packing/tile_spans.h): segment ids (and
// diagonal shifts) in, the packing buffer out.
ffi::Error PackingImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> q_seg,
                       ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> q_shift,
                       ffi::Buffer<ffi::S32> kv_shift, ffi::Result<ffi::Buffer<ffi::S32>> out,
                       int32_t window_left, int32_t window_right, bool has_shifts) {
  const auto qd = q_seg.dimensions(), kd = kv_seg.dimensions();
  if (qd.size() != 2 || kd.size() != 2 || qd[0] != kd[0]) {
    return Invalid("segment ids must be [batch, seqlen_q] and [batch, seqlen_k]");
  }
  packing::TileSpanArgs a{};
  a.batch = static_cast<int>(qd[0]);
  a.seqlen_q = static_cast<int>(qd[1]);
  a.seqlen_k = static_cast<int>(kd[1]);
  a.q_seg = q_seg.typed_data();
  a.kv_seg = kv_seg.typed_data();
  if (has_shifts) {
    if (q_shift.element_count() != q_seg.element_count() ||
        kv_shift.element_count() != kv_seg.element_count()) {
      return Invalid("shifts must have the segment ids' shapes");
    }
    a.q_shift = q_shift.typed_data();
    a.kv_shift = kv_shift.typed_data();
  }
  a.window_left = window_left;
  a.window_right = window_right;
  const PackingLayout l = packing_layout(a.batch, a.seqlen_q, a.seqlen_k, has_shifts);
  if (out->element_count() != static_cast<size_t>(l.total)) {
    return Invalid("packing output must be int32 [" + std::to_string(l.total) + "]");
  }
  a.out = out->typed_data();
  if (l.total == 0) return ffi::Error::Success();
  return LaunchError(packing::tile_spans(a, stream), "tile-span pre-pass");
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashFwd, jax_flash::FwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()  // q
        .Arg<ffi::AnyBuffer>()  // k
        .Arg<ffi::AnyBuffer>()  // v
        .Arg<ffi::AnyBuffer>()  // q_segment (1-element dummy when absent)
        .Arg<ffi::AnyBuffer>()  // kv_segment
        .Arg<ffi::AnyBuffer>()  // packing: tile spans (+ shifts), FillPacking
        .Arg<ffi::Buffer<ffi::U32>>()  // dropout key words [6] (FillDropout)
        .Arg<ffi::Buffer<ffi::F32>>()  // sinks [batch, heads] (1-element dummy without has_sinks)
        .Ret<ffi::AnyBuffer>()  // o
        .Ret<ffi::Buffer<ffi::F32>>()  // lse
        .Ret<ffi::Buffer<ffi::S32>>()  // tile_counter workspace (sm90 dynamic scheduler)
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right")
        .Attr<bool>("has_segment_ids")
        .Attr<bool>("has_shifts")
        .Attr<int32_t>("dropout_threshold")
        .Attr<bool>("dropout_broadcast")
        .Attr<bool>("has_sinks")
        .Attr<int32_t>("kernel_family"),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashBwd, jax_flash::BwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()  // q
        .Arg<ffi::AnyBuffer>()  // k
        .Arg<ffi::AnyBuffer>()  // v
        .Arg<ffi::AnyBuffer>()  // o
        .Arg<ffi::Buffer<ffi::F32>>()  // lse
        .Arg<ffi::AnyBuffer>()  // dout
        .Arg<ffi::Buffer<ffi::F32>>()  // delta
        .Arg<ffi::AnyBuffer>()  // q_segment
        .Arg<ffi::AnyBuffer>()  // kv_segment
        .Arg<ffi::AnyBuffer>()  // packing
        .Arg<ffi::Buffer<ffi::U32>>()  // dropout key words [6]
        .Ret<ffi::AnyBuffer>()  // dq
        .Ret<ffi::AnyBuffer>()  // dk
        .Ret<ffi::AnyBuffer>()  // dv
        .Ret<ffi::Buffer<ffi::F32>>()  // dq_accum workspace
        .Ret<ffi::Buffer<ffi::F32>>()  // dk_accum workspace (GQA)
        .Ret<ffi::Buffer<ffi::F32>>()  // dv_accum workspace (GQA)
        .Ret<ffi::Buffer<ffi::S32>>()  // dq_semaphore workspace (sm90 deterministic)
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right")
        .Attr<bool>("has_segment_ids")
        .Attr<bool>("has_shifts")
        .Attr<int32_t>("dropout_threshold")
        .Attr<bool>("dropout_broadcast")
        .Attr<bool>("deterministic")
        .Attr<int32_t>("kernel_family"),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashFwdVarlen, jax_flash::FwdVarlenImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()  // q [batch, total_q, heads, head_dim]
        .Arg<ffi::AnyBuffer>()  // k
        .Arg<ffi::AnyBuffer>()  // v
        .Arg<ffi::Buffer<ffi::S32>>()  // cu_seqlens_q [batch, num_seqs + 1]
        .Arg<ffi::Buffer<ffi::S32>>()  // cu_seqlens_k [batch, num_seqs + 1]
        .Arg<ffi::Buffer<ffi::F32>>()  // sinks [batch, heads] (1-element dummy without has_sinks)
        .Ret<ffi::AnyBuffer>()  // o
        .Ret<ffi::Buffer<ffi::F32>>()  // lse [batch, heads, total_q]
        .Ret<ffi::Buffer<ffi::S32>>()  // tile_counter workspace (one int32)
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right")
        .Attr<bool>("has_sinks")
        .Attr<bool>("may_have_outside"),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashBwdVarlen, jax_flash::BwdVarlenImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()  // q [batch, total_q, heads, head_dim]
        .Arg<ffi::AnyBuffer>()  // k
        .Arg<ffi::AnyBuffer>()  // v
        .Arg<ffi::AnyBuffer>()  // o
        .Arg<ffi::Buffer<ffi::F32>>()  // lse [batch, heads, total_q]
        .Arg<ffi::AnyBuffer>()  // dout
        .Arg<ffi::Buffer<ffi::F32>>()  // delta [batch, heads, total_q]
        .Arg<ffi::Buffer<ffi::S32>>()  // cu_seqlens_q [batch, num_seqs + 1]
        .Arg<ffi::Buffer<ffi::S32>>()  // cu_seqlens_k [batch, num_seqs + 1]
        .Ret<ffi::AnyBuffer>()  // dq
        .Ret<ffi::AnyBuffer>()  // dk
        .Ret<ffi::AnyBuffer>()  // dv
        .Ret<ffi::Buffer<ffi::F32>>()  // dq_accum workspace
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right"),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashPacking, jax_flash::PackingImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::Buffer<ffi::S32>>()  // q_segment [batch, seqlen_q]
        .Arg<ffi::Buffer<ffi::S32>>()  // kv_segment [batch, seqlen_k]
        .Arg<ffi::Buffer<ffi::S32>>()  // q_shift (1-element dummy without shifts)
        .Arg<ffi::Buffer<ffi::S32>>()  // kv_shift
        .Ret<ffi::Buffer<ffi::S32>>()  // packing (jax_flash/packing_layout.h)
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right")
        .Attr<bool>("has_shifts"),
    {xla::ffi::Traits::kCmdBufferCompatible});
