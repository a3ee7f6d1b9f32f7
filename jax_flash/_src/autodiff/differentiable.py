"""One differentiable attention function for all backends.

`attention_fn(backend, spec)` is a `jax.custom_jvp`: its primal is the
backend's forward kernel; its JVP rule returns (o, lse) from that kernel and
the tangent from `derivatives.tangent_p`, a linear primitive whose transpose
is `derivatives.cotangent_p`, the backend's fused backward kernel. So

* `jax.jvp` / `jax.jacfwd` / `jax.linearize` run the forward kernel plus a
  blockwise JVP pass (tangent.py);
* `jax.grad` / `jax.vjp` linearize and transpose: forward kernel, then the
  backend's backward kernel with residuals (q, k, v, o, lse) and
  delta = rowsum(dO * O) - dLSE, as a custom_vjp would (the dLSE term makes
  `return_lse` outputs differentiable too);
* second and higher derivatives go through the primitives' JVP rules, i.e.
  the dense plain-JAX form of the same maps (derivatives.py).

Why not a custom_vjp (one fwd/bwd pair): JAX cannot apply forward mode to a
custom_vjp function, and a custom_vjp's backward has to be differentiable by
JAX itself for second derivatives (an opaque kernel is not). Why not
`jax.custom_transpose`: it is gone from jax 0.11 (derivatives.py says why not
linear_call either).

`attention_vjp` is the first-order custom_vjp around a whole (forward,
backward) pair that ring attention (ring.py) builds from its ring steps.
"""

from __future__ import annotations

import functools

import jax

from jax_flash._src.autodiff import derivatives
from jax_flash._src.core.batching import fold_into_batch
from jax_flash._src.autodiff.derivatives import CUSTOM_CALL_BACKENDS, softmax_delta
from jax_flash._src.core.spec import AttentionSpec

__all__ = ["attention_fn", "attention_vjp", "softmax_delta",
           "CUSTOM_CALL_BACKENDS"]


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


@functools.lru_cache(maxsize=None)
def attention_fn(backend_name: str, spec: AttentionSpec):
  """fn(q, k, v, *segment_ids) -> (o, lse), differentiable to any order in
  forward and reverse mode, and vmappable."""
  # custom_jvp(custom_vmap(custom_partitioning(forward kernel))): vmap folds
  # into batch first, then the (folded) call is partitioned.
  forward = fold_into_batch(derivatives.kernel_call("forward", backend_name,
                                                    spec))

  @jax.custom_jvp
  def attention(q, k, v, *segs):
    return forward(q, k, v, *segs)

  @attention.defjvp
  def attention_jvp(primals, tangents):
    # Calling `attention` (not `forward`) keeps outer tangents (nested
    # differentiation) on this rule instead of the opaque kernel.
    o, lse = attention(*primals)
    res = tuple(primals[:3]) + (o, lse) + tuple(primals[3:])
    do, dlse = derivatives.apply_tangent(backend_name, spec, res, tangents[:3])
    return (o, lse), (do, dlse)

  return attention
