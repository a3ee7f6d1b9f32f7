"""The one way to make an attention op differentiable: `differentiable`.

An op is described by its kernels (`Kernels`): a forward fn(*operands) ->
(o, lse) and a backward fn(q, k, v, o, lse, do, delta, *rest) -> (dq, dk,
dv), with delta = rowsum(dO * O) - dLSE (`softmax_delta`, so that `lse`
outputs are differentiable too). The operands are q, k, v (differentiable)
and `rest`: integer or key arrays (segment ids, shifts, dropout key words,
descales...) that get no cotangent, led, for an op with learnable sinks
(`Kernels.sinks`), by the sink logits [B, H]: differentiable too, an operand
of the forward (and of a backward that recomputes it); their derivative is
sinks.py's, the same for every op.

With `spec` (the AttentionSpec whose math the kernels compute; rest = its
mask operands), the op is a `jax.custom_jvp`: its primal is the forward
kernel; its JVP rule returns (o, lse) from that kernel and the tangent from
`derivatives.tangent_p`, a linear primitive whose transpose is
`derivatives.cotangent_p`, the op's backward kernel. So

* `jax.jvp` / `jax.jacfwd` / `jax.linearize` run the forward kernel plus a
  blockwise JVP pass (tangent.py);
* `jax.grad` / `jax.vjp` linearize and transpose: forward kernel, then the
  backward kernel with residuals (q, k, v, o, lse) and delta, as a
  custom_vjp would;
* second and higher derivatives go through the primitives' JVP rules, i.e.
  the dense plain-JAX form of the same maps (derivatives.py);
* vmap folds into the batch axis (one kernel call).

Why not a custom_vjp there: JAX cannot apply forward mode to a custom_vjp
function, and a custom_vjp's backward has to be differentiable by JAX itself
for second derivatives (an opaque kernel is not). Why not
`jax.custom_transpose`: it is gone from jax 0.11 (derivatives.py says why
not linear_call either).

Without `spec` (ops with no forward-mode rule, e.g. dropout's and the
ring's) the op is a `jax.custom_vjp`: first-order reverse mode; jax.jvp
raises JAX's custom_vjp error.

`attention_fn(backend, spec)` is the op of one backend's kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax

from jax_flash._src.autodiff import derivatives
from jax_flash._src.autodiff.derivatives import softmax_delta
from jax_flash._src.autodiff.kernels import kernel_call
from jax_flash._src.autodiff.sinks import sink_cotangent, sink_tangent
from jax_flash._src.core.batching import fold_into_batch
from jax_flash._src.core.spec import AttentionSpec

__all__ = ["Kernels", "differentiable", "attention_fn", "softmax_delta"]

N_DIFF = 3  # q, k, v


@dataclasses.dataclass(frozen=True)
class Kernels:
  """What `differentiable` builds an op from (see the module docstring).

  forward: fn(q, k, v, *rest) -> (o, lse).
  backward: fn(q, k, v, o, lse, do, delta, *rest) -> (dq, dk, dv); do comes
    in o's dtype.
  spec: given, forward mode and derivatives of any order (rest must then be
    the spec's mask operands); None: first-order reverse mode.
  fold_vmap: vmap of the forward folds the mapped axis into the batch (one
    kernel call; operands batch-major, rest included).
  delta: False gives the backward the raw cotangents (do, dlse) in place of
    (do in o's dtype, delta): for a backward that is not attention's own
    (FP8's straight-through gradient, a reference path that recomputes the
    forward); first-order only.
  sinks: rest[0] is the sink logits [B, H] (differentiable): the forward
    takes them, the lse it returns includes them, and their cotangent is
    sinks.py's. Attention's own backward (delta=True) does not take them
    (rest less the sinks: the lse is all it needs); a delta=False backward
    gets them (a recomputed forward needs them) but returns no cotangent
    for them.
  """

  forward: Callable
  backward: Callable
  spec: AttentionSpec | None = None
  fold_vmap: bool = False
  delta: bool = True
  sinks: bool = False


def differentiable(kernels: Kernels):
  """fn(q, k, v, *rest) -> (o, lse), differentiable in q, k and v."""
  forward = kernels.forward
  if kernels.fold_vmap:
    forward = fold_into_batch(forward)
  if kernels.spec is None:
    return _first_order(forward, kernels.backward, kernels.delta,
                        kernels.sinks)
  if not kernels.delta:
    raise ValueError("Kernels(spec=..., delta=False): the tangent primitives "
                     "transpose to the delta form only")
  return _any_order(forward, kernels.backward, kernels.spec, kernels.sinks)


def _first_order(forward, backward, with_delta, with_sinks):
  @jax.custom_vjp
  def attention(q, k, v, *rest):
    return forward(q, k, v, *rest)

  def attention_fwd(q, k, v, *rest):
    o, lse = forward(q, k, v, *rest)
    return (o, lse), (q, k, v, o, lse, rest)

  def attention_bwd(res, cotangents):
    q, k, v, o, lse, rest = res
    do, dlse = cotangents
    dsinks = ()
    if with_sinks:
      dsinks = (sink_cotangent(rest[0], o, lse, do, dlse),)
    masks = rest[len(dsinks):]  # no cotangent
    if with_delta:
      do, dlse = do.astype(o.dtype), softmax_delta(o, do, dlse)
      rest = masks
    dq, dk, dv = backward(q, k, v, o, lse, do, dlse, *rest)
    return (dq, dk, dv) + dsinks + tuple(None for _ in masks)

  attention.defvjp(attention_fwd, attention_bwd)
  return attention


def _any_order(forward, backward, spec, with_sinks):
  @jax.custom_jvp
  def attention(q, k, v, *rest):
    return forward(q, k, v, *rest)

  @attention.defjvp
  def attention_jvp(primals, tangents):
    # Calling `attention` (not `forward`) keeps outer tangents (nested
    # differentiation) on this rule instead of the opaque kernel.
    o, lse = attention(*primals)
    rest = tuple(primals[N_DIFF:])
    if with_sinks:
      sinks, rest = rest[0], rest[1:]
    res = tuple(primals[:N_DIFF]) + (o, lse) + rest
    do, dlse = derivatives.apply_tangent(spec, backward, res,
                                         tangents[:N_DIFF])
    if with_sinks:
      # Plain JAX in (sinks, o, lse): JAX transposes it for reverse mode
      # and differentiates it again for higher orders.
      do_s, dlse_s = sink_tangent(sinks, o, lse, tangents[N_DIFF])
      do, dlse = do + do_s, dlse + dlse_s
    return (o, lse), (do, dlse)

  return attention


@functools.lru_cache(maxsize=None)
def attention_fn(backend_name: str, spec: AttentionSpec):
  """fn(q, k, v, [sinks,] *masks, *dropout_key) -> (o, lse) of one backend's kernels
  (operands as kernels.py), vmappable; differentiable to any order in forward
  and reverse mode, or (dropout: the mask follows each call's key, which a
  folded vmap or a forward-mode rule would not keep) first-order reverse mode.
  """
  forward = kernel_call("forward", backend_name, spec)
  backward = kernel_call("backward", backend_name, spec)
  if spec.has_dropout:
    return differentiable(Kernels(forward, backward, sinks=spec.has_sinks))
  # custom_jvp(custom_vmap(custom_partitioning(forward kernel))): vmap folds
  # into batch first, then the (folded) call is partitioned.
  return differentiable(Kernels(forward, backward, spec=spec, fold_vmap=True,
                                sinks=spec.has_sinks))
