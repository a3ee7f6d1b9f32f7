"""The compiled CUDA extension: load it, register its FFI targets, call them.

The extension (`jax_flash._jax_flash_cuda`) is optional: without it (no nvcc at
build time, JAX_FLASH_DISABLE_CUDA=1, or a CPU-only machine) `available()` is
False and dispatch skips the "cuda" backend.

jax.export: a function exported with these kernels needs
`jax.export.export(f, disabled_checks=[DisabledSafetyCheck.custom_call(name)])`
for each target name below, and the importing process must `import jax_flash`
(which registers the targets) before calling `.call`.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

FWD_SM80 = "jax_flash_fwd_sm80"
BWD_SM80 = "jax_flash_bwd_sm80"
TARGETS = (FWD_SM80, BWD_SM80)


@functools.cache
def _load():
  """Import the extension and register its handlers; None if absent."""
  try:
    from jax_flash import _jax_flash_cuda  # type: ignore[attr-defined]
  except ImportError as e:
    return None, f"the CUDA extension is not built ({e})"
  for name, capsule in _jax_flash_cuda.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  return _jax_flash_cuda, None


def available() -> bool:
  return _load()[0] is not None


def unavailable_reason() -> str | None:
  return _load()[1]


def families() -> tuple[str, ...]:
  ext = _load()[0]
  return tuple(ext.families()) if ext is not None else ()


def mask_attrs(spec) -> dict:
  """FFI attributes shared by forward and backward (typed as the handler binds them)."""
  return dict(
      scale=np.float32(spec.scale),
      softcap=np.float32(spec.softcap or 0.0),
      window_left=np.int32(spec.window_left),
      window_right=np.int32(spec.window_right),
      causal=bool(spec.causal),
      has_segment_ids=bool(spec.has_segment_ids),
  )


def call(target: str, result_shapes, *args, **attrs):
  _load()
  return jax.ffi.ffi_call(target, result_shapes)(*args, **attrs)
