"""Backend registry: each backend says whether it can serve a request.

Order of preference for `implementation=None`: on GPU cuda -> pallas -> xla;
elsewhere xla (Pallas on CPU is interpret mode: right, but slow). A backend
that cannot serve a request raises `Unsupported` (a NotImplementedError) from
`check`, with a message naming the argument and what is supported; automatic
dispatch skips it, an explicit choice shows the message to the user.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax

from jax_flash._src.spec import AttentionSpec


class Unsupported(NotImplementedError):
  """The backend cannot serve this request (the message says why)."""


Unsupported.__module__ = "jax_flash"  # its public name, in reprs and tracebacks


class Backend(Protocol):
  name: str

  def check(self, spec: AttentionSpec, platform: str) -> None:
    """Raise Unsupported if this request cannot run on `platform`."""

  def forward(self, spec: AttentionSpec, q, k, v, q_seg, kv_seg):
    """Return (o [B,T,H,D] q.dtype, lse [B,H,T] float32)."""

  def backward(self, spec: AttentionSpec, q, k, v, o, lse, do, delta, q_seg,
               kv_seg):
    """Return (dq, dk, dv). delta = rowsum(do * o) - dlse, [B,H,T] float32."""


_REGISTRY: dict[str, Callable[[], Backend]] = {}
# GPU: the CUDA kernels when the extension is built and the request is
# supported (validated on the H200: tests/test_cuda.py, tools/gpu/gpu_check.sh),
# else the Pallas kernel, else blockwise XLA.
GPU_ORDER = ("cuda", "pallas", "xla")
PREFERENCE = {"gpu": GPU_ORDER, "cuda": GPU_ORDER}
DEFAULT_PREFERENCE = ("xla",)
ALL_KNOWN = ("cuda", "pallas", "xla")


def register(name: str, factory: Callable[[], Backend]) -> None:
  _REGISTRY[name] = factory


def names() -> tuple[str, ...]:
  return tuple(n for n in ALL_KNOWN if n in _REGISTRY) + tuple(
      n for n in _REGISTRY if n not in ALL_KNOWN)


def runnable(platform: str | None = None) -> tuple[str, ...]:
  """The registered backends that can run on `platform` (default: jax's
  default device), in preference order: those whose `check` accepts a plain
  request (no mask options, head_dim 64) in at least one of the usual dtypes.
  """
  platform = default_platform() if platform is None else platform
  probes = [AttentionSpec(scale=0.125, batch=1, q_len=128, kv_len=128,
                          num_heads=1, num_kv_heads=1, head_dim=64, dtype=d)
            for d in ("bfloat16", "float16", "float32")]

  def serves(name):
    for spec in probes:
      try:
        get(name).check(spec, platform)
        return True
      except Unsupported:
        pass
    return False

  return tuple(n for n in names() if serves(n))


def get(name: str) -> Backend:
  if name not in _REGISTRY:
    raise ValueError(
        f"implementation={name!r} is not known; supported: "
        f"{', '.join(repr(n) for n in names())} or None (best available)")
  return _REGISTRY[name]()


def default_platform() -> str:
  return jax.default_backend()  # 'cpu', 'gpu' (cuda/rocm), 'tpu'


def choose(spec: AttentionSpec, implementation: str | None,
           platform: str) -> Backend:
  """The backend that will run `spec`; raises with the reasons otherwise."""
  if implementation is not None:
    backend = get(implementation)
    backend.check(spec, platform)  # let the user see why it cannot run
    return backend
  reasons = []
  for name in PREFERENCE.get(platform, DEFAULT_PREFERENCE):
    if name not in _REGISTRY:
      continue
    backend = get(name)
    try:
      backend.check(spec, platform)
      return backend
    except Unsupported as e:
      reasons.append(f"{name}: {e}")
  raise Unsupported("no backend can serve this request:\n  " +
                    "\n  ".join(reasons))
