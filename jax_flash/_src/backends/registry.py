"""Backend registry: each backend says whether it can serve a request.

Order of preference for `implementation=None`: on GPU cuda -> pallas -> xla;
elsewhere xla (Pallas on CPU is interpret mode: right, but slow). Requests
with dropout pick the CUDA kernels on a GPU where they are built, else xla
(pallas serves them when asked for); FP8 requests the CUDA FP8 kernel where
its check passes, else xla's simulated kernel. A backend
that cannot serve a request raises `Unsupported` (a NotImplementedError) from
`check`, with a message naming the argument and what is supported; automatic
dispatch skips it, an explicit choice shows the message to the user.

Platforms and jax.export. The backend is chosen at trace time, but a traced
function may be lowered for another platform than the host's
(`jax.export.export(f, platforms=["cuda"])` on a CPU machine). So on a host
without a GPU, `implementation=None` stages one branch per platform with
`jax.lax.platform_dependent`: the CUDA kernels for "cuda" when they are built
and serve the request, the host's choice for every other platform (lowering
keeps only the branch of the platform it lowers for). Pallas is not offered
for a GPU from a CPU host: it decides between Triton and interpret mode from
the host, so a CUDA lowering from a CPU host without the extension uses the
portable xla backend. On a GPU host the choice is the GPU's, as before.

Symbolic (shape-polymorphic) dimensions: `SYMBOLIC_DIMS` says which dims of
the spec each backend accepts symbolically; others refuse with `Unsupported`
naming the dimension.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax

from jax_flash._src.core.spec import AttentionSpec


class Unsupported(NotImplementedError):
  """The backend cannot serve this request (the message says why)."""


Unsupported.__module__ = "jax_flash"  # its public name, in reprs and tracebacks


class Backend(Protocol):
  """One attention implementation. Arrays are batch-major (core/spec.py);
  q_seg/kv_seg are given with spec.has_segment_ids, shifts = (q_shift,
  kv_shift) with spec.has_shifts, dropout_key = the key words (core/dropout.py
  key_words: k0, k1 and the call's origin) with spec.has_dropout, sinks [B, H]
  with spec.has_sinks (None otherwise)."""

  name: str

  def check(self, spec: AttentionSpec, platform: str) -> None:
    """Raise Unsupported if this request cannot run on `platform`."""

  def forward(self, spec: AttentionSpec, q, k, v, q_seg=None, kv_seg=None, *,
              shifts=None, dropout_key=None, sinks=None):
    """Return (o [B,T,H,D_v] q.dtype, lse [B,H,T] float32); sinks [B, H]
    with spec.has_sinks (the lse then includes them)."""

  def backward(self, spec: AttentionSpec, q, k, v, o, lse, do, delta,
               q_seg=None, kv_seg=None, *, shifts=None, dropout_key=None):
    """Return (dq, dk, dv). delta = rowsum(do * o) - dlse, [B,H,T] float32."""


_REGISTRY: dict[str, Callable[[], Backend]] = {}
# GPU: the CUDA kernels when the extension is built and the request is
# supported (validated on the H200: tests/test_cuda.py, tools/gpu/gpu_check.sh),
# else the Pallas kernel, else blockwise XLA.
GPU_ORDER = ("cuda", "pallas", "xla")
PREFERENCE = {"gpu": GPU_ORDER, "cuda": GPU_ORDER}
DEFAULT_PREFERENCE = ("xla",)
DROPOUT_PREFERENCE = ("cuda", "xla")
FP8_PREFERENCE = ("cuda", "xla")  # (the FP8 kernel's check knows platforms)
ALL_KNOWN = ("cuda", "pallas", "xla")


# Spec dimensions each backend can take as symbolic (jax.export) values. The
# xla backend's loops take symbolic block counts; the kernels' grids and
# workspaces follow the batch, their launch code needs static lengths.
SYMBOLIC_DIMS = {
    "xla": ("batch", "q_len", "kv_len"),
    "pallas": ("batch",),
    "cuda": ("batch",),
}
_SPEC_DIMS = ("batch", "q_len", "kv_len", "num_heads", "num_kv_heads",
              "head_dim")
_DIM_NAMES = {"batch": "the batch size", "q_len": "the query length (T)",
              "kv_len": "the key/value length (S)",
              "num_heads": "the query head count",
              "num_kv_heads": "the key/value head count",
              "head_dim": "head_dim"}


def symbolic_dims(spec: AttentionSpec) -> tuple[str, ...]:
  return tuple(d for d in _SPEC_DIMS if not isinstance(getattr(spec, d), int))


def check_symbolic(name: str, spec: AttentionSpec) -> None:
  """Raise Unsupported if backend `name` cannot take spec's symbolic dims."""
  ok = SYMBOLIC_DIMS.get(name, ())
  bad = [d for d in symbolic_dims(spec) if d not in ok]
  if bad:
    what = ", ".join(f"{_DIM_NAMES[d]} = {getattr(spec, d)}" for d in bad)
    able = [n for n, dims in SYMBOLIC_DIMS.items() if set(bad) <= set(dims)]
    raise Unsupported(
        f"implementation={name!r} needs a static {what} (symbolic shapes, "
        f"jax.export); it takes symbolic "
        f"{', '.join(ok) if ok else 'nothing'}"
        + (f"; implementation={able[0]!r} takes these symbolic" if able
           else ""))


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
    check_symbolic(backend.name, spec)
    backend.check(spec, platform)  # let the user see why it cannot run
    return backend
  return _first_that_serves(spec, _preference(spec, platform), platform)


def _preference(spec: AttentionSpec, platform: str) -> tuple[str, ...]:
  if spec.has_dropout:
    return DROPOUT_PREFERENCE
  if spec.fp8 is not None:
    return FP8_PREFERENCE
  return PREFERENCE.get(platform, DEFAULT_PREFERENCE)


def _first_that_serves(spec, order, platform) -> Backend:
  reasons = []
  for name in order:
    if name not in _REGISTRY:
      continue
    backend = get(name)
    try:
      check_symbolic(name, spec)
      backend.check(spec, platform)
      return backend
    except Unsupported as e:
      reasons.append(f"{name}: {e}")
  raise Unsupported("no backend can serve this request:\n  " +
                    "\n  ".join(reasons))


# Backends whose trace-time code does not depend on the host, so that they
# can be staged for a GPU from a host without one.
_PORTABLE_GPU_ORDER = ("cuda",)


def choose_per_platform(spec: AttentionSpec, implementation: str | None,
                        platform: str) -> dict[str, Backend]:
  """{lowering platform or "default": backend} (see the module docstring).

  One entry ("default") unless implementation is None on a host without a
  GPU and a GPU backend serves the request.
  """
  try:
    host = choose(spec, implementation, platform)
  except Unsupported as e:
    if (implementation is not None and platform not in PREFERENCE and
        _refused_for_platform(implementation, spec, platform, e)):
      raise Unsupported(
          f"{e}. To export for a GPU from this {platform!r} host, leave "
          "implementation=None: it stages the CUDA kernels for a 'cuda' "
          "lowering (jax.lax.platform_dependent) when the extension is "
          "built and serves the request") from None
    raise
  if implementation is not None or platform in PREFERENCE:
    return {"default": host}
  try:
    gpu = _first_that_serves(spec, _PORTABLE_GPU_ORDER, "gpu")
  except Unsupported:
    return {"default": host}
  if gpu.name == host.name:
    return {"default": host}
  return {"cuda": gpu, "default": host}


def _refused_for_platform(name: str, spec: AttentionSpec, platform: str,
                          refusal: Unsupported) -> bool:
  """Whether `refusal` (backend `name` on `platform`) is about the platform:
  a GPU would not give the same reason. A head_dim, dtype or option that no
  platform serves gets no export hint (it would point the wrong way)."""
  try:
    get(name).check(spec, "gpu")
  except Unsupported as on_gpu:
    return str(on_gpu) != str(refusal)
  except Exception:  # (a probe of the GPU itself may fail on this host)
    return True
  return True


def run(branches: dict[str, Backend], fn_for_backend: Callable, *args):
  """fn_for_backend(backend)(*args), staged per platform when there are
  several branches."""
  if len(branches) == 1:
    return fn_for_backend(branches["default"])(*args)
  per_platform = {p: fn_for_backend(b) for p, b in branches.items()
                  if p != "default"}
  return jax.lax.platform_dependent(
      *args, default=fn_for_backend(branches["default"]), **per_platform)
