"""Online-softmax math, written once for the JAX backends (XLA and Pallas).

Scores are kept in base 2 internally where it pays (exp2 is the native
instruction on GPUs); the public LSE is natural-log. All state is float32
(float64 for float64 inputs).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax_flash._src.core.spec import AttentionSpec

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")


def scores(spec: AttentionSpec, qk):
  """Scaled (and soft-capped) logits from raw q·k products (float32)."""
  s = qk * spec.scale
  if spec.softcap is not None:
    s = spec.softcap * jnp.tanh(s / spec.softcap)
  return s


def scores_base2(spec: AttentionSpec, qk):
  """`scores(spec, qk) * LOG2E`, with the constants folded into one multiply.

  Kernels that run the online softmax in base 2 (`base2=True` below) use this,
  so each score costs one multiply before the exp2 instead of three.
  """
  if spec.softcap is None:
    return qk * (spec.scale * LOG2E)
  return (spec.softcap * LOG2E) * jnp.tanh(qk * (spec.scale / spec.softcap))


def scores_grad(spec: AttentionSpec, qk, ds):
  """Chain rule from d(scores) back to d(q·k)."""
  if spec.softcap is not None:
    t = jnp.tanh(qk * spec.scale / spec.softcap)
    ds = ds * (1.0 - t * t)
  return ds * spec.scale


def accum_dtype(dtype):
  """float64 inputs keep float64 state (for exact gradient checks)."""
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def init_state(shape_rows, head_dim_shape, dtype=jnp.float32):
  """(running max m, running sum l, unnormalised accumulator acc)."""
  m = jnp.full(shape_rows, NEG_INF, dtype)
  l = jnp.zeros(shape_rows, dtype)
  acc = jnp.zeros(head_dim_shape, dtype)
  return m, l, acc


def init_state_like(x, dtype=jnp.float32, head_dim=None):
  """`init_state` for rows of x [..., rows, D], keeping x's sharding; the
  accumulator has `head_dim` columns (default D: the value head dim, where
  it differs from the query's).

  Under explicitly sharded meshes a loop carry must keep the sharding of the
  values flowing into it; *_like constructors inherit it from x.
  """
  m = jnp.full_like(x[..., 0], NEG_INF, dtype=dtype)
  l = jnp.zeros_like(x[..., 0], dtype=dtype)
  acc = jnp.zeros_like(x, dtype=dtype)
  if head_dim is not None and head_dim != x.shape[-1]:
    acc = jnp.broadcast_to(acc[..., :1], x.shape[:-1] + (head_dim,))
  return m, l, acc


def _to_base2(x, base2: bool):
  return x if base2 else x * LOG2E


def update(state, s, mask, pv_fn, *, base2: bool = False):
  """Fold one block of scores s [..., bq, bk] into (m, l, acc).

  `pv_fn(p)` returns p @ v for the block (shape of acc). Masked entries get
  probability exactly 0. A row that has seen no visible key keeps m = -inf;
  the `m_safe` trick avoids exp(-inf - -inf) = NaN for such rows.
  `mask=None` means every entry is visible (kernels skip the select on
  interior blocks). With `base2=True`, s (and so m) are already multiplied by
  LOG2E (see `scores_base2`), which saves a multiply per score.
  """
  m, l, acc = state
  if mask is not None:
    s = jnp.where(mask, s, NEG_INF)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
  p = jnp.exp2(_to_base2(s - m_safe[..., None], base2))
  # rescales what was accumulated so far
  alpha = jnp.exp2(_to_base2(m - m_safe, base2))
  l_new = alpha * l + jnp.sum(p, axis=-1)
  acc_new = alpha[..., None] * acc + pv_fn(p)
  return m_new, l_new, acc_new


def with_sink(state, sink, *, base2: bool = False):
  """Fold in a learnable attention sink: one more key per row, of logit
  `sink` (broadcastable to the rows; natural-log units, as the scores of
  `scores`) and value 0. It adds exp(sink) to the row's denominator and
  nothing to its numerator, so a row that sees no key ends with o = 0 and
  lse = sink. A sink of -inf is no sink.
  """
  m = state[0]
  s = jnp.broadcast_to(jnp.asarray(sink, m.dtype), m.shape)[..., None]
  if base2:
    s = s * LOG2E
  return update(state, s, None, lambda p: jnp.zeros((), m.dtype), base2=base2)


def finalize(state, *, base2: bool = False):
  """One division at the end. Fully masked rows: o = 0, lse = -inf.

  The returned lse is natural-log; with `base2=True` the state's m is in
  base 2 (as produced by `update(..., base2=True)`).
  """
  m, l, acc = state
  empty = l == 0.0
  inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
  o = acc * inv[..., None]
  l_safe = jnp.where(empty, 1.0, l)
  if base2:
    lse = (m + jnp.log2(l_safe)) * LN2
  else:
    lse = m + jnp.log(l_safe)
  lse = jnp.where(empty, NEG_INF, lse)
  return o, lse


def probs_from_lse(s, lse, mask, *, base2: bool = False,
                   transposed: bool = False):
  """Recompute P = exp(s - lse) for the backward; 0 where masked/empty rows.

  lse is natural-log (the saved residual) either way; `base2=True` means s
  comes from `scores_base2`. `transposed=True` means s is [..., bk, bq] (keys
  on rows, as a dK/dV kernel computes it), so lse broadcasts along rows.
  `mask=None` means every entry is visible.
  """
  lse_safe = jnp.where(lse == NEG_INF, 0.0, lse)
  if base2:
    lse_safe = lse_safe * LOG2E  # per row: cheaper than scaling every score
  lse_b = lse_safe[..., None, :] if transposed else lse_safe[..., None]
  p = jnp.exp2(_to_base2(s - lse_b, base2))
  return p if mask is None else jnp.where(mask, p, 0.0)


def merge_partials(a, b):
  """Online-softmax ⊕ of two partial results over disjoint key sets.

  a, b = (o [B, T, H, D], lse [B, H, T]) with o normalised and lse
  natural-log, as a backend's forward returns them (in the accumulation
  dtype). lse = logaddexp(lse_a, lse_b), o = e^(lse_a - lse) o_a +
  e^(lse_b - lse) o_b. Rows empty on both sides stay o = 0, lse = -inf
  (the `safe` trick again avoids -inf - -inf = NaN).
  """
  (o_a, lse_a), (o_b, lse_b) = a, b
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
  w = lambda l: jnp.swapaxes(jnp.exp(l - safe), 1, 2)[..., None]
  return w(lse_a) * o_a + w(lse_b) * o_b, lse
