"""The decoding kernel call under sharding and vmap.

Sharding (custom_partitioning, Auto meshes under jit): decoding is
independent per sequence and per KV head, so each device runs the kernels
on its shard with no communication:
  * KV heads: q [b t H d] with its heads grouped by KV head, the caches
    [p s n d] over the same axes (every q head stays with its KV head);
  * batch: q, the page table, the lengths and the outputs over the batch;
    the cache too when its row b is sequence b (a contiguous cache of B rows
    without cache_batch_idx: `identity_rows`, the body then numbers the local
    rows itself). A paged cache (or cache_batch_idx) is a pool any sequence
    may read: replicated over the batch axes, so shard those caches over
    heads only.
Shardings that do not fit (sequence or head_dim sharded, heads that would
split a KV head's group) are gathered first, never computed wrongly.

vmap (custom_vmap): the mapped axis is folded into the batch, and mapped
caches into the page pool, with the page table offset to each element's
pages; one launch for the whole vmap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_flash._src.sharding import partition as attn_sharding


# The cache operands: the pages [p s n d] of K and V and, for an FP8 cache,
# their descales [p n s]. Axis 0 is the pool, `n` the KV heads.
_PAGES, _DESCALE = "pages", "descale"


def _cache_roles(fp8: bool):
  return (_PAGES, _PAGES) + ((_DESCALE, _DESCALE) if fp8 else ())


def partitioned(body, *, identity_rows: bool, group: int, kv_heads: int,
                fp8: bool = False):
  """fn(q, *caches, table, seqlens) -> (o, lse) over shards.

  caches: k_pages, v_pages (and with fp8 k_descale, v_descale). body(q,
  *caches, table, seqlens) -> (o, lse) runs on local arrays; with
  identity_rows its table is the local arange.
  """
  roles = _cache_roles(fp8)

  def local(q, *args):
    *caches, table, seqlens = args
    if identity_rows:
      table = jnp.arange(q.shape[0], dtype=jnp.int32)[:, None]
    return tuple(body(q, *caches, table, seqlens))

  fn = custom_partitioning(local)

  def decide(mesh, arg_shapes):
    q, k = arg_shapes[0], arg_shapes[1]
    q_spec, k_spec = attn_sharding._pspec(q, 4), attn_sharding._pspec(k, 4)
    if q_spec is None or k_spec is None or any(
        getattr(x.sharding, "mesh", None) != mesh for x in (q, k)):
      return None, None
    batch_axes, head_axes = attn_sharding.plan(
        mesh, q_spec, k_spec if identity_rows else (None,) + k_spec[1:],
        q.shape[0], q.shape[2], k.shape[2])
    if identity_rows and k.shape[0] != q.shape[0]:
      batch_axes = None
    return batch_axes, head_axes

  def shardings(mesh, batch_axes, head_axes):
    pool = batch_axes if identity_rows else None
    spec = {_PAGES: P(pool, None, head_axes, None),
            _DESCALE: P(pool, head_axes, None)}
    ins = ((P(batch_axes, None, head_axes, None),) +
           tuple(spec[r] for r in roles) + (P(batch_axes, None), P(batch_axes)))
    outs = (P(batch_axes, None, head_axes, None), P(batch_axes, head_axes, None))
    named = lambda specs: tuple(NamedSharding(mesh, s) for s in specs)
    return named(ins), named(outs)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    mesh = attn_sharding.mesh_or_replica(mesh, arg_shapes)
    return shardings(mesh, *decide(mesh, arg_shapes))[1]

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    mesh = attn_sharding.mesh_or_replica(mesh, arg_shapes)
    ins, outs = shardings(mesh, *decide(mesh, arg_shapes))
    return mesh, local, outs, ins

  def rule(mesh, operand_types, result_types):
    del operand_types, result_types
    empty = mesh is None or getattr(mesh, "empty", False)
    sizes = None if empty else tuple(mesh.shape.values())
    heads = attn_sharding.heads_factor(group, kv_heads, sizes)
    pool = "b" if identity_rows else "p"
    dims = {_PAGES: f"{pool} s n d", _DESCALE: f"{pool} n s"}
    rule = (f"b t {heads} d, " + ", ".join(dims[r] for r in roles) +
            f", b m, b -> b t {heads} d, b {heads} t")
    order = dict.fromkeys(rule.replace("(", " ").replace(")", " ").replace(
        ",", " ").replace("->", " ").split())
    kw = dict(need_replication_factors=tuple(
        f for f in order if f in {"t", "d", "s", "p", "m", "g"}))
    if heads == "(n g)":
      kw["g"] = group
    return rule, kw

  fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule)
  return fn


def decode_call(body, *, identity_rows: bool, group: int, kv_heads: int,
                fp8: bool = False):
  """fn(q, *caches, table, seqlens) -> (o, lse): `partitioned` under a
  custom_vmap that folds a vmapped call into one call on the folded batch
  and page pool."""
  kw = dict(group=group, kv_heads=kv_heads, fp8=fp8)
  wrapped = jax.custom_batching.custom_vmap(partitioned(
      body, identity_rows=identity_rows, **kw))

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, q, *args):
    *caches, table, seqlens = args
    bq, *bc, bt, bs = in_batched
    V = axis_size
    expand = lambda x, b: x if b else jnp.broadcast_to(x, (V,) + x.shape)
    pooled = any(bc)
    if pooled:  # fold every cache operand alike
      caches = [expand(c, b) for c, b in zip(caches, bc)]
    q, table, seqlens = expand(q, bq), expand(table, bt), expand(seqlens, bs)
    if pooled:  # element v's pages follow the pools of the elements before it
      pool = caches[0].shape[1]
      table = table + (jnp.arange(V, dtype=table.dtype) * pool)[:, None, None]
      caches = [c.reshape((V * pool,) + c.shape[2:]) for c in caches]
    fold = lambda x: x.reshape((V * x.shape[1],) + x.shape[2:])
    # Rows stay the identity only if every element brought its own rows;
    # calling decode_call again keeps nested vmaps folding.
    inner = decode_call(body, identity_rows=identity_rows and pooled, **kw)
    o, lse = inner(fold(q), *caches, fold(table), fold(seqlens))
    unfold = lambda x: x.reshape((V, x.shape[0] // V) + x.shape[1:])
    return (unfold(o), unfold(lse)), (True, True)

  return wrapped
