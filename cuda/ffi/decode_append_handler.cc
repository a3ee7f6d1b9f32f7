// XLA FFI handler of the append kernel (cuda/decode/decode_append.h): the new
// tokens' keys and values written into the caches in place and the lengths
// after them, for the decoding kernels that follow, over the lengths before
// them (each result aliases its operand, jax_flash/_src/decode/cuda.py).
#include <cuda_runtime.h>

#include "decode/decode_append.h"
#include "handler_util.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace {

using decode::AppendParams;

ffi::Error AppendImpl(cudaStream_t stream, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                      ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                      ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> seqlens,
                      ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                      ffi::Result<ffi::Buffer<ffi::S32>> seqlens_out, bool identity_rows) {
  const auto kd = k_cache.dimensions(), nd = k_new.dimensions(), td = page_table.dimensions();
  if (kd.size() != 4 || nd.size() != 4 || td.size() != 2) {
    return Invalid("decode append: the caches must be [num_pages, page_size, heads_k, head_dim], "
                   "the new keys [batch, seqlen_new, heads_k, head_dim] and page_table [batch, "
                   "max_pages]; got " + ShapeStr(k_cache) + ", " + ShapeStr(k_new));
  }
  const bool sixteen_bit = k_cache.element_type() == ffi::DataType::BF16 ||
                           k_cache.element_type() == ffi::DataType::F16;
  if (!sixteen_bit || !SameShape(k_cache, v_cache) || !SameShape(k_new, v_new) ||
      k_new.element_type() != k_cache.element_type() || !SameShape(*k_out, k_cache) ||
      !SameShape(*v_out, v_cache)) {
    return Invalid("decode append: 16-bit caches of one shape and dtype, the new keys and values "
                   "of one shape in that dtype, results shaped as the caches");
  }
  if ((!identity_rows && nd[0] != td[0]) || (identity_rows && kd[0] < nd[0]) ||
      nd[2] != kd[2] || nd[3] != kd[3] ||
      seqlens.element_count() != static_cast<size_t>(nd[0]) ||
      seqlens_out->element_count() != static_cast<size_t>(nd[0])) {
    return Invalid("decode append: k_new [batch, seqlen_new, heads_k, head_dim] must match the "
                   "caches' heads and head_dim and page_table's and seqlens' batch; got " +
                   ShapeStr(k_new) + ", cache " + ShapeStr(k_cache));
  }
  // The results alias the caches; were they ever given buffers of their own,
  // the cache is carried over first so that only the new tokens differ.
  const ffi::AnyBuffer* ins[] = {&k_cache, &v_cache};
  ffi::AnyBuffer* outs[] = {&*k_out, &*v_out};
  for (int i = 0; i < 2; ++i) {
    if (outs[i]->untyped_data() == ins[i]->untyped_data()) continue;
    const cudaError_t err = cudaMemcpyAsync(outs[i]->untyped_data(), ins[i]->untyped_data(),
                                            ins[i]->size_bytes(), cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return LaunchError(err, "decode append (cache copy)");
  }
  AppendParams p{};
  p.k = k_out->untyped_data();
  p.v = v_out->untyped_data();
  p.k_new = k_new.untyped_data();
  p.v_new = v_new.untyped_data();
  // identity_rows: row b of a contiguous cache is sequence b (no table read).
  p.page_table = identity_rows ? nullptr : page_table.typed_data();
  p.seqlens = seqlens.typed_data();
  p.seqlens_out = seqlens_out->typed_data();
  p.batch = static_cast<int>(nd[0]);
  p.seqlen_new = static_cast<int>(nd[1]);
  p.num_heads_k = static_cast<int>(nd[2]);
  p.head_dim = static_cast<int>(nd[3]);
  p.num_pages = static_cast<int>(kd[0]);
  p.page_size = static_cast<int>(kd[1]);
  p.max_pages = identity_rows ? 1 : static_cast<int>(td[1]);
  if (!decode::append_supported(p)) {
    return Invalid("decode append: not supported: cache " + ShapeStr(k_cache) + ", new " +
                   ShapeStr(k_new) + " (head_dim a multiple of 8, 16-byte aligned buffers)");
  }
  if (p.seqlens_out != p.seqlens) Poison(p.seqlens_out, seqlens_out->size_bytes(), stream);
  return LaunchError(decode::run_append(p, stream), "decode append");
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashDecodeAppend, jax_flash::AppendImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()  // k_cache [num_pages, page_size, heads_k, head_dim]
        .Arg<ffi::AnyBuffer>()  // v_cache
        .Arg<ffi::AnyBuffer>()  // k_new [batch, seqlen_new, heads_k, head_dim]
        .Arg<ffi::AnyBuffer>()  // v_new
        .Arg<ffi::Buffer<ffi::S32>>()  // page_table [batch, max_pages] (identity_rows: ignored)
        .Arg<ffi::Buffer<ffi::S32>>()  // seqlens [batch], before the new tokens
        .Ret<ffi::AnyBuffer>()  // k_cache, updated (aliases the operand)
        .Ret<ffi::AnyBuffer>()  // v_cache, updated (aliases the operand)
        .Ret<ffi::Buffer<ffi::S32>>()  // seqlens [batch], after the new tokens
        .Attr<bool>("identity_rows"),
    {xla::ffi::Traits::kCmdBufferCompatible});
