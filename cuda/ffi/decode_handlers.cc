// XLA FFI handler of the decoding kernels (cuda/decode): new queries against
// a paged KV cache (a contiguous cache is passed as one page per sequence),
// 16-bit or e4m3 with per-key descales, with optional learnable sinks.
#include <cuda_runtime.h>

#include <string>

#include "decode/decode.h"
#include "handler_util.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace {

using decode::DecodeParams;

ffi::Error DecodeImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                      ffi::AnyBuffer v_cache, ffi::Buffer<ffi::F32> k_descale,
                      ffi::Buffer<ffi::F32> v_descale, ffi::Buffer<ffi::S32> page_table,
                      ffi::Buffer<ffi::S32> seqlens, ffi::Buffer<ffi::F32> sinks,
                      ffi::Result<ffi::AnyBuffer> o,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse,
                      ffi::Result<ffi::Buffer<ffi::F32>> o_partial,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse_partial, float scale, float softcap,
                      int32_t window_left, int32_t window_right, int32_t num_splits,
                      bool has_sinks) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), td = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 4) {
    return Invalid("decode: q must be [batch, seqlen_q, heads, head_dim] and the caches "
                   "[num_pages, page_size, heads_k, head_dim]; got " + ShapeStr(q) + ", " +
                   ShapeStr(k_cache));
  }
  const bool fp8 = k_cache.element_type() == ffi::DataType::F8E4M3FN;
  if (!SameShape(k_cache, v_cache) || (!fp8 && k_cache.element_type() != q.element_type()) ||
      o->element_type() != q.element_type() || o->element_count() != q.element_count()) {
    return Invalid("decode: k_cache, v_cache must match (shape, dtype) and have q's dtype or "
                   "float8_e4m3fn; o has q's dtype");
  }
  if (td.size() != 2 || td[0] != qd[0] || seqlens.element_count() != static_cast<size_t>(qd[0])) {
    return Invalid("decode: page_table must be [batch, max_pages] and seqlens [batch]");
  }
  if (!std::isfinite(scale) || !(scale > 0.f)) return Invalid("decode: scale must be > 0");
  if (softcap < 0.f) return Invalid("decode: softcap must be >= 0 (0 = off)");
  if (window_left < -1 || window_right < -1) return Invalid("decode: window sides must be >= -1");

  DecodeParams p{};
  p.batch = static_cast<int>(qd[0]);
  p.seqlen_q = static_cast<int>(qd[1]);
  p.num_heads = static_cast<int>(qd[2]);
  p.head_dim = static_cast<int>(qd[3]);
  p.num_pages = static_cast<int>(kd[0]);
  p.page_size = static_cast<int>(kd[1]);
  p.num_heads_k = static_cast<int>(kd[2]);
  p.max_pages = static_cast<int>(td[1]);
  if (kd[3] != qd[3]) return Invalid("decode: q and the caches must share head_dim");
  const int64_t D = p.head_dim;
  p.q_head_stride = p.o_head_stride = D;
  p.q_row_stride = p.o_row_stride = D * p.num_heads;
  p.q_batch_stride = p.o_batch_stride = D * p.num_heads * p.seqlen_q;
  p.kv_head_stride = D;
  p.kv_row_stride = D * p.num_heads_k;
  p.kv_page_stride = p.kv_row_stride * p.page_size;
  p.q = q.untyped_data();
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  p.k = k_cache.untyped_data();
  p.v = v_cache.untyped_data();
  p.page_table = page_table.typed_data();
  p.seqlens = seqlens.typed_data();
  p.window_left = window_left;
  p.window_right = window_right;
  // An FP8 cache: Q is scaled in the kernel (decode_fp8.cuh), the scores not.
  p.sm = make_softmax_scale(fp8 ? 1.f : scale, softcap);
  p.kv_fp8 = fp8;
  p.q_scale = scale;
  if (fp8) {
    const size_t want = static_cast<size_t>(p.num_pages) * p.num_heads_k * p.page_size;
    if (k_descale.element_count() != want || v_descale.element_count() != want) {
      return Invalid("decode: an FP8 cache needs k_descale, v_descale [num_pages, heads_k, "
                     "page_size] float32");
    }
    p.k_descale = k_descale.typed_data();
    p.v_descale = v_descale.typed_data();
  }
  if (has_sinks) {  // one logit per (batch, head), folded in once per row (decode_params.h)
    if (sinks.element_count() != static_cast<size_t>(p.batch) * p.num_heads) {
      return Invalid("decode: sinks must be float32 [batch, heads] = [" + std::to_string(p.batch) +
                     ", " + std::to_string(p.num_heads) + "]; got " +
                     std::to_string(sinks.element_count()) + " elements");
    }
    p.sinks = sinks.typed_data();
  }
  p.num_splits = num_splits;
  switch (q.element_type()) {
    case ffi::DataType::BF16: p.dtype = DType::kBFloat16; break;
    case ffi::DataType::F16: p.dtype = DType::kFloat16; break;
    default: return Invalid("decode: q must be bfloat16 or float16");
  }
  const size_t rows = static_cast<size_t>(p.batch) * p.num_heads * p.seqlen_q;
  if (lse->element_count() != rows) return Invalid("decode: lse must be [batch, heads, seqlen_q]");
  if (num_splits > 1) {
    if (o_partial->element_count() < num_splits * rows * p.head_dim ||
        lse_partial->element_count() < num_splits * rows) {
      return Invalid("decode: the split partials must hold num_splits * batch * heads * "
                     "seqlen_q rows (jax_flash/_src/decode_cuda.py sizes them)");
    }
    p.o_partial = o_partial->typed_data();
    p.lse_partial = lse_partial->typed_data();
  }
  if (!decode::decode_supported(p)) {
    return Invalid("decode: not supported: q " + ShapeStr(q) + ", cache " + ShapeStr(k_cache) +
                   ", num_splits " + std::to_string(num_splits) +
                   " (bf16/fp16, head_dim a multiple of 8 <= 256, heads % heads_k == 0, "
                   "1 <= num_splits <= 128, 16-byte aligned buffers; an FP8 cache: "
                   "head_dim % 16 == 0, page_size % 4 == 0)");
  }
  if (rows == 0) return ffi::Error::Success();
  Poison(p.o, o->size_bytes(), stream);
  Poison(p.lse, lse->size_bytes(), stream);
  if (num_splits > 1) {
    Poison(p.o_partial, o_partial->size_bytes(), stream);
    Poison(p.lse_partial, lse_partial->size_bytes(), stream);
  }
  return LaunchError(decode::run_decode(p, stream), "decode");
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashDecode, jax_flash::DecodeImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()  // q [batch, seqlen_q, heads, head_dim]
        .Arg<ffi::AnyBuffer>()  // k_cache [num_pages, page_size, heads_k, head_dim]
        .Arg<ffi::AnyBuffer>()  // v_cache
        .Arg<ffi::Buffer<ffi::F32>>()  // k_descale (FP8 cache; else a 1-element dummy)
        .Arg<ffi::Buffer<ffi::F32>>()  // v_descale
        .Arg<ffi::Buffer<ffi::S32>>()  // page_table [batch, max_pages]
        .Arg<ffi::Buffer<ffi::S32>>()  // seqlens [batch]
        .Arg<ffi::Buffer<ffi::F32>>()  // sinks [batch, heads] (1-element dummy without has_sinks)
        .Ret<ffi::AnyBuffer>()  // o
        .Ret<ffi::Buffer<ffi::F32>>()  // lse [batch, heads, seqlen_q]
        .Ret<ffi::Buffer<ffi::F32>>()  // o_partial workspace (num_splits > 1)
        .Ret<ffi::Buffer<ffi::F32>>()  // lse_partial workspace
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right")
        .Attr<int32_t>("num_splits")
        .Attr<bool>("has_sinks"),
    {xla::ffi::Traits::kCmdBufferCompatible});
