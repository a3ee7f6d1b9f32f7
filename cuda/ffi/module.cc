// Python module `jax_flash._jax_flash_cuda`: hands each FFI handler to Python
// as a PyCapsule, which jax.ffi.register_ffi_target accepts directly.
#include <nanobind/nanobind.h>

#include "decode/decode_plan.h"
#include "jax_flash/device_attribute.h"
#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxFlashFwd(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxFlashBwd(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxFlashFp8Quantize(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxFlashFwdFp8(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxFlashPacking(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxFlashFwdVarlen(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxFlashBwdVarlen(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxFlashDecode(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxFlashDecodeAppend(XLA_FFI_CallFrame* call_frame);
}

namespace nb = nanobind;

namespace {
template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_jax_flash_cuda, m) {
  m.doc() = "jax_flash CUDA kernels as XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_flash_fwd"] = Capsule(JaxFlashFwd);
    d["jax_flash_bwd"] = Capsule(JaxFlashBwd);
    d["jax_flash_fp8_quantize"] = Capsule(JaxFlashFp8Quantize);
    d["jax_flash_fwd_fp8"] = Capsule(JaxFlashFwdFp8);
    d["jax_flash_packing"] = Capsule(JaxFlashPacking);
    d["jax_flash_fwd_varlen"] = Capsule(JaxFlashFwdVarlen);
    d["jax_flash_bwd_varlen"] = Capsule(JaxFlashBwdVarlen);
    d["jax_flash_decode"] = Capsule(JaxFlashDecode);
    d["jax_flash_decode_append"] = Capsule(JaxFlashDecodeAppend);
    return d;
  });
  // The split-KV policy of the decoding kernels (cuda/decode/decode_plan.h)
  // on the current device: Python sizes the partials' workspace with it.
  m.def("decode_num_splits", [](int64_t batch_heads_k, int seqlen_q, int group, int max_seqlen,
                                 int head_dim, bool fp8) {
    using namespace jax_flash;
    const int sms = device_attribute<cudaDevAttrMultiProcessorCount>(132);
    const int smem = device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(228 * 1024);
    return decode::decode_num_splits(batch_heads_k, seqlen_q, group, max_seqlen, head_dim, sms, smem,
                                     fp8);
  });
  // Kernel families compiled into this build (dispatch reads it).
  m.def("families", []() {
    nb::list l;
    l.append("sm80");
#ifdef JAX_FLASH_HAS_SM90
    l.append("sm90");
#endif
    return l;
  });
}
