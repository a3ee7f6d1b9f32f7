"""Blockwise forward-mode derivative of attention, in plain JAX.

With P = softmax(S) over the visible keys (S the masked, scaled, soft-capped
scores), O = P V and lse = logsumexp(S), a tangent (dQ, dK, dV) gives

    dS   = scores'(Q K^T) * (dQ K^T + Q dK^T)
    dlse = rowsum(P * dS)
    dO   = P dV + (P * (dS - dlse)) V = P dV + (P * dS) V - dlse O.

P is recomputed from the saved lse (P = exp(S - lse)), so there is no online
rescaling: one pass over the key blocks accumulates P dV + (P * dS) V and
rowsum(P * dS), O(seq) memory, and no T x S matrix is ever built. The map is
linear in (dQ, dK, dV); its transpose is the attention backward with
delta = rowsum(dO * O) - dlse (derivatives.py), which is why the backends' fused
backward can serve as the transpose.

Two loop shapes, one formula:
* `sparse=True` skips key blocks that no query of the block can see (dynamic
  trip counts, i.e. while loops): the fast first-order tangent.
* `sparse=False` visits every key block (static trip counts, i.e. scans, so
  JAX can differentiate and transpose it to any order) with the loop body
  rematerialised (`jax.checkpoint`), so that differentiating it saves no
  per-block probabilities. Derivatives of the derivatives use this one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash._src.core import masking
from jax_flash._src.core import softmax
from jax_flash._src.backends import xla
from jax_flash._src.core.spec import AttentionSpec


def _rows_to_blocks(x, nq, bq, spec):
  """[B, H, T] -> [nq, B, Hk, G, bq] (zero-padded rows)."""
  B = x.shape[0]
  x = jnp.pad(x, ((0, 0), (0, 0), (0, nq * bq - spec.q_len)))
  return x.reshape(B, spec.num_kv_heads, spec.group_size, nq,
                   bq).transpose(3, 0, 1, 2, 4)


def _rows_from_blocks(x, spec):
  """Inverse of _rows_to_blocks: [nq, B, Hk, G, bq] -> [B, H, T]."""
  nq, B, _, _, bq = x.shape
  x = x.transpose(1, 2, 3, 0, 4).reshape(B, spec.num_heads, nq * bq)
  return x[:, :, :spec.q_len]


def attention_tangent(spec: AttentionSpec, res, lin, *, sparse: bool):
  """(dO, dlse) for residuals res = (q, k, v, o, lse, q_seg, kv_seg[, q_shift,
  kv_shift]) and tangents lin = (dq, dk, dv); shapes as in spec.py (segments
  may be None).

  Linear in lin; dO has o's dtype, dlse lse's.
  """
  q, k, v, o, lse, q_seg, kv_seg = res[:7]
  shifts = tuple(res[7:9]) or None
  dq, dk, dv = lin
  acc_t = softmax.accum_dtype(q.dtype)
  bq, bk = xla._block_sizes(spec)
  Hk = spec.num_kv_heads
  qb, dqb, ob = (xla._to_blocks(x, bq, Hk) for x in (q, dq, o))
  kb, dkb, vb, dvb = (xla._to_blocks(x, bk, Hk) for x in (k, dk, v, dv))
  qsb, ksb = xla.q_seg_blocks(q_seg, shifts, bq), xla._seg_blocks(kv_seg, bk)
  nq, nk = qb.shape[0], kb.shape[0]
  lseb = _rows_to_blocks(lse.astype(acc_t), nq, bq, spec)
  qk = lambda a, b: xla._qk(a, b, acc_t)
  pv = lambda p, x: xla._einsum("bhgqk,bhkd->bhgqd", p.astype(x.dtype),
                                x[:, :, 0], acc_t)

  def one_q_block(args):
    i, q_blk, dq_blk, o_blk, lse_blk, qs_blk = args

    def body(j, carry):
      acc, dlse = carry
      ks_blk = None if ksb is None else ksb[j]
      mask = xla._block_mask(spec, i, j, bq, bk, qs_blk, ks_blk)
      # Keys no row sees and rows that see no key may hold anything (NaN
      # included): zeroed as in the xla backend, so 0 * NaN never forms.
      k_blk, dk_blk, v_blk, dv_blk = xla._seen_only(
          mask, i, bq, spec.q_len, kb[j], dkb[j], vb[j], dvb[j])
      q_b, dq_b = (xla._seeing_only(mask, x) for x in (q_blk, dq_blk))
      s_raw = qk(q_b, k_blk)
      # Masking the scores before the exp (not the probabilities after it)
      # keeps every derivative of P finite: exp(-inf) = 0 has derivative 0.
      s = jnp.where(mask, softmax.scores(spec, s_raw), softmax.NEG_INF)
      p = softmax.probs_from_lse(s, lse_blk, None)
      ds = softmax.scores_grad(spec, s_raw, qk(dq_b, k_blk) +
                               qk(q_b, dk_blk))
      pds = jnp.where(mask, p * ds, 0.0)
      return acc + pv(p, dv_blk) + pv(pds, v_blk), dlse + pds.sum(-1)

    init = (jnp.zeros_like(o_blk, dtype=acc_t),
            jnp.zeros_like(q_blk[..., 0], dtype=acc_t))
    if sparse:
      first, last = masking.kv_block_range(spec, i * bq, bq, bk, nk)
      acc, dlse = lax.fori_loop(first, last, body, init)
    else:
      acc, dlse = lax.fori_loop(0, nk, jax.checkpoint(body), init)
    do = acc - dlse[..., None] * o_blk.astype(acc_t)
    return do.astype(o.dtype), dlse

  idx = jnp.arange(nq, dtype=jnp.int32)
  no_segs = qsb is None
  xs = (idx, qb, dqb, ob, lseb, idx if no_segs else qsb)
  do, dlse = lax.map(
      lambda a: one_q_block(a[:5] + (None if no_segs else a[5],)), xs)
  return (xla._from_blocks(do, spec.q_len),
          _rows_from_blocks(dlse, spec).astype(lse.dtype))


def attention_cotangent(spec: AttentionSpec, res, ct):
  """(dq, dk, dv): the transpose of the dense `attention_tangent` applied to
  ct = (do, dlse), by JAX's own transposition (plain differentiable JAX; the
  reference the fused backends' backward is the fast form of)."""
  q, k, v = res[:3]
  lin = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
  transpose = jax.linear_transpose(
      lambda l: attention_tangent(spec, res, l, sparse=False), lin)
  return transpose(tuple(ct))[0]
