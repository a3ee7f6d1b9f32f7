"""Pure-JAX blockwise backend: the same online-softmax algorithm as the kernels.

Memory is O(seq): a `lax.map` over query blocks, and inside it a loop over only
the KV blocks that can be visible (causal/window sparsity), so no T x S matrix
is ever built. The backward loops over KV blocks, keeps dK/dV for the block,
recomputes P from the saved LSE per (q block, kv block), and accumulates dQ in
an fp32 buffer carried through the loop. It is the CPU default and the
in-graph reference for the other backends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash._src.core import dropout as dropout_rng
from jax_flash._src.core import masking
from jax_flash._src.core import softmax
from jax_flash._src.core import tile_spans
from jax_flash._src.backends.registry import register
from jax_flash._src.core.spec import AttentionSpec

BLOCK = 512


def _round_up(x: int, m: int) -> int:
  return (x + m - 1) // m * m


def _block_size(length) -> int:
  # A symbolic length (jax.export shape polymorphism) gets the full block:
  # the block count is then symbolic, the block shape static.
  if not isinstance(length, int):
    return BLOCK
  return min(BLOCK, _round_up(length, 8))


def _block_sizes(spec: AttentionSpec):
  return _block_size(spec.q_len), _block_size(spec.kv_len)


def _to_blocks(x, block, num_kv_heads):
  """[B, L, Hx, D] -> [n, B, H_kv, Hx/H_kv, block, D], zero-padded."""
  B, L, Hx, D = x.shape
  n = -(-L // block)
  x = jnp.pad(x, ((0, 0), (0, n * block - L), (0, 0), (0, 0)))
  x = x.reshape(B, n, block, num_kv_heads, Hx // num_kv_heads, D)
  return x.transpose(1, 0, 3, 4, 2, 5)


def _from_blocks(x, length):
  """Inverse of _to_blocks: [n, B, H_kv, G, block, D] -> [B, L, H, D]."""
  n, B, Hk, G, block, D = x.shape
  x = x.transpose(1, 0, 4, 2, 3, 5).reshape(B, n * block, Hk * G, D)
  return x[:, :length]


def _seg_blocks(seg, block):
  if seg is None:
    return None
  B, L = seg.shape
  n = -(-L // block)
  return jnp.pad(seg, ((0, 0), (0, n * block - L))).reshape(B, n, block).transpose(1, 0, 2)


def _block_mask(spec, i, j, bq, bk, qs_blk, ks_blk):
  """Visibility of (q block i, kv block j): [B or 1, 1, 1, bq, bk].

  qs_blk: the q block's segment ids [B, bq], or (ids, shifts) with
  spec.has_shifts (see `_seg_blocks`); ks_blk the kv block's ids.
  """
  q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  q_seg = k_seg = q_shift = None
  if qs_blk is not None:
    if isinstance(qs_blk, tuple):
      qs_blk, shift_blk = qs_blk
      q_shift = shift_blk[:, None, None, :, None]
    q_seg = qs_blk[:, None, None, :, None]
    k_seg = ks_blk[:, None, None, None, :]
  return masking.visible(spec, q_pos, k_pos, q_seg, k_seg, q_shift)


def _seen_only(mask, i, bq, q_len, *blocks):
  """The kv blocks [B, H_kv, 1, bk, D] with the keys that no query row of q
  block i sees set to 0. Such keys (past a length, in a segment no query has,
  outside every window) may hold anything, NaN included, and a product with
  their probability 0 would still give NaN; a key some row sees holds the
  caller's data. mask: _block_mask's [bq, bk] or [B or 1, 1, 1, bq, bk],
  None when every pair is visible."""
  if mask is None:
    return blocks
  real = (i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)) < q_len
  seen = jnp.any(mask & real, axis=-2)[..., None]  # [bk, 1] or [B|1, 1, 1, bk, 1]
  return tuple(jnp.where(seen, x, jnp.zeros((), x.dtype)) for x in blocks)


def _seeing_only(mask, q_blk):
  """The q block [B, H_kv, G, bq, D] with the rows that see no key of the
  kv block set to 0. Such rows (outside every sequence, in a segment without
  keys) may hold anything; their probabilities are 0, but their scores still
  meet the softcap's derivative and dS^T Q in the backward. mask as in
  `_seen_only`."""
  if mask is None:
    return q_blk
  seeing = jnp.any(mask, axis=-1)[..., None]  # [bq, 1] or [B|1, 1, 1, bq, 1]
  return jnp.where(seeing, q_blk, jnp.zeros((), q_blk.dtype))


def q_seg_blocks(q_seg, shifts, block):
  """The q side's per-block mask data: ids, or (ids, shifts) with shifts."""
  if q_seg is None or shifts is None:
    return _seg_blocks(q_seg, block)
  return _seg_blocks(q_seg, block), _seg_blocks(shifts[0], block)


def span_block_range(spans, i, first, last, block: int):
  """[first, last) narrowed to the blocks of `block` keys (or rows) that meet
  the span [lo, hi) of tile i (tile_spans.py, computed at this tile size)."""
  if spans is None:
    return first, last
  span = spans[:, i]  # [B, 4]
  lo, hi = span[:, 0].min(), span[:, 1].max()
  first = jnp.maximum(first, lo // block)
  last = jnp.minimum(last, -(-hi // block))
  return first, jnp.maximum(last, first)


def _spans(spec, q_seg, kv_seg, shifts, rows, kind):
  """The tile spans of tiles of `rows` (None without segment ids or with
  symbolic lengths, where only positions bound the loops)."""
  if q_seg is None or not isinstance(spec.q_len, int) or not isinstance(
      spec.kv_len, int):
    return None
  if kind == "q":
    return tile_spans.q_spans(spec, q_seg, kv_seg,
                              None if shifts is None else shifts[0], rows)
  return tile_spans.kv_spans(spec, q_seg, kv_seg,
                             None if shifts is None else shifts[1], rows)


def _precision(dtype):
  """float32/64 inputs get true float32/64 matmuls, not TF32 (GPU default)."""
  return (lax.Precision.HIGHEST
          if jnp.dtype(dtype) in (jnp.float32, jnp.float64) else None)


def _einsum(spec_str, a, b, acc):
  return jnp.einsum(spec_str, a, b, preferred_element_type=acc,
                    precision=_precision(a.dtype))


def _qk(q_blk, k_blk, acc):
  # q [B,Hk,G,bq,D], k [B,Hk,1,bk,D] -> [B,Hk,G,bq,bk]
  return _einsum("bhgqd,bhkd->bhgqk", q_blk, k_blk[:, :, 0], acc)


def _block_keep(spec, dropout_key, i, j, bq, bk, batch):
  """Attention dropout's keep mask of (q block i, kv block j), [B, H_kv, G,
  bq, bk] at global positions (core/dropout.py), or None without dropout."""
  if dropout_key is None:
    return None
  Hk, G = spec.num_kv_heads, spec.group_size
  b = lax.broadcasted_iota(jnp.int32, (batch, 1, 1, 1, 1), 0)
  h = (lax.broadcasted_iota(jnp.int32, (1, Hk, G, 1, 1), 1) * G +
       lax.broadcasted_iota(jnp.int32, (1, Hk, G, 1, 1), 2))
  rows = i * bq + lax.broadcasted_iota(jnp.int32, (1, 1, 1, bq, 1), 3)
  cols = j * bk + lax.broadcasted_iota(jnp.int32, (1, 1, 1, 1, bk), 4)
  return dropout_rng.tile_keep(spec, dropout_key, b, h, rows, cols)


def _sink_blocks(sinks, spec):
  """sinks [B, H] -> [B, H_kv, G, 1], the rows of a q block's state."""
  if sinks is None:
    return None
  return sinks.reshape(sinks.shape[0], spec.num_kv_heads, spec.group_size, 1)


def forward(spec: AttentionSpec, q, k, v, q_seg=None, kv_seg=None, *,
            shifts=None, dropout_key=None, sinks=None):
  """(o, lse). shifts: None, or (q_shift, kv_shift) with spec.has_shifts.
  dropout_key: None, or the key words (core/dropout.py key_words) with
  spec.has_dropout: O = (P * Z / (1 - rate)) V with the LSE of the undropped
  P. sinks: None, or [B, H] with spec.has_sinks (in every row's
  denominator; the lse includes them)."""
  acc_t = softmax.accum_dtype(q.dtype)
  B = q.shape[0]
  rate = spec.dropout_rate
  bq, bk = _block_sizes(spec)
  Hk = spec.num_kv_heads
  qb, kb, vb = (_to_blocks(x, b, Hk) for x, b in ((q, bq), (k, bk), (v, bk)))
  qsb, ksb = q_seg_blocks(q_seg, shifts, bq), _seg_blocks(kv_seg, bk)
  nk = kb.shape[0]
  spans = _spans(spec, q_seg, kv_seg, shifts, bq, "q")
  sink_rows = _sink_blocks(sinks, spec)

  def one_q_block(args):
    i, q_blk, qs_blk = args
    def body(j, state):
      ks_blk = None if ksb is None else ksb[j]
      mask = _block_mask(spec, i, j, bq, bk, qs_blk, ks_blk)
      k_blk, v_blk = _seen_only(mask, i, bq, spec.q_len, kb[j], vb[j])
      s = softmax.scores(spec, _qk(q_blk, k_blk, acc_t))
      keep = _block_keep(spec, dropout_key, i, j, bq, bk, B)
      pv = lambda p: _einsum("bhgqk,bhkd->bhgqd",
                             dropout_rng.apply(p, keep, rate).astype(v.dtype),
                             v_blk[:, :, 0], acc_t)
      return softmax.update(state, s, mask, pv)

    first, last = masking.kv_block_range(spec, i * bq, bq, bk, nk)
    first, last = span_block_range(spans, i, first, last, bk)
    state = softmax.init_state_like(q_blk, acc_t, v.shape[-1])
    if sink_rows is not None:
      state = softmax.with_sink(state, sink_rows)
    state = lax.fori_loop(first, last, body, state)
    o, lse = softmax.finalize(state)
    return o.astype(q.dtype), lse

  idx = jnp.arange(qb.shape[0], dtype=jnp.int32)
  xs = (idx, qb, qsb if qsb is not None else idx)
  if qsb is None:
    o, lse = lax.map(lambda a: one_q_block((a[0], a[1], None)), xs)
  else:
    o, lse = lax.map(one_q_block, xs)
  o = _from_blocks(o, spec.q_len)
  # lse [nq, B, Hk, G, bq] -> [B, H, T]
  nq, B = lse.shape[:2]
  lse = lse.transpose(1, 2, 3, 0, 4).reshape(B, spec.num_heads, nq * bq)
  lse = lse[:, :, :spec.q_len]
  return o, lse.astype(jnp.float64 if acc_t == jnp.float64 else jnp.float32)


def backward(spec: AttentionSpec, q, k, v, o, lse, do, delta, q_seg=None,
             kv_seg=None, *, shifts=None, dropout_key=None):
  """(dq, dk, dv); with dropout (forward's key) the mask is drawn again:
  dV = (P Z')^T dO, dS = P (Z' (dO V^T) - delta), Z' = Z / (1 - rate)."""
  del o  # only needed through delta
  acc_t = softmax.accum_dtype(q.dtype)
  B = q.shape[0]
  rate = spec.dropout_rate
  bq, bk = _block_sizes(spec)
  Hk, G = spec.num_kv_heads, spec.group_size
  qb, dob = _to_blocks(q, bq, Hk), _to_blocks(do, bq, Hk)
  kb, vb = _to_blocks(k, bk, Hk), _to_blocks(v, bk, Hk)
  qsb, ksb = q_seg_blocks(q_seg, shifts, bq), _seg_blocks(kv_seg, bk)
  nq, nk = qb.shape[0], kb.shape[0]
  spans = _spans(spec, q_seg, kv_seg, shifts, bk, "kv")

  def rows_to_blocks(x):  # [B, H, T] -> [nq, B, Hk, G, bq]
    B = x.shape[0]
    x = jnp.pad(x, ((0, 0), (0, 0), (0, nq * bq - spec.q_len)))
    return x.reshape(B, Hk, G, nq, bq).transpose(3, 0, 1, 2, 4)

  lseb = rows_to_blocks(lse.astype(acc_t))
  deltab = rows_to_blocks(delta.astype(acc_t))

  def one_kv_block(dq_acc, args):
    j, k_raw, v_raw, ks_blk = args

    def body(i, carry):
      dk, dv, dq_acc = carry
      do_blk = dob[i]
      qs_blk = None if qsb is None else jax.tree.map(lambda x: x[i], qsb)
      mask = _block_mask(spec, i, j, bq, bk, qs_blk, ks_blk)
      k_blk, v_blk = _seen_only(mask, i, bq, spec.q_len, k_raw, v_raw)
      q_blk = _seeing_only(mask, qb[i])
      k2, v2 = k_blk[:, :, 0], v_blk[:, :, 0]
      qk = _qk(q_blk, k_blk, acc_t)
      s = softmax.scores(spec, qk)
      p = softmax.probs_from_lse(s, lseb[i], mask)
      keep = _block_keep(spec, dropout_key, i, j, bq, bk, B)
      dv = dv + _einsum("bhgqk,bhgqd->bhkd",
                        dropout_rng.apply(p, keep, rate).astype(do.dtype), do_blk,
                        acc_t)
      dp = dropout_rng.apply(_einsum("bhgqd,bhkd->bhgqk", do_blk, v2, acc_t),
                             keep, rate)
      ds = p * (dp - deltab[i][..., None])
      ds = softmax.scores_grad(spec, qk, ds).astype(q.dtype)
      dk = dk + _einsum("bhgqk,bhgqd->bhkd", ds, q_blk, acc_t)
      dq_i = _einsum("bhgqk,bhkd->bhgqd", ds, k2, acc_t)
      dq_acc = dq_acc.at[i].add(dq_i)
      return dk, dv, dq_acc

    first, last = masking.q_block_range(spec, j * bk, bk, bq, nq)
    first, last = span_block_range(spans, j, first, last, bq)
    # *_like keeps k's and v's sharding
    zeros = lambda x: jnp.zeros_like(x[:, :, 0], dtype=acc_t)
    dk, dv, dq_acc = lax.fori_loop(first, last, body,
                                   (zeros(k_raw), zeros(v_raw), dq_acc))
    return dq_acc, (dk, dv)

  idx = jnp.arange(nk, dtype=jnp.int32)
  dq_acc = jnp.zeros_like(qb, dtype=acc_t)
  xs = (idx, kb, vb, ksb if ksb is not None else idx)
  if ksb is None:
    step = lambda c, a: one_kv_block(c, (a[0], a[1], a[2], None))
  else:
    step = one_kv_block
  dq_acc, (dk, dv) = lax.scan(step, dq_acc, xs)
  dq = _from_blocks(dq_acc, spec.q_len).astype(q.dtype)
  dk = _from_blocks(dk[:, :, :, None], spec.kv_len).astype(k.dtype)
  dv = _from_blocks(dv[:, :, :, None], spec.kv_len).astype(v.dtype)
  return dq, dk, dv


class XlaBackend:
  name = "xla"

  def check(self, spec: AttentionSpec, platform: str) -> None:
    # Every request the API accepts, everywhere (FP8 as the simulated
    # kernel, fp8/reference.py).
    del spec, platform

  forward = staticmethod(forward)
  backward = staticmethod(backward)


register("xla", XlaBackend)
