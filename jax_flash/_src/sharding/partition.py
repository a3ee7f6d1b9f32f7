"""Sharded inputs: run each device's batch/head shard locally.

Batch and heads are independent in attention, so each device can run the
kernel on its own batch/head shard with no communication. Two mechanisms:

* Auto (and unnamed) meshes, under `jit`: the kernel calls of the custom-call
  backends (pallas, cuda) are wrapped in `jax.experimental.custom_partitioning`
  (`partitioned`). Shardy sees a sharding rule (below) and `partition` runs the
  backend on the local shapes. Without it XLA all-gathers the operands of the
  opaque kernel call and runs it replicated.
* Explicit mesh axes (`jax.make_mesh`'s default): `call` wraps the whole
  custom_vjp in `jax.shard_map` over the batch and head axes of q (inside,
  custom_partitioning sees a fully manual context and just inlines the call).

The sharding rule, in Shardy's einsum-like notation, for the forward
    q [b t H d], k [b s n d], v [b s n d], (q_seg [b t], kv_seg [b s])
        -> o [b t H d], lse [b H t]
and for the backward
    q, k, v, o [b t H d], lse [b H t], do [b t H d], delta [b H t], (segs)
        -> dq [b t H d], dk [b s n d], dv [b s n d]
where H = n (plain multi-head), or for GQA the compound factor (n g) with
g = the group size: the q heads of one kv head share the kv head's factor n,
so Shardy keeps every q head with its kv head. The compound is used only when
every product of mesh axes that divides H divides the kv head count too;
otherwise Shardy could split a mesh axis into sub-axes over (n g), which custom_partitioning cannot decode,
so q heads get a factor h of their own (also for MQA: Shardy allows no size-1
factor in a compound) and `partition` alone keeps heads together. b and
n shard freely; t, s, d and g are need-replication factors (sequence and
head_dim sharding are gathered first; ring attention over a sharded sequence
is a later issue). `partition` re-checks all of this on the shardings it is
handed and asks for replicated batch/heads wherever they cannot be split
evenly (or q and k disagree), so an unusual input sharding is resharded, never
computed wrongly.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

# Operand/result roles and their dimensions in the sharding rule.
_Q, _KV, _LSE, _QSEG, _KVSEG = "q", "kv", "lse", "qseg", "kvseg"


def _roles(kind: str, n_segs: int):
  # Segment ids, then (with spec.has_shifts) the shifts, laid out like them.
  segs = (_QSEG, _KVSEG, _QSEG, _KVSEG)[:n_segs]
  if kind == "forward":
    return (_Q, _KV, _KV) + segs, (_Q, _LSE)
  if kind == "backward":
    return (_Q, _KV, _KV, _Q, _LSE, _Q, _LSE) + segs, (_Q, _KV, _KV)
  raise ValueError(kind)


def _no_sub_axes(axis_sizes, heads: int, kv_heads: int) -> bool:
  """Whether every product of mesh axes that divides `heads` divides
  `kv_heads` (then a head sharding of (n g) falls on n alone)."""
  products = {1}
  for size in axis_sizes:
    products |= {p * size for p in products}
  return all(kv_heads % a == 0 for a in products if heads % a == 0)


def heads_factor(group: int, kv_heads: int, axis_sizes) -> str:
  """The q heads' factor in a sharding rule whose kv heads are `n`: "n"
  (plain multi-head), "(n g)" (GQA, every q head with its kv head), or "h".

  Sharding (n g) over axes that do not divide n would make Shardy split a
  mesh axis into sub-axes, which custom_partitioning cannot decode; then q
  heads get a factor of their own and `partition` keeps them with their kv
  heads (or replicates heads).
  """
  if group == 1:
    return "n"
  if kv_heads > 1 and axis_sizes is not None and _no_sub_axes(
      axis_sizes, group * kv_heads, kv_heads):
    return "(n g)"
  return "h"


def sharding_rule(kind: str, group: int, n_segs: int, kv_heads: int,
                  axis_sizes=None):
  """(rule string, keyword arguments) for `def_partition`.

  axis_sizes: the mesh's axis sizes (None: unknown, no shared head factor).
  """
  heads = heads_factor(group, kv_heads, axis_sizes)
  dims = {_Q: f"b t {heads} d", _KV: "b s n d", _LSE: f"b {heads} t",
          _QSEG: "b t", _KVSEG: "b s"}
  ins, outs = _roles(kind, n_segs)
  rule = (", ".join(dims[r] for r in ins) + " -> " +
          ", ".join(dims[r] for r in outs))
  replicated = {"t", "s", "d", "g"}
  # Shardy wants special factors in the order they first appear in the rule.
  order = dict.fromkeys(rule.replace("(", " ").replace(")", " ").replace(
      ",", " ").split())
  kw = dict(need_replication_factors=tuple(f for f in order
                                           if f in replicated))
  if heads == "(n g)":
    kw["g"] = group
  return rule, kw


def local_spec(spec, q_shape, k_shape):
  """`spec` with batch and head counts of (local) arrays of these shapes."""
  return dataclasses.replace(spec, batch=q_shape[0], num_heads=q_shape[2],
                             num_kv_heads=k_shape[2])


def _axis_size(mesh, entry) -> int:
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
  if batch_axes is not None and batch % _axis_size(mesh, batch_axes):
    batch_axes = None
  if head_axes is not None and (heads % _axis_size(mesh, head_axes) or
                                kv_heads % _axis_size(mesh, head_axes)):
    head_axes = None
  if set(_names(batch_axes)) & set(_names(head_axes)):
    head_axes = None
  return batch_axes, head_axes


def _role_spec(role, batch_axes, head_axes):
  if role in (_Q, _KV):
    return P(batch_axes, None, head_axes, None)
  if role == _LSE:
    return P(batch_axes, head_axes, None)
  return P(batch_axes, None)


def _pspec(x, ndim):
  """The 4-entry (ndim-entry) partition spec of a sharding, or None."""
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


def partitioned(kind: str, spec, body):
  """custom_partitioning of body(local_spec, *arrays) -> tuple of arrays.

  kind: "forward" or "backward" (fixes the operand/result layout above).
  Returns fn(*arrays) -> tuple of arrays.
  """
  n_segs = (4 if spec.has_shifts else 2) if spec.has_segment_ids else 0
  in_roles, out_roles = _roles(kind, n_segs)

  @custom_partitioning
  def fn(*args):
    return tuple(body(local_spec(spec, args[0].shape, args[1].shape), *args))

  def _decide(mesh, arg_shapes):
    q, k = arg_shapes[0], arg_shapes[1]
    q_spec, k_spec = _pspec(q, 4), _pspec(k, 4)
    if q_spec is None or k_spec is None or any(
        getattr(x.sharding, "mesh", None) != mesh for x in (q, k)):
      return None, None  # not NamedShardings over `mesh`: replicate
    B, H, Hk = q.shape[0], q.shape[2], k.shape[2]
    return plan(mesh, q_spec, k_spec, B, H, Hk)

  def _shardings(mesh, roles, batch_axes, head_axes):
    return tuple(NamedSharding(mesh, _role_spec(r, batch_axes, head_axes))
                 for r in roles)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    mesh = mesh_or_replica(mesh, arg_shapes)
    batch_axes, head_axes = _decide(mesh, arg_shapes)
    return _shardings(mesh, out_roles, batch_axes, head_axes)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    mesh = mesh_or_replica(mesh, arg_shapes)
    batch_axes, head_axes = _decide(mesh, arg_shapes)
    arg_shardings = _shardings(mesh, in_roles, batch_axes, head_axes)
    out_shardings = _shardings(mesh, out_roles, batch_axes, head_axes)

    def lower_fn(*args):
      return tuple(body(local_spec(spec, args[0].shape, args[1].shape),
                        *args))

    return mesh, lower_fn, out_shardings, arg_shardings

  def rule(mesh, operand_types, result_types):
    del operand_types, result_types
    empty = mesh is None or getattr(mesh, "empty", False)
    sizes = None if empty else tuple(mesh.shape.values())
    return sharding_rule(kind, spec.group_size, n_segs, spec.num_kv_heads,
                         sizes)

  fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule)
  return fn


# ---------------------------------------------------------------------------
# Explicit mesh axes: shard_map around the whole differentiable call.
# ---------------------------------------------------------------------------


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


def call(fn_for_spec, spec, q, k, v, *segs):
  """fn_for_spec(local_spec)(q, k, v, *segs) -> (o, lse), per shard if needed."""
  found = _explicit_spec(q)
  if found is None:
    return fn_for_spec(spec)(q, k, v, *segs)
  mesh, q_spec = found
  batch_axes, head_axes = plan(mesh, q_spec, q_spec, spec.batch,
                               spec.num_heads, spec.num_kv_heads)
  n_batch, n_heads = _axis_size(mesh, batch_axes), _axis_size(mesh, head_axes)
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
