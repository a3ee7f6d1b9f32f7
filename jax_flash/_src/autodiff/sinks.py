"""The derivative of attention with respect to its learnable sinks.

With a sink logit c per (batch, head) the softmax of a row is
P_j = exp(s_j - lse), lse = log(exp(c) + sum_j exp(s_j)), and the sink's own
share of the mass is p_c = exp(c - lse); it takes no value, O = sum_j P_j V_j.
So

    d lse / d c = p_c,     d O / d c = -p_c O,

and for cotangents (dO, dLSE)

    dL/dc = sum_t p_c (dLSE - rowsum(dO * O)) = -sum_t p_c delta,

delta the backward's own rowsum(dO * O) - dLSE. The sinks never enter the
backward kernels: with the sink in the lse, P and delta there are already
right (spec.py). `sink_tangent` is the forward-mode map, written once; the
reverse mode is its transpose (`sink_cotangent`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sink_share(sinks, lse):
  """p_c = exp(sink - lse) [B, H, T] in lse's dtype; 0 where lse = -inf (a
  sink of -inf, i.e. none, on a row that sees no key)."""
  sinks = sinks.astype(lse.dtype)[..., None]
  finite = jnp.isfinite(lse)
  return jnp.where(finite, jnp.exp(sinks - jnp.where(finite, lse, 0.0)), 0.0)


def sink_tangent(sinks, o, lse, dsinks):
  """(dO, dLSE) of a sink tangent dsinks [B, H]; o [B, T, H, D_v], lse
  [B, H, T]. Linear in dsinks."""
  p = sink_share(sinks, lse) * dsinks.astype(lse.dtype)[..., None]
  do = -jnp.swapaxes(p, 1, 2)[..., None] * o.astype(lse.dtype)
  return do.astype(o.dtype), p


def sink_cotangent(sinks, o, lse, do, dlse):
  """dL/dsinks [B, H] (sinks' dtype) of cotangents (dO, dLSE): the
  transpose of `sink_tangent`."""
  zero = jax.ShapeDtypeStruct(sinks.shape, sinks.dtype)
  transpose = jax.linear_transpose(
      lambda ds: sink_tangent(sinks, o, lse, ds), zero)
  return transpose((do.astype(o.dtype), dlse.astype(lse.dtype)))[0]
