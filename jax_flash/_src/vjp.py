"""One custom_vjp for all backends (and for ring attention).

Residuals are (q, k, v, o, lse). The backward computes
delta = rowsum(dO * O) - dLSE once here (an XLA fusion, fp32), so every
backend's backward sees the same inputs; the dLSE term makes `return_lse`
outputs differentiable too (d lse / d s = P, so it folds into delta).
`attention_vjp` builds that custom_vjp around any (forward, backward) pair:
`attention_fn` for one backend call, ring.py for a whole ring.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_flash._src import backends, sharding
from jax_flash._src.batching import fold_into_batch
from jax_flash._src.spec import AttentionSpec


def softmax_delta(o, do, dlse):
  """delta[b, h, t] = sum_d do*o - dlse, float32 (float64 for float64 o)."""
  acc = jnp.float64 if o.dtype == jnp.float64 else jnp.float32
  d = jnp.einsum("bthd,bthd->bht", do.astype(acc), o.astype(acc),
                 precision=jax.lax.Precision.HIGHEST)  # not TF32 on GPU
  return d - dlse.astype(acc)


def attention_vjp(forward, backward):
  """custom_vjp fn(q, k, v, *segs) -> (o, lse) of a forward and its backward.

  forward(q, k, v, *segs) -> (o, lse); backward(q, k, v, o, lse, do, delta,
  *segs) -> (dq, dk, dv), with delta from `softmax_delta` (so the cotangent
  of lse is honoured) and do in o's dtype.
  """

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


# Backends whose calls are opaque to XLA (pallas_call, FFI custom calls); their
# forward and backward get a custom_partitioning rule (sharding.partitioned).
CUSTOM_CALL_BACKENDS = frozenset({"pallas", "cuda"})


@functools.lru_cache(maxsize=None)
def attention_fn(backend_name: str, spec: AttentionSpec):
  """fn(q, k, v, *segment_ids) -> (o, lse), differentiable and vmappable."""
  backend = backends.get(backend_name)

  def _forward(local, q, k, v, *segs):
    q_seg, kv_seg = segs if segs else (None, None)
    return tuple(backend.forward(local, q, k, v, q_seg, kv_seg))

  def _backward(local, q, k, v, o, lse, do, delta, *segs):
    q_seg, kv_seg = segs if segs else (None, None)
    return tuple(
        backend.backward(local, q, k, v, o, lse, do, delta, q_seg, kv_seg))

  if backend_name in CUSTOM_CALL_BACKENDS:
    # Opaque kernel calls: tell the partitioner they split over batch/heads.
    fwd_call = sharding.partitioned("forward", spec, _forward)
    bwd_call = sharding.partitioned("backward", spec, _backward)
  else:  # plain JAX: XLA partitions it like any other computation
    fwd_call = lambda *a: _forward(sharding.local_spec(spec, a[0].shape,
                                                       a[1].shape), *a)
    bwd_call = lambda *a: _backward(sharding.local_spec(spec, a[0].shape,
                                                        a[1].shape), *a)
  # custom_vjp(custom_vmap(custom_partitioning(backend call))): vmap folds
  # into batch first, then the (folded) call is partitioned.
  forward = fold_into_batch(fwd_call)
  backward = fold_into_batch(bwd_call)
  return attention_vjp(forward, backward)
