"""Sharded inputs: run each device's batch/head shard locally.

Batch and heads are independent in attention, so each device can run a
kernel on its own batch/head shard with no communication. Two mechanisms,
each written once for every kernel call (attention forward and backward, the
FP8 calls, decoding):

* Auto (and unnamed) meshes, under `jit`: the opaque kernel calls are
  wrapped in `jax.experimental.custom_partitioning` (`by_roles`). Shardy sees
  the sharding rule of the operands' roles (rule.py) and the partition
  callback runs the kernel on the local shapes. Without it XLA all-gathers
  the operands of an opaque kernel call and runs it replicated.
* Explicit mesh axes (`jax.make_mesh`'s default): `call` wraps the whole
  differentiable call in `jax.shard_map` over the batch and head axes of q
  (inside, custom_partitioning sees a fully manual context and just inlines
  the call).

The attention kernels' rule, in Shardy's einsum-like notation, for the
forward
    q [b t H d], k [b s n d], v [b s n e], ([sinks [b H]], q_seg [b t],
    kv_seg [b s]) -> o [b t H e], lse [b H t]
and for the backward
    q [b t H d], k [b s n d], v [b s n e], o [b t H e], lse [b H t],
    do [b t H e], delta [b H t], (segs)
        -> dq [b t H d], dk [b s n d], dv [b s n e]
(e: the value head dim, a factor of its own as it may differ from d)
where H = n (plain multi-head), or for GQA the compound factor (n g) with
g = the group size: the q heads of one kv head share the kv head's factor n,
so Shardy keeps every q head with its kv head (rule.heads_factor says when
q heads get a factor h of their own instead). b and n shard freely; the
other factors are need-replication factors (sequence and head_dim sharding
are gathered first; ring attention shards the sequence). The partition
callback re-checks all of this on the shardings it is handed (plan.plan) and
asks for replicated batch/heads wherever they cannot be split evenly (or q
and k disagree), so an unusual input sharding is resharded, never computed
wrongly.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding

from jax_flash._src.sharding.plan import (axis_size, explicit_spec,
                                          mesh_or_replica, plan, pspec)
from jax_flash._src.core import dropout
from jax_flash._src.sharding.rule import role_spec, sharding_rule


def local_spec(spec, q_shape, k_shape):
  """`spec` with batch and head counts of (local) arrays of these shapes."""
  return dataclasses.replace(spec, batch=q_shape[0], num_heads=q_shape[2],
                             num_kv_heads=k_shape[2])


def by_roles(body, in_roles, out_roles, *, group: int, kv_heads: int):
  """custom_partitioning of body(*arrays) -> tuple of arrays, each device
  running its batch/head shard.

  in_roles, out_roles: the operands' and results' roles (rule.DIMS). Batch
  and head axes come from the "q" operand and the first key operand ("kv",
  or "pages": a pool, whose axis 0 is not the batch); group and kv_heads
  (the global ones) pick the q heads' factor of the rule.
  """
  iq = in_roles.index("q")
  ik = next(i for i, r in enumerate(in_roles) if r in ("kv", "pages"))
  fn = custom_partitioning(lambda *args: tuple(body(*args)))

  def decide(mesh, arg_shapes):
    q, k = arg_shapes[iq], arg_shapes[ik]
    q_spec, k_spec = pspec(q, 4), pspec(k, 4)
    if q_spec is None or k_spec is None or any(
        getattr(x.sharding, "mesh", None) != mesh for x in (q, k)):
      return None, None  # not NamedShardings over `mesh`: replicate
    if in_roles[ik] == "pages":
      k_spec = (None,) + k_spec[1:]
    batch_axes, head_axes = plan(mesh, q_spec, k_spec, q.shape[0],
                                 q.shape[2], k.shape[2])
    if in_roles[ik] == "kv" and k.shape[0] != q.shape[0]:
      batch_axes = None
    return batch_axes, head_axes

  def shardings(mesh, roles, batch_axes, head_axes):
    return tuple(NamedSharding(mesh, role_spec(r, batch_axes, head_axes))
                 for r in roles)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    mesh = mesh_or_replica(mesh, arg_shapes)
    return shardings(mesh, out_roles, *decide(mesh, arg_shapes))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    mesh = mesh_or_replica(mesh, arg_shapes)
    axes = decide(mesh, arg_shapes)
    return (mesh, lambda *args: tuple(body(*args)),
            shardings(mesh, out_roles, *axes), shardings(mesh, in_roles, *axes))

  def rule(mesh, operand_types, result_types):
    del operand_types, result_types
    empty = mesh is None or getattr(mesh, "empty", False)
    sizes = None if empty else tuple(mesh.shape.values())
    return sharding_rule(in_roles, out_roles, group, kv_heads, sizes)

  fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule)
  return fn


def kernel_roles(kind: str, n_segs: int, sinks: bool = False):
  """(operand roles, result roles) of the attention kernel calls."""
  # Segment ids, then (with spec.has_shifts) the shifts, laid out like them.
  segs = ("qseg", "kvseg", "qseg", "kvseg")[:n_segs]
  if kind == "forward":
    return ("q", "kv", "v") + ("sinks",) * sinks + segs, ("o", "lse")
  if kind == "backward":
    return (("q", "kv", "v", "o", "lse", "o", "lse") + segs,
            ("q", "kv", "v"))
  raise ValueError(kind)


def partitioned(kind: str, spec, body):
  """The attention kernel call body(local_spec, *arrays) -> tuple of arrays
  under `by_roles`; kind "forward" or "backward" fixes the operands."""
  n_segs = (4 if spec.has_shifts else 2) if spec.has_segment_ids else 0
  in_roles, out_roles = kernel_roles(kind, n_segs, spec.has_sinks)
  return by_roles(
      lambda *args: body(local_spec(spec, args[0].shape, args[1].shape),
                         *args),
      in_roles, out_roles, group=spec.group_size, kv_heads=spec.num_kv_heads)


# ---------------------------------------------------------------------------
# Explicit mesh axes: shard_map around the whole differentiable call.
# ---------------------------------------------------------------------------


def call(fn_for_spec, spec, *args, roles=None):
  """fn_for_spec(local_spec)(*args) -> (o, lse), per shard if needed.

  args: q, k, v, then with spec.has_sinks the sinks [B, H], then segment
  ids (and shifts), then with spec.has_dropout dropout's key words
  (core/dropout.py key_words: each shard gets the
  words of its own origin, so it draws the request's mask); q, k, v may be
  pytrees (an Fp8Tensor). roles: per argument its role, or a pytree of roles
  matching it (default: q, kv, kv, segment ids, key words).
  """
  n_key = dropout.N_WORDS if spec.has_dropout else 0
  if roles is None:
    sinks = ("sinks",) if spec.has_sinks else ()
    roles = (("q", "kv", "kv") + sinks + ("qseg", "kvseg", "qseg", "kvseg")[
        :len(args) - 3 - len(sinks) - n_key] + ("scalar",) * n_key)
  found = explicit_spec(jax.tree.leaves(args[0])[0])
  if found is None:
    return fn_for_spec(spec)(*args)
  mesh, q_spec = found
  batch_axes, head_axes = plan(mesh, q_spec, q_spec, spec.batch,
                               spec.num_heads, spec.num_kv_heads)
  n_batch = axis_size(mesh, batch_axes)
  n_heads = axis_size(mesh, head_axes)
  if n_batch == 1 and n_heads == 1:
    return fn_for_spec(spec)(*args)
  in_specs = jax.tree.map(lambda r: role_spec(r, batch_axes, head_axes),
                          tuple(roles))
  args = jax.tree.map(jax.sharding.reshard, tuple(args), in_specs)
  local = dataclasses.replace(spec, batch=spec.batch // n_batch,
                              num_heads=spec.num_heads // n_heads,
                              num_kv_heads=spec.num_kv_heads // n_heads)

  def shard_fn(*a):
    if n_key:  # this shard's first batch element and head in the request
      index = lambda axes: 0 if axes is None else jax.lax.axis_index(axes)
      a = a[:-n_key] + dropout.with_origin(
          a[-n_key:], index(batch_axes) * local.batch,
          index(head_axes) * local.num_heads)
    return fn_for_spec(local)(*a)

  per_shard = jax.shard_map(
      shard_fn, mesh=mesh, in_specs=in_specs,
      out_specs=(role_spec("q", batch_axes, head_axes),
                 role_spec("lse", batch_axes, head_axes)),
      check_vma=False)
  return per_shard(*args)
