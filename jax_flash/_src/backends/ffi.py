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
import os

import jax
import numpy as np

# One forward and one backward target; the handler picks the kernel family
# (sm90 FA3-style forward on Hopper when it serves the call, else sm80).
FWD = "jax_flash_fwd"
BWD = "jax_flash_bwd"
# The FP8 path (jax_flash/_src/fp8/cuda.py): its pre-pass and forward.
FP8_QUANTIZE = "jax_flash_fp8_quantize"
FP8_FWD = "jax_flash_fwd_fp8"
# The tile-span pre-pass of segment ids (backends/cuda.py).
PACKING = "jax_flash_packing"
# The sm90 forward of variable-length sequences (backends/cuda.py).
FWD_VARLEN = "jax_flash_fwd_varlen"
# ... and its backward (backends/cuda.py).
BWD_VARLEN = "jax_flash_bwd_varlen"
# The decoding kernels (decode/cuda.py), and the append of new tokens to a
# cache before them.
DECODE = "jax_flash_decode"
DECODE_APPEND = "jax_flash_decode_append"
TARGETS = (FWD, BWD, FP8_QUANTIZE, FP8_FWD, PACKING, DECODE, DECODE_APPEND,
           FWD_VARLEN, BWD_VARLEN)

_FAMILIES = {"": 0, "auto": 0, "sm80": 80, "sm90": 90}


def kernel_family() -> np.int32:
  """The kernel family for the handlers' `kernel_family` attribute (forward
  and backward).

  JAX_FLASH_CUDA_FAMILY=auto (default) | sm80 | sm90, read at trace time: lets
  tests and benchmarks run the portable sm80 kernels on a Hopper GPU, or
  insist on sm90 (the call then fails rather than fall back).
  """
  name = os.environ.get("JAX_FLASH_CUDA_FAMILY", "").strip().lower()
  if name not in _FAMILIES:
    raise ValueError(f"JAX_FLASH_CUDA_FAMILY must be one of auto, sm80, sm90; "
                     f"got {name!r}")
  return np.int32(_FAMILIES[name])


def _knob(name: str, default: str) -> bool:
  value = os.environ.get(name, default).strip() or default
  if value not in ("0", "1"):
    raise ValueError(f"{name} must be 0 or 1; got {value!r}")
  return value == "1"


def varlen_kernel() -> bool:
  """Whether varlen_attention takes the per-sequence sm90 forward
  (jax_flash_fwd_varlen) instead of the packed segment-id kernels.

  On by default; JAX_FLASH_VARLEN_KERNEL=0 (read at trace time) keeps the
  packed path, so one process can time both.
  """
  return _knob("JAX_FLASH_VARLEN_KERNEL", "1")


def varlen_bwd_kernel() -> bool:
  """Whether the per-sequence sm90 backward (jax_flash_bwd_varlen) takes
  the calls the per-sequence forward served: JAX_FLASH_VARLEN_BWD_KERNEL=1
  (read at trace time). Off by default: the packed backward is faster on
  the H200 today (benchmarks/NOTES.md)."""
  return _knob("JAX_FLASH_VARLEN_BWD_KERNEL", "0")


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


def mask_attrs(spec, *, shifts: bool = True) -> dict:
  """FFI attributes shared by forward and backward (typed as the handler
  binds them); shifts=False for handlers without diagonal shifts (FP8)."""
  if not spec.bottom_right:
    # The handlers assume query row i sits at key i + S - T; another
    # alignment must go through bottom_right.py first, never silently here.
    raise ValueError(f"the CUDA kernels take only the bottom-right alignment "
                     f"(q_offset = kv_len - q_len = "
                     f"{spec.kv_len - spec.q_len}); got q_offset="
                     f"{spec.q_offset}")
  if spec.has_shifts and not shifts:
    raise ValueError("this kernel takes no diagonal shifts (varlen)")
  extra = dict(has_shifts=bool(spec.has_shifts)) if shifts else {}
  return dict(
      **extra,
      scale=np.float32(spec.scale),
      softcap=np.float32(spec.softcap or 0.0),
      window_left=np.int32(spec.window_left),
      window_right=np.int32(spec.window_right),
      has_segment_ids=bool(spec.has_segment_ids),
  )


def call(target: str, result_shapes, *args, **attrs):
  _load()
  return jax.ffi.ffi_call(target, result_shapes)(*args, **attrs)
