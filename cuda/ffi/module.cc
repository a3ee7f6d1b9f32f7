// Python module `jax_flash._jax_flash_cuda`: hands each FFI handler to Python
// as a PyCapsule, which jax.ffi.register_ffi_target accepts directly.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxFlashFwdSm80(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxFlashBwdSm80(XLA_FFI_CallFrame* call_frame);
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
    d["jax_flash_fwd_sm80"] = Capsule(JaxFlashFwdSm80);
    d["jax_flash_bwd_sm80"] = Capsule(JaxFlashBwdSm80);
    return d;
  });
  // Kernel families compiled into this build (dispatch reads it).
  m.def("families", []() {
    nb::list l;
    l.append("sm80");
    return l;
  });
}
