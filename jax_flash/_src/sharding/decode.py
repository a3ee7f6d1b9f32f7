"""The decoding kernel call under sharding and vmap.

Sharding (custom_partitioning through partition.by_roles, Auto meshes
under jit): decoding is independent per sequence and per KV head, so each
device runs the kernels on its shard with no communication:
  * KV heads: q [b t H d] with its heads grouped by KV head, the caches
    [p s n d] over the same axes (every q head stays with its KV head);
  * batch: q, the page table, the lengths, the sinks [B, H] (with q's
    heads) and the outputs over the batch;
    the cache too when its row b is sequence b (a contiguous cache of B rows
    without cache_batch_idx: `identity_rows`, the body then numbers the local
    rows itself). A paged cache (or cache_batch_idx) is a pool any sequence
    may read: replicated over the batch axes, so shard those caches over
    heads only.
Shardings that do not fit (sequence or head_dim sharded, heads that would
split a KV head's group) are gathered first, never computed wrongly.

vmap (custom_vmap): the mapped axis is folded into the batch (the sinks'
too), and mapped caches into the page pool, with the page table offset to
each element's pages; one launch for the whole vmap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash._src.sharding.partition import by_roles


def partitioned(body, *, identity_rows: bool, group: int, kv_heads: int,
                fp8: bool = False, sinks: bool = False, rows: int | None = None):
  """fn(q, *caches, table, seqlens, [sinks]) -> (o, lse) over shards.

  caches: k_pages, v_pages (and with fp8 k_descale, v_descale); sinks [B, H]
  with `sinks`. body(q, *caches, table, seqlens, [sinks]) -> (o, lse) runs on
  local arrays; with identity_rows its table is the local arange: the table
  passed in when it is that (`rows`: the caller's batch, whose arange it
  passes, e.g. as a constant, which costs no kernel), else computed.
  """
  # A cache whose row b is sequence b shards with the batch; a pool is
  # replicated over the batch axes (any sequence may read any page).
  pages, descale = (("kv", "cache_descale") if identity_rows else
                    ("pages", "page_descale"))
  caches = (pages, pages) + ((descale, descale) if fp8 else ())

  n_caches = len(caches)

  def local(q, *args):
    caches, (table, *rest) = args[:n_caches], args[n_caches:]
    if identity_rows and q.shape[0] != rows:  # a batch shard: local rows
      table = jnp.arange(q.shape[0], dtype=jnp.int32)[:, None]
    return body(q, *caches, table, *rest)

  return by_roles(local, ("q",) + caches + ("table", "lengths") +
                  ("sinks",) * sinks, ("q", "lse"), group=group,
                  kv_heads=kv_heads)


def decode_call(body, *, identity_rows: bool, group: int, kv_heads: int,
                fp8: bool = False, sinks: bool = False, rows: int | None = None):
  """fn(q, *caches, table, seqlens, [sinks]) -> (o, lse): `partitioned`
  under a custom_vmap that folds a vmapped call into one call on the folded
  batch and page pool."""
  kw = dict(group=group, kv_heads=kv_heads, fp8=fp8, sinks=sinks)
  n_caches = 4 if fp8 else 2
  wrapped = jax.custom_batching.custom_vmap(partitioned(
      body, identity_rows=identity_rows, rows=rows, **kw))

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, q, *args):
    caches = args[:n_caches]
    bq, bc = in_batched[0], in_batched[1:1 + n_caches]
    V = axis_size
    expand = lambda x, b: x if b else jnp.broadcast_to(x, (V,) + x.shape)
    pooled = any(bc)
    if pooled:  # fold every cache operand alike
      caches = [expand(c, b) for c, b in zip(caches, bc)]
    q = expand(q, bq)
    # The table, the lengths (and the sinks) are batch-major: folded like q.
    table, *per_sequence = [expand(x, b) for x, b in zip(
        args[n_caches:], in_batched[1 + n_caches:])]
    if pooled:  # element v's pages follow the pools of the elements before it
      pool = caches[0].shape[1]
      table = table + (jnp.arange(V, dtype=table.dtype) * pool)[:, None, None]
      caches = [c.reshape((V * pool,) + c.shape[2:]) for c in caches]
    fold = lambda x: x.reshape((V * x.shape[1],) + x.shape[2:])
    # Rows stay the identity only if every element brought its own rows;
    # calling decode_call again keeps nested vmaps folding.
    inner = decode_call(body, identity_rows=identity_rows and pooled, **kw)
    o, lse = inner(fold(q), *caches, fold(table), *map(fold, per_sequence))
    unfold = lambda x: x.reshape((V, x.shape[0] // V) + x.shape[1:])
    return (unfold(o), unfold(lse)), (True, True)

  return wrapped
