"""The operands of the partitioned kernel calls, by role: their dimensions in
Shardy's sharding rule and their partition specs, from one table.

Every kernel call (attention forward/backward, the FP8 pre-pass and forward,
decoding) is independent per batch element and per KV head, so its operands
shard over the batch factor `b` and the heads (`n` for KV heads; the q heads'
factor, `H` below, is `heads_factor`'s). Every other factor is a
need-replication factor: a sharded sequence, head dim or page pool is
gathered first.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

# Role -> dimensions (one letter per axis). b: batch; H: q heads; n: KV
# heads; t, s: query and key positions (s also a cache's slots); d: head dim;
# e: value head dim (a factor of its own: it may differ from d);
# p: a page pool any sequence may read; x, y, m: block counts, page-table
# columns.
DIMS = {
    "q": "b t H d",             # query, output, dO, dQ
    "kv": "b s n d",            # key, value (a cache whose row b is sequence b)
    "v": "b s n e",             # value, dV (attention kernels)
    "o": "b t H e",             # output, dO (attention kernels)
    "lse": "b H t",             # logsumexp, delta
    "sinks": "b H",             # attention sink logits
    "qseg": "b t",              # query segment ids (and shifts)
    "kvseg": "b s",             # key segment ids (and shifts)
    "q_descale": "b H x",       # FP8: per 64 query rows
    "k_descale": "b n y",       # FP8: per scheme.k_block(head_dim) keys
    "v_descale": "b n d",       # FP8: per channel
    "pages": "p s n d",         # a K/V page pool
    "page_descale": "p n s",    # an FP8 page pool's scales
    "cache_descale": "b n s",   # an FP8 cache's scales, row b = sequence b
    "table": "b m",             # page table
    "lengths": "b",             # per-sequence lengths
    "scalar": "",               # a replicated scalar (dropout's key words)
}
_SHARDED = ("b", "n", "h")


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
  heads get a factor of their own and the partition callback keeps them
  with their kv heads (or replicates heads). MQA gets "h" too: Shardy allows
  no size-1 factor in a compound.
  """
  if group == 1:
    return "n"
  if kv_heads > 1 and axis_sizes is not None and _no_sub_axes(
      axis_sizes, group * kv_heads, kv_heads):
    return "(n g)"
  return "h"


def sharding_rule(in_roles, out_roles, group: int, kv_heads: int,
                  axis_sizes=None):
  """(rule string, keyword arguments) for `def_partition`.

  axis_sizes: the mesh's axis sizes (None: unknown, no shared head factor).
  """
  heads = heads_factor(group, kv_heads, axis_sizes)
  dims = lambda role: DIMS[role].replace("H", heads)
  rule = (", ".join(dims(r) for r in in_roles) + " -> " +
          ", ".join(dims(r) for r in out_roles))
  # Shardy wants special factors in the order they first appear in the rule.
  order = dict.fromkeys(rule.replace("(", " ").replace(")", " ").replace(
      ",", " ").replace("->", " ").split())
  kw = dict(need_replication_factors=tuple(f for f in order
                                           if f not in _SHARDED))
  if heads == "(n g)":
    kw["g"] = group
  return rule, kw


def role_spec(role: str, batch_axes, head_axes) -> P:
  """The partition spec of an operand of `role` split over these axes."""
  return P(*(batch_axes if f == "b" else head_axes if f in "Hn" else None
             for f in DIMS[role].split()))
