"""Online-softmax math, written once for the JAX backends (XLA and Pallas).

Scores are kept in base 2 internally where it pays (exp2 is the native
instruction on GPUs); the public LSE is natural-log. All state is float32
(float64 for float64 inputs).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax_flash._src.spec import AttentionSpec

LOG2E = math.log2(math.e)
NEG_INF = float("-inf")


def scores(spec: AttentionSpec, qk):
  """Scaled (and soft-capped) logits from raw q·k products (float32)."""
  s = qk * spec.scale
  if spec.softcap is not None:
    s = spec.softcap * jnp.tanh(s / spec.softcap)
  return s


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


def update(state, s, mask, pv_fn):
  """Fold one block of scores s [..., bq, bk] into (m, l, acc).

  `pv_fn(p)` returns p @ v for the block (shape of acc). Masked entries get
  probability exactly 0. A row that has seen no visible key keeps m = -inf;
  the `m_safe` trick avoids exp(-inf - -inf) = NaN for such rows.
  """
  m, l, acc = state
  s = jnp.where(mask, s, NEG_INF)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
  p = jnp.exp2((s - m_safe[..., None]) * LOG2E)
  alpha = jnp.exp2((m - m_safe) * LOG2E)  # rescales what was accumulated so far
  l_new = alpha * l + jnp.sum(p, axis=-1)
  acc_new = alpha[..., None] * acc + pv_fn(p)
  return m_new, l_new, acc_new


def finalize(state):
  """One division at the end. Fully masked rows: o = 0, lse = -inf."""
  m, l, acc = state
  empty = l == 0.0
  inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
  o = acc * inv[..., None]
  lse = jnp.where(empty, NEG_INF, m + jnp.log(jnp.where(empty, 1.0, l)))
  return o, lse


def probs_from_lse(s, lse, mask):
  """Recompute P = exp(s - lse) for the backward; 0 where masked/empty rows."""
  lse_safe = jnp.where(lse == NEG_INF, 0.0, lse)
  p = jnp.exp2((s - lse_safe[..., None]) * LOG2E)
  return jnp.where(mask, p, 0.0)
