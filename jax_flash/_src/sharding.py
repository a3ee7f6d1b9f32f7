"""Explicitly sharded inputs: run each device's shard locally with shard_map.

With an explicit mesh (`jax.make_mesh` defaults to explicit axes), a kernel
call such as a `pallas_call` cannot consume sharded operands directly. Batch
and heads are independent in attention, so each device can run the kernel on
its own batch/head shard with no communication: we wrap the call in
`jax.shard_map` over the batch and head axes of q. GQA keeps the kv heads of a
shard together with their q heads (kv heads are sharded over the same mesh
axes). Sequence and head_dim sharding are gathered first (ring attention over
sequence-sharded inputs is a later issue). Auto/manual meshes and unsharded
inputs are left to XLA's own propagation.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import PartitionSpec as P


def _explicit_spec(x):
  """(mesh, 4-entry spec) when x is sharded over explicit mesh axes, else None."""
  try:
    sharding = jax.typeof(x).sharding
  except (AttributeError, TypeError):
    return None
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or getattr(mesh, "empty", True):
    return None
  explicit = {
      name for name, kind in zip(mesh.axis_names, mesh.axis_types)
      if kind == jax.sharding.AxisType.Explicit
  }
  spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  used = {a for entry in spec if entry is not None
          for a in (entry if isinstance(entry, tuple) else (entry,))}
  if not used or not used <= explicit:
    return None
  return mesh, spec


def _axis_size(mesh, entry) -> int:
  if entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[n] for n in names)


def call(fn_for_spec, spec, q, k, v, *segs):
  """fn_for_spec(local_spec)(q, k, v, *segs) -> (o, lse), per shard if needed."""
  found = _explicit_spec(q)
  if found is None:
    return fn_for_spec(spec)(q, k, v, *segs)
  mesh, q_spec = found
  batch_axes, head_axes = q_spec[0], q_spec[2]
  n_batch, n_heads = _axis_size(mesh, batch_axes), _axis_size(mesh, head_axes)
  if spec.batch % n_batch:
    batch_axes, n_batch = None, 1
  if spec.num_heads % n_heads or spec.num_kv_heads % n_heads:
    head_axes, n_heads = None, 1  # kv heads cannot follow: keep heads whole
  if n_batch == 1 and n_heads == 1:
    return fn_for_spec(spec)(q, k, v, *segs)

  qkv_spec = P(batch_axes, None, head_axes, None)
  seg_spec = P(batch_axes, None)
  reshard = lambda x, s: jax.sharding.reshard(x, s)
  q, k, v = (reshard(x, qkv_spec) for x in (q, k, v))
  segs = tuple(reshard(s, seg_spec) for s in segs)
  local = dataclasses.replace(spec, batch=spec.batch // n_batch,
                              num_heads=spec.num_heads // n_heads,
                              num_kv_heads=spec.num_kv_heads // n_heads)
  per_shard = jax.shard_map(
      fn_for_spec(local), mesh=mesh,
      in_specs=(qkv_spec,) * 3 + (seg_spec,) * len(segs),
      out_specs=(qkv_spec, P(batch_axes, head_axes, None)),
      check_vma=False)
  return per_shard(q, k, v, *segs)
