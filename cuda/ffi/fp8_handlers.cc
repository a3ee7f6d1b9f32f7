// XLA FFI handlers of the FP8 path (jax_flash/_src/fp8/cuda.py): the
// quantisation pre-pass and the sm90 FP8 forward. Both exist only in builds
// with the sm90 family (JAX_FLASH_HAS_SM90); elsewhere they return an error,
// and Python never calls them (cuda.check refuses first).
#include <cuda_runtime.h>

#include <string>

#include "ffi/handler_util.h"
#include "jax_flash/fp8_scheme.h"
#include "jax_flash/params.h"
#ifdef JAX_FLASH_HAS_SM90
#include "fp8/quantize.h"
#include "sm90/launch.h"
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace {

// Descale blocks of `block` rows over n rows (fp8_scheme.h); 0 blocks of a
// head dim the scheme lacks (block 0: the support checks refuse the call).
size_t Fp8Blocks(int64_t n, int block) {
  return block > 0 ? (static_cast<size_t>(n) + block - 1) / static_cast<size_t>(block) : 0;
}

ffi::Error Check16Bit(const ffi::AnyBuffer& x, const char* name, DType* dtype) {
  if (x.dimensions().size() != 4) return Invalid(std::string(name) + " must be rank 4; got " + ShapeStr(x));
  const auto t = x.element_type();
  if (t != ffi::DataType::BF16 && t != ffi::DataType::F16) {
    return Invalid(std::string(name) + " must be bfloat16 or float16");
  }
  *dtype = t == ffi::DataType::BF16 ? DType::kBFloat16 : DType::kFloat16;
  return ffi::Error::Success();
}

// x8 must be x's shape in float8_e4m3fn.
ffi::Error CheckE4m3Like(const ffi::AnyBuffer& x8, const ffi::AnyBuffer& x, const char* name) {
  auto a = x8.dimensions(), b = x.dimensions();
  bool same = a.size() == b.size() && x8.element_type() == ffi::DataType::F8E4M3FN;
  for (size_t i = 0; same && i < a.size(); ++i) same = a[i] == b[i];
  if (!same) return Invalid(std::string(name) + " must be float8_e4m3fn " + ShapeStr(x) + "; got " + ShapeStr(x8));
  return ffi::Error::Success();
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::Buffer<ffi::F32> signs, ffi::Result<ffi::AnyBuffer> q8,
                        ffi::Result<ffi::Buffer<ffi::F32>> q_descale, ffi::Result<ffi::AnyBuffer> k8,
                        ffi::Result<ffi::Buffer<ffi::F32>> k_descale, ffi::Result<ffi::AnyBuffer> v8,
                        ffi::Result<ffi::Buffer<ffi::F32>> v_descale,
                        ffi::Result<ffi::Buffer<ffi::F32>> v_partial, bool rotate) {
#ifndef JAX_FLASH_HAS_SM90
  return Invalid("the FP8 pre-pass needs a build with the sm90 kernel family");
#else
  DType dq, dk, dv;
  if (auto e = Check16Bit(q, "q", &dq); e.failure()) return e;
  if (auto e = Check16Bit(k, "k", &dk); e.failure()) return e;
  if (auto e = Check16Bit(v, "v", &dv); e.failure()) return e;
  if (dq != dk || dq != dv) return Invalid("q, k, v must share one dtype");
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  for (int i = 0; i < 4; ++i) {
    if (vd[i] != kd[i]) {
      return Invalid("v must be [batch, seq_k, heads_k, head_dim] like k; got k " + ShapeStr(k) + ", v " +
                     ShapeStr(v));
    }
  }
  if (kd[0] != qd[0] || kd[3] != qd[3]) {
    return Invalid("q and k must share batch and head_dim; got q " + ShapeStr(q) + ", k " + ShapeStr(k));
  }
  const int D = static_cast<int>(qd[3]);
  if (signs.element_count() != static_cast<size_t>(D)) return Invalid("signs must be [head_dim] float32");
  if (auto e = CheckE4m3Like(*q8, q, "q8"); e.failure()) return e;
  if (auto e = CheckE4m3Like(*k8, k, "k8"); e.failure()) return e;
  if (auto e = CheckE4m3Like(*v8, v, "v8"); e.failure()) return e;
  fp8::PrepassArgs a{};
  a.q = q.untyped_data();
  a.k = k.untyped_data();
  a.v = v.untyped_data();
  a.dtype = dq;
  a.signs = rotate ? signs.typed_data() : nullptr;
  a.q8 = q8->untyped_data();
  a.q_descale = q_descale->typed_data();
  a.k8 = k8->untyped_data();
  a.k_descale = k_descale->typed_data();
  a.v8 = v8->untyped_data();
  a.v_descale = v_descale->typed_data();
  a.v_partial = v_partial->typed_data();
  a.batch = static_cast<int>(qd[0]);
  a.seqlen_q = static_cast<int>(qd[1]);
  a.heads = static_cast<int>(qd[2]);
  a.seqlen_k = static_cast<int>(kd[1]);
  a.heads_k = static_cast<int>(kd[2]);
  a.head_dim = D;
  const size_t qb = Fp8Blocks(a.seqlen_q, kFp8QBlock), kb = Fp8Blocks(a.seqlen_k, fp8_k_block(D));
  if (q_descale->element_count() != static_cast<size_t>(a.batch) * a.heads * qb ||
      k_descale->element_count() != static_cast<size_t>(a.batch) * a.heads_k * kb ||
      v_descale->element_count() != static_cast<size_t>(a.batch) * a.heads_k * D) {
    return Invalid("descales must be q [batch, heads, ceil(T/64)], k [batch, heads_k, ceil(S/k_block)] "
                   "(k_block: fp8_k_block(head_dim), jax_flash/fp8_scheme.h), v [batch, heads_k, head_dim] "
                   "float32");
  }
  if (v_partial->element_count() < fp8::v_partial_elements(a.batch, a.heads_k, a.seqlen_k, D)) {
    return Invalid("the v_partial workspace must hold batch * heads_k * min(ceil(S / 512), 32) * head_dim "
                   "float32");
  }
  if (!fp8::prepass_supported(a)) {
    return Invalid("the FP8 pre-pass takes head_dim 64, 128 or 256, bf16/fp16, 16-byte aligned buffers");
  }
  Poison(q8->untyped_data(), q8->size_bytes(), stream);
  Poison(k8->untyped_data(), k8->size_bytes(), stream);
  Poison(v8->untyped_data(), v8->size_bytes(), stream);
  Poison(q_descale->typed_data(), q_descale->size_bytes(), stream);
  Poison(k_descale->typed_data(), k_descale->size_bytes(), stream);
  Poison(v_descale->typed_data(), v_descale->size_bytes(), stream);
  Poison(v_partial->typed_data(), v_partial->size_bytes(), stream);
  return LaunchError(fp8::prepass(a, stream), "fp8 pre-pass");
#endif
}

ffi::Error FwdFp8Impl(cudaStream_t stream, ffi::AnyBuffer q8, ffi::AnyBuffer k8, ffi::AnyBuffer v8,
                      ffi::Buffer<ffi::F32> q_descale, ffi::Buffer<ffi::F32> k_descale,
                      ffi::Buffer<ffi::F32> v_descale, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg,
                      ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                      ffi::Result<ffi::Buffer<ffi::S32>> tile_counter, float scale, float softcap,
                      int32_t window_left, int32_t window_right, bool has_segment_ids) {
#ifndef JAX_FLASH_HAS_SM90
  return Invalid("the FP8 forward needs a build with the sm90 kernel family");
#else
  const auto e4m3 = ffi::DataType::F8E4M3FN;
  if (q8.element_type() != e4m3 || k8.element_type() != e4m3 || v8.element_type() != e4m3) {
    return Invalid("q8, k8, v8 must be float8_e4m3fn");
  }
  if (q8.dimensions().size() != 4 || k8.dimensions().size() != 4 || v8.dimensions().size() != 4 ||
      o->dimensions().size() != 4) {
    return Invalid("q8 [batch, seq_q, heads, head_dim], k8 and v8 [batch, seq_k, heads_k, head_dim] and o "
                   "must be rank 4");
  }
  auto qd = q8.dimensions(), kd = k8.dimensions(), vd = v8.dimensions();
  if (kd[0] != qd[0] || kd[3] != qd[3]) {
    return Invalid("shapes disagree: q8 " + ShapeStr(q8) + ", k8 " + ShapeStr(k8));
  }
  for (int i = 0; i < 4; ++i) {
    if (vd[i] != kd[i]) {
      return Invalid("v8 must be [batch, seq_k, heads_k, head_dim] like k8 " + ShapeStr(k8) + "; got " +
                     ShapeStr(v8));
    }
  }
  Fp8FwdParams p{};
  FillShapes(p, q8, k8, v8);  // v8: k8's shape and strides
  p.dtype = DType::kFloat8E4M3;
  if (p.num_heads_k < 1 ? p.num_heads != 0 : p.num_heads % p.num_heads_k != 0) {
    return Invalid("q heads must be a multiple of kv heads");
  }
  const auto ot = o->element_type();
  if (ot != ffi::DataType::BF16 && ot != ffi::DataType::F16) return Invalid("o must be bfloat16 or float16");
  p.out_dtype = ot == ffi::DataType::BF16 ? DType::kBFloat16 : DType::kFloat16;
  auto od = o->dimensions();
  for (int i = 0; i < 4; ++i) {
    if (od[i] != qd[i]) return Invalid("o must have q8's shape");
  }
  const int64_t D = p.head_dim;
  const size_t qb = Fp8Blocks(p.seqlen_q, kFp8QBlock), kb = Fp8Blocks(p.seqlen_k, fp8_k_block(p.head_dim));
  if (q_descale.element_count() != static_cast<size_t>(p.batch) * p.num_heads * qb ||
      k_descale.element_count() != static_cast<size_t>(p.batch) * p.num_heads_k * kb ||
      v_descale.element_count() != static_cast<size_t>(p.batch) * p.num_heads_k * D) {
    return Invalid("descales must be q [batch, heads, ceil(T/64)], k [batch, heads_k, ceil(S/k_block)] "
                   "(k_block: fp8_k_block(head_dim), jax_flash/fp8_scheme.h), v [batch, heads_k, head_dim] "
                   "float32");
  }
  p.q_descale = q_descale.typed_data();
  p.k_descale = k_descale.typed_data();
  p.v_descale = v_descale.typed_data();
  if (lse->element_count() != static_cast<size_t>(p.batch) * p.num_heads * p.seqlen_q) {
    return Invalid("lse must be [batch, heads, seqlen_q] float32");
  }
  if (auto err = FillOptions(p, scale, softcap, window_left, window_right, has_segment_ids, q_seg, kv_seg);
      err.failure()) {
    return err;
  }
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  if (tile_counter->element_count() < 1) return Invalid("tile_counter workspace must hold one int32");
  p.sm90_tile_counter = tile_counter->typed_data();
  if (lse->element_count() == 0) return ffi::Error::Success();
  if (!sm90::fwd_fp8_supported(p)) {
    return Invalid("the sm90 FP8 forward cannot serve this call (needs an sm_90 GPU, head_dim 128 or 256, "
                   "16-byte aligned rows)");
  }
  Poison(p.o, o->size_bytes(), stream);
  Poison(p.lse, lse->size_bytes(), stream);
  return LaunchError(sm90::run_fwd_fp8(p, stream), "sm90 fp8 forward");
#endif
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashFp8Quantize, jax_flash::QuantizeImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()            // q [B, T, H, D] bf16/fp16
        .Arg<ffi::AnyBuffer>()            // k [B, S, H_kv, D]
        .Arg<ffi::AnyBuffer>()            // v [B, S, H_kv, D]
        .Arg<ffi::Buffer<ffi::F32>>()     // rotation signs [D]
        .Ret<ffi::AnyBuffer>()            // q8 [B, T, H, D] e4m3
        .Ret<ffi::Buffer<ffi::F32>>()     // q_descale [B, H, ceil(T/64)]
        .Ret<ffi::AnyBuffer>()            // k8 [B, S, H_kv, D] e4m3
        .Ret<ffi::Buffer<ffi::F32>>()     // k_descale [B, H_kv, ceil(S/fp8_k_block(D))]
        .Ret<ffi::AnyBuffer>()            // v8 [B, S, H_kv, D]
        .Ret<ffi::Buffer<ffi::F32>>()     // v_descale [B, H_kv, D]
        .Ret<ffi::Buffer<ffi::F32>>()     // v_partial workspace (fp8/quantize.h)
        .Attr<bool>("rotate"),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashFwdFp8, jax_flash::FwdFp8Impl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()            // q8 [B, T, H, D] e4m3
        .Arg<ffi::AnyBuffer>()            // k8 [B, S, H_kv, D] e4m3
        .Arg<ffi::AnyBuffer>()            // v8 [B, S, H_kv, D] e4m3
        .Arg<ffi::Buffer<ffi::F32>>()     // q_descale
        .Arg<ffi::Buffer<ffi::F32>>()     // k_descale
        .Arg<ffi::Buffer<ffi::F32>>()     // v_descale
        .Arg<ffi::AnyBuffer>()            // q_segment (1-element dummy when absent)
        .Arg<ffi::AnyBuffer>()            // kv_segment
        .Ret<ffi::AnyBuffer>()            // o [B, T, H, D] bf16/fp16
        .Ret<ffi::Buffer<ffi::F32>>()     // lse [B, H, T]
        .Ret<ffi::Buffer<ffi::S32>>()     // tile_counter workspace
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right")
        .Attr<bool>("has_segment_ids"),
    {xla::ffi::Traits::kCmdBufferCompatible});
