"""What this installation was built with: `jax_flash.build_info()`."""

from __future__ import annotations

import json
import pathlib

_RECORD = pathlib.Path(__file__).resolve().parents[2] / "_build.json"


def build_info() -> dict:
  """Whether the CUDA kernels were compiled into this installation, and why not.

  Keys:
    cuda_kernels        True/False as recorded by the build, None when jax_flash
                        is imported from a source tree that was never built
    reason              why they were not built (None when they were)
    cuda_compiler, cuda_architectures, sm90
                        what the build used (None/False without CUDA)
    cuda_extension      "loaded", or why the extension cannot be imported here
    implementations     the backends that can run on jax's default device
                        (`available_implementations()`)
  """
  from jax_flash._src.backends import registry as backends
  from jax_flash._src.backends import ffi

  try:
    record = json.loads(_RECORD.read_text())
  except FileNotFoundError:
    record = dict(cuda_kernels=None, cuda_compiler=None,
                  cuda_architectures=None, sm90=False,
                  reason="no build record: jax_flash is imported from a source "
                  "tree; `pip install .` builds and records it")
  return dict(record,
              cuda_extension=("loaded" if ffi.available() else
                              ffi.unavailable_reason()),
              implementations=backends.runnable())
