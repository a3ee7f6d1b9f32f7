"""A backend's forward and backward as batch-major array functions.

`kernel_call(kind, backend, spec)` is what the differentiable ops
(differentiable.py) call: fn(*arrays) -> tuple of arrays with the operand
order

    forward:  q, k, v, [sinks],                 *masks, *dropout_key
    backward: q, k, v, o, lse, do, delta,       *masks, *dropout_key

where sinks [B, H] come with spec.has_sinks (the forward's only: the lse
includes them, which is all the backward needs), masks are (q_seg, kv_seg)
with spec.has_segment_ids, then (q_shift, kv_shift) with spec.has_shifts,
and dropout_key the key words (core/dropout.py key_words) with
spec.has_dropout. Opaque kernel calls (pallas_call, FFI custom calls)
get a custom_partitioning rule over batch and heads (sharding/partition.py);
plain-JAX backends are partitioned by XLA like any other computation.
"""

from __future__ import annotations

import dataclasses
import functools

from jax_flash._src.backends import registry as backends
from jax_flash._src.core.spec import AttentionSpec
from jax_flash._src.sharding import partition as sharding

# Backends whose calls are opaque to XLA (pallas_call, FFI custom calls); their
# kernels get a custom_partitioning rule (sharding.partitioned).
CUSTOM_CALL_BACKENDS = frozenset({"pallas", "cuda"})


def n_masks(spec: AttentionSpec) -> int:
  """How many mask operands (segment ids, shifts) the spec's calls take."""
  if not spec.has_segment_ids:
    return 0
  return 4 if spec.has_shifts else 2


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """The backend's forward or backward (kind) on the operands above: a
  hashable value (a primitive parameter, named in jaxprs)."""

  kind: str
  backend: str
  spec: AttentionSpec

  def __call__(self, *arrays):
    return _build(self.kind, self.backend, self.spec)(*arrays)


def kernel_call(kind: str, backend_name: str, spec: AttentionSpec):
  """fn(*arrays) -> tuple: the backend's forward or backward (kind) on the
  operands above, partitioned over batch/heads for opaque kernel calls."""
  return KernelCall(kind, backend_name, spec)


@functools.lru_cache(maxsize=None)
def _build(kind: str, backend_name: str, spec: AttentionSpec):
  backend = backends.get(backend_name)
  n_out = 0 if kind == "forward" else 4  # o, lse, do, delta
  n_mask = n_masks(spec)
  with_sinks = kind == "forward" and spec.has_sinks

  def body(local, q, k, v, *rest):
    arrays = rest[:n_out]
    extra = {}
    if with_sinks:
      extra["sinks"], rest = rest[0], rest[1:]
    masks = rest[n_out:n_out + n_mask]
    key = rest[n_out + n_mask:]
    q_seg, kv_seg = masks[:2] if masks else (None, None)
    if len(masks) == 4:
      extra["shifts"] = tuple(masks[2:])
    if key:
      extra["dropout_key"] = tuple(key)
    fn = backend.forward if kind == "forward" else backend.backward
    return tuple(fn(local, q, k, v, *arrays, q_seg, kv_seg, **extra))

  # Dropout draws its mask at global (batch, head) positions, which one
  # shard's local call cannot know: such calls stay whole.
  if backend_name in CUSTOM_CALL_BACKENDS and not spec.has_dropout:
    return sharding.partitioned(kind, spec, body)
  return lambda *a: body(sharding.local_spec(spec, a[0].shape, a[1].shape),
                         *a)
