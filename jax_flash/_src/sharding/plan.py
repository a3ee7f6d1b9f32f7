"""Which mesh axes a call's batch and heads split over, read from its
operands' shardings."""

from __future__ import annotations

import math

import jax
import numpy as np


def axis_size(mesh, entry) -> int:
  """The number of shards of a partition-spec entry (None: 1)."""
  if entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[n] for n in names)


def _names(entry):
  if entry is None:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


def plan(mesh, q_spec, k_spec, batch: int, heads: int, kv_heads: int):
  """(batch_axes, head_axes): the mesh axes batch and heads are split over.

  Taken from q's spec (k's where q's dim is unsharded); an entry that does
  not divide the dimension evenly (for heads: the kv heads, so that every q
  head stays with its kv head) becomes None, i.e. replicated.
  """
  pick = lambda i: q_spec[i] if q_spec[i] is not None else k_spec[i]
  batch_axes, head_axes = pick(0), pick(2)
  if batch_axes is not None and batch % axis_size(mesh, batch_axes):
    batch_axes = None
  if head_axes is not None and (heads % axis_size(mesh, head_axes) or
                                kv_heads % axis_size(mesh, head_axes)):
    head_axes = None
  if set(_names(batch_axes)) & set(_names(head_axes)):
    head_axes = None
  return batch_axes, head_axes


def pspec(x, ndim):
  """The ndim-entry partition spec of x's sharding, or None."""
  sharding = getattr(x, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return None
  spec = tuple(spec)
  return spec + (None,) * (ndim - len(spec))


def mesh_or_replica(mesh, arg_shapes):
  """`mesh`, or where jax could not name one (shardings then come as
  GSPMDSharding), a 1-axis mesh of the first operand's devices to replicate
  over (for custom_partitioning callbacks)."""
  if mesh is not None and not getattr(mesh, "empty", False):
    return mesh
  sharding = arg_shapes[0].sharding
  devices = getattr(sharding, "_device_assignment", None) or sorted(
      sharding.device_set, key=lambda d: d.id)
  return jax.sharding.Mesh(np.asarray(devices), ("_jax_flash_replica",))


def explicit_spec(x):
  """(mesh, spec with one entry per axis) when x is sharded over explicit
  mesh axes, else None."""
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
