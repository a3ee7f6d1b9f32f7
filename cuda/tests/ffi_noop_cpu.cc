// A CPU XLA FFI handler that does nothing, for CPU tests that compile (and
// read the compiled HLO of) graphs holding the CUDA targets' calls: the CPU
// backend refuses to compile a custom call with no handler registered for it.
// Never registered by the library; tests/test_decode_step_hlo.py builds it.
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error Noop(ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary) {
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashNoop, Noop,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs<ffi::Dictionary>());
