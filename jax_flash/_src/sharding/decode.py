"""The decoding kernel call under sharding and vmap.

Sharding (custom_partitioning through partition.by_roles, Auto meshes
under jit): decoding is independent per sequence and per KV head, so each
device runs the kernels on its shard with no communication:
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

from jax_flash._src.sharding.partition import by_roles


def partitioned(body, *, identity_rows: bool, group: int, kv_heads: int,
                fp8: bool = False):
  """fn(q, *caches, table, seqlens) -> (o, lse) over shards.

  caches: k_pages, v_pages (and with fp8 k_descale, v_descale). body(q,
  *caches, table, seqlens) -> (o, lse) runs on local arrays; with
  identity_rows its table is the local arange.
  """
  # A cache whose row b is sequence b shards with the batch; a pool is
  # replicated over the batch axes (any sequence may read any page).
  pages, descale = (("kv", "cache_descale") if identity_rows else
                    ("pages", "page_descale"))
  caches = (pages, pages) + ((descale, descale) if fp8 else ())

  def local(q, *args):
    *caches, table, seqlens = args
    if identity_rows:
      table = jnp.arange(q.shape[0], dtype=jnp.int32)[:, None]
    return body(q, *caches, table, seqlens)

  return by_roles(local, ("q",) + caches + ("table", "lengths"),
                  ("q", "lse"), group=group, kv_heads=kv_heads)


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
