"""Sharding of the FP8 calls: custom_partitioning (Auto meshes) and
shard_map (explicit mesh axes)."""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_flash._src.fp8.tensor import Fp8Tensor
from jax_flash._src.sharding import partition as sharding


# Dimensions of each role in the Shardy rule; H is the q-head factor that
# sharding.sharding_rule picks (n, (n g) or h). b and the heads shard;
# everything else is replicated (_REPLICATED). vt: V in the kernel layout.
_DIMS = {"q": "b t H e", "kv": "b s n e", "qd": "b H x", "kd": "b n y",
         "vt": "b n e z", "vd": "b n e", "lse": "b H t", "qseg": "b t",
         "kvseg": "b s"}
_REPLICATED = ("t", "s", "e", "x", "y", "z", "g")


def _role_spec(role, batch_axes, head_axes):
  if role in ("q", "kv"):
    return P(batch_axes, None, head_axes, None)
  if role in ("qseg", "kvseg"):
    return P(batch_axes, None)
  if role == "vt":
    return P(batch_axes, head_axes, None, None)
  return P(batch_axes, head_axes, None)  # descales, lse


def _heads_factor(spec, axis_sizes):
  """The q-head factor of sharding.sharding_rule: "n", "(n g)" or "h"."""
  rule, _ = sharding.sharding_rule("forward", spec.group_size, 0,
                                   spec.num_kv_heads, axis_sizes)
  lse = rule.split("->")[1].split(",")[1].strip()  # "b <heads> t"
  assert lse.startswith("b ") and lse.endswith(" t"), rule
  return lse[2:-2]


def sharding_rule(spec, in_roles, out_roles, axis_sizes=None):
  """(rule string, keyword arguments) of an FP8 call for def_partition."""
  heads = _heads_factor(spec, axis_sizes)
  dims = lambda r: _DIMS[r].replace("H", heads)
  rule = (", ".join(dims(r) for r in in_roles) + " -> " +
          ", ".join(dims(r) for r in out_roles))
  order = dict.fromkeys(rule.replace("(", " ").replace(")", " ").replace(
      ",", " ").split())
  kw = dict(need_replication_factors=tuple(f for f in order
                                           if f in _REPLICATED))
  if heads == "(n g)":
    kw["g"] = spec.group_size
  return rule, kw


def partitioned(spec, in_roles, out_roles, body):
  """custom_partitioning of body(local_spec, *arrays) -> tuple of arrays,
  each device running its batch/head shard: sharding.partitioned for the
  FP8 calls' operands (descales and V's kernel layout shard with their
  heads). Batch and head axes come from the q and first kv operand."""
  iq, ik = in_roles.index("q"), in_roles.index("kv")

  def local_body(*args):
    # Under a jit so that array constants of the body (a rotation matrix,
    # a permutation) stay inside it: custom_partitioning takes no consts.
    local = sharding.local_spec(spec, args[iq].shape, args[ik].shape)
    return jax.jit(lambda *a: tuple(body(local, *a)))(*args)

  @custom_partitioning
  def fn(*args):
    return local_body(*args)

  def decide(mesh, arg_shapes):
    q, k = arg_shapes[iq], arg_shapes[ik]
    q_spec, k_spec = sharding._pspec(q, 4), sharding._pspec(k, 4)
    if q_spec is None or k_spec is None or any(
        getattr(x.sharding, "mesh", None) != mesh for x in (q, k)):
      return None, None  # not NamedShardings over `mesh`: replicate
    return sharding.plan(mesh, q_spec, k_spec, q.shape[0], q.shape[2],
                         k.shape[2])

  def shardings(mesh, rs, batch_axes, head_axes):
    return tuple(NamedSharding(mesh, _role_spec(r, batch_axes, head_axes))
                 for r in rs)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    mesh = sharding.mesh_or_replica(mesh, arg_shapes)
    return shardings(mesh, out_roles, *decide(mesh, arg_shapes))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    mesh = sharding.mesh_or_replica(mesh, arg_shapes)
    axes = decide(mesh, arg_shapes)

    return (mesh, local_body, shardings(mesh, out_roles, *axes),
            shardings(mesh, in_roles, *axes))

  def rule(mesh, operand_types, result_types):
    del operand_types, result_types
    empty = mesh is None or getattr(mesh, "empty", False)
    return sharding_rule(spec, in_roles, out_roles,
                         None if empty else tuple(mesh.shape.values()))

  fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule)
  return fn


def shard_call(fn_for_spec, spec, inputs, segs):
  """fn_for_spec(local_spec)(q, k, v, *segs), per batch/head shard (shard_map)
  when the query is sharded over explicit mesh axes (as sharding.call, for
  inputs that may be Fp8Tensors)."""
  lead = inputs[0].data if isinstance(inputs[0], Fp8Tensor) else inputs[0]
  found = sharding._explicit_spec(lead)
  if found is None:
    return fn_for_spec(spec)(*inputs, *segs)
  mesh, q_spec = found
  batch_axes, head_axes = sharding.plan(mesh, q_spec, q_spec, spec.batch,
                                        spec.num_heads, spec.num_kv_heads)
  n_batch = sharding._axis_size(mesh, batch_axes)
  n_heads = sharding._axis_size(mesh, head_axes)
  if n_batch == 1 and n_heads == 1:
    return fn_for_spec(spec)(*inputs, *segs)
  x_spec = _role_spec("q", batch_axes, head_axes)
  d_spec = _role_spec("qd", batch_axes, head_axes)
  seg_spec = _role_spec("qseg", batch_axes, head_axes)
  reshard = jax.sharding.reshard
  in_specs, args = [], []
  for x in inputs:
    if isinstance(x, Fp8Tensor):
      in_specs.append(dataclasses.replace(x, data=x_spec, descale=d_spec))
      args.append(dataclasses.replace(x, data=reshard(x.data, x_spec),
                                      descale=reshard(x.descale, d_spec)))
    else:
      in_specs.append(x_spec)
      args.append(reshard(x, x_spec))
  args += [reshard(s, seg_spec) for s in segs]
  in_specs += [seg_spec] * len(segs)
  local = dataclasses.replace(spec, batch=spec.batch // n_batch,
                              num_heads=spec.num_heads // n_heads,
                              num_kv_heads=spec.num_kv_heads // n_heads)
  per_shard = jax.shard_map(fn_for_spec(local), mesh=mesh,
                            in_specs=tuple(in_specs),
                            out_specs=(x_spec, d_spec), check_vma=False)
  return per_shard(*args)
