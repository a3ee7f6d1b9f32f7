"""One custom_vjp for all backends.

Residuals are (q, k, v, o, lse). The backward computes
delta = rowsum(dO * O) - dLSE once here (an XLA fusion, fp32), so every
backend's backward sees the same inputs; the dLSE term makes `return_lse`
outputs differentiable too (d lse / d s = P, so it folds into delta).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_flash._src import backends
from jax_flash._src.batching import fold_into_batch
from jax_flash._src.spec import AttentionSpec


def softmax_delta(o, do, dlse):
  """delta[b, h, t] = sum_d do*o - dlse, float32 (float64 for float64 o)."""
  acc = jnp.float64 if o.dtype == jnp.float64 else jnp.float32
  d = jnp.einsum("bthd,bthd->bht", do.astype(acc), o.astype(acc),
                 precision=jax.lax.Precision.HIGHEST)  # not TF32 on GPU
  return d - dlse.astype(acc)


@functools.lru_cache(maxsize=None)
def attention_fn(backend_name: str, spec: AttentionSpec):
  """fn(q, k, v, *segment_ids) -> (o, lse), differentiable and vmappable."""
  backend = backends.get(backend_name)

  def _forward(q, k, v, *segs):
    q_seg, kv_seg = segs if segs else (None, None)
    return tuple(backend.forward(spec, q, k, v, q_seg, kv_seg))

  def _backward(q, k, v, o, lse, do, delta, *segs):
    q_seg, kv_seg = segs if segs else (None, None)
    return tuple(
        backend.backward(spec, q, k, v, o, lse, do, delta, q_seg, kv_seg))

  forward = fold_into_batch(_forward)
  backward = fold_into_batch(_backward)

  @jax.custom_vjp
  def attention(q, k, v, *segs):
    return forward(q, k, v, *segs)

  def attention_fwd(q, k, v, *segs):
    o, lse = forward(q, k, v, *segs)
    return (o, lse), (q, k, v, o, lse, segs)

  def attention_bwd(res, cotangents):
    q, k, v, o, lse, segs = res
    do, dlse = cotangents
    delta = softmax_delta(o, do, dlse)
    dq, dk, dv = backward(q, k, v, o, lse, do.astype(o.dtype), delta, *segs)
    # Integer segment ids get no cotangent.
    return (dq, dk, dv) + tuple(None for _ in segs)

  attention.defvjp(attention_fwd, attention_bwd)
  return attention
