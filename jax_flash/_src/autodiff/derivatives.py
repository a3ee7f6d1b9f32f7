"""The two linear maps of attention's derivative, as mutually transposed primitives.

For residuals r = (q, k, v, o, lse, *segment_ids):

* `tangent_p`   (dq, dk, dv) -> (do, dlse)   forward mode (tangent.py's
  blockwise JVP, plain JAX, the same for every backend);
* `cotangent_p` (do, dlse) -> (dq, dk, dv)   reverse mode: the op's own
  fused backward kernel with delta = rowsum(do * o) - dlse.

Both carry two static parameters: `spec` (the AttentionSpec whose math they
compute) and `backward` (the op's backward kernel, fn(q, k, v, o, lse, do,
delta, *segment_ids) -> (dq, dk, dv); differentiable.py builds it).

Each is linear in its last operands and is the other's transpose, so
`jax.grad` (linearize, then transpose `tangent_p`) runs exactly the backend
backward that a custom_vjp would, and `jax.jvp` runs the blockwise JVP.

Why primitives and not `jax.custom_derivatives.linear_call`: linear_call has no
batching rule (vmap of a Hessian-vector product fails) and its JVP rule
rejects tangents of the residuals (every second derivative needs them). Each
primitive here has all four rules:

* transpose: the other primitive;
* JVP: the primitive itself on the tangent of its linear operands, plus the
  derivative with respect to the residuals through the dense, differentiable
  plain-JAX form (tangent.py, `sparse=False`; cotangents by JAX's own
  transposition of it). Second and higher derivatives are therefore plain
  JAX, exact to any order, O(seq) memory (the loop bodies are rematerialised);
* batching: vmapped axes fold into the batch axis (one kernel call);
* lowering: the implementation, traced (mlir.lower_fun).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax._src.dispatch  # noqa: F401  (prim_requires_devices_during_lowering)
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_flash._src.sharding import partition as sharding
from jax_flash._src.autodiff import tangent as blockwise
from jax_flash._src.core.spec import AttentionSpec

N_FLOAT_RES = 5  # q, k, v, o, lse; then 0, 2 (segment ids) or 4 (+ shifts) int arrays


def softmax_delta(o, do, dlse):
  """delta[b, h, t] = sum_d do*o - dlse, float32 (float64 for float64 o)."""
  acc = jnp.float64 if o.dtype == jnp.float64 else jnp.float32
  d = jnp.einsum("bthd,bthd->bht", do.astype(acc), o.astype(acc),
                 precision=jax.lax.Precision.HIGHEST)  # not TF32 on GPU
  return d - dlse.astype(acc)


def _split(args, n_lin):
  return tuple(args[:-n_lin]), tuple(args[-n_lin:])


def _res7(res):
  """(q, k, v, o, lse, q_seg, kv_seg[, q_shift, kv_shift]) with None
  segments when absent."""
  segs = tuple(res[N_FLOAT_RES:]) or (None, None)
  return tuple(res[:N_FLOAT_RES]) + segs


def _local(spec, res):
  return sharding.local_spec(spec, res[0].shape, res[1].shape)


# ---------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------


def _tangent_impl(*args, spec, backward):
  del backward  # one blockwise JVP serves every backend
  res, lin = _split(args, 3)
  return blockwise.attention_tangent(_local(spec, res), _res7(res), lin,
                                   sparse=True)


def _cotangent_impl(*args, spec, backward):
  del spec  # the kernel takes the local spec of its operands' shapes
  res, (do, dlse) = _split(args, 2)
  q, k, v, o, lse = res[:N_FLOAT_RES]
  delta = softmax_delta(o, do, dlse)
  return backward(q, k, v, o, lse, do.astype(o.dtype), delta,
                  *res[N_FLOAT_RES:])


tangent_p = Primitive("jax_flash_attention_tangent")
cotangent_p = Primitive("jax_flash_attention_cotangent")
for _p, _impl in ((tangent_p, _tangent_impl), (cotangent_p, _cotangent_impl)):
  _p.multiple_results = True
  _p.def_impl(_impl)
  mlir.register_lowering(_p, mlir.lower_fun(_impl, multiple_results=True))
# cotangent_p lowers to the op's backward, which for opaque kernels is a
# custom_partitioning call. jax gives a computation its devices at lowering
# only when a primitive in its jaxpr asks for them, and it cannot see inside
# this lowering rule: a jitted backward holding nothing but cotangent_p (the
# backward of `jax.vjp(jax.jit(f))`) would lower without devices and fail in
# custom_partitioning. Declare that this primitive needs them too.
_requires_devices = getattr(jax._src.dispatch,
                            "prim_requires_devices_during_lowering", None)
if _requires_devices is not None:
  _requires_devices.add(cotangent_p)
# Outputs have the avals of (o, lse), resp. (q, k, v).
tangent_p.def_abstract_eval(lambda *avals, **_: (avals[3], avals[4]))
cotangent_p.def_abstract_eval(lambda *avals, **_: tuple(avals[:3]))


def apply_tangent(spec: AttentionSpec, backward, res, lin):
  """(do, dlse) = J(res) @ (dq, dk, dv)."""
  return tuple(tangent_p.bind(*res, *lin, spec=spec, backward=backward))


def apply_cotangent(spec: AttentionSpec, backward, res, ct):
  """(dq, dk, dv) = J(res)^T @ (do, dlse)."""
  return tuple(cotangent_p.bind(*res, *ct, spec=spec, backward=backward))


# ---------------------------------------------------------------------------
# Transposes: each primitive is the other's
# ---------------------------------------------------------------------------


def _transpose_rule(other, n_lin):
  def rule(cts, *args, spec, backward):
    res, lin = _split(args, n_lin)
    assert not any(ad.is_undefined_primal(x) for x in res)
    if all(type(ct) is ad.Zero for ct in cts):
      return [None] * len(args)
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    out = other.bind(*res, *cts, spec=spec, backward=backward)
    return [None] * len(res) + [
        g if ad.is_undefined_primal(x) else None for g, x in zip(out, lin)]
  return rule


ad.primitive_transposes[tangent_p] = _transpose_rule(cotangent_p, 3)
ad.primitive_transposes[cotangent_p] = _transpose_rule(tangent_p, 2)


# ---------------------------------------------------------------------------
# JVPs: fused primitive on the linear operands, plain JAX on the residuals
# ---------------------------------------------------------------------------


def _dense_tangent(spec, res, lin):
  return blockwise.attention_tangent(spec, res, lin, sparse=False)


def _jvp_rule(prim, n_lin, dense_fn):
  def rule(primals, tangents, *, spec, backward):
    res, lin = _split(primals, n_lin)
    res_dot, lin_dot = _split(tangents, n_lin)
    out = prim.bind(*primals, spec=spec, backward=backward)
    terms = []
    if any(type(t) is not ad.Zero for t in lin_dot):
      terms.append(prim.bind(*res, *map(ad.instantiate_zeros, lin_dot),
                             spec=spec, backward=backward))
    float_dot = res_dot[:N_FLOAT_RES]  # segment ids have no tangent
    if any(type(t) is not ad.Zero for t in float_dot):
      local, segs = _local(spec, res), _res7(res)[N_FLOAT_RES:]
      at_res = lambda *r: dense_fn(local, r + segs, lin)
      _, t = jax.jvp(at_res, res[:N_FLOAT_RES],
                     tuple(map(ad.instantiate_zeros, float_dot)))
      terms.append(tuple(t))
    if not terms:
      return out, [ad.Zero(jax.typeof(x).to_tangent_aval()) for x in out]
    total = [sum(ts[1:], ts[0]) for ts in zip(*terms)]
    return out, total
  return rule


ad.primitive_jvps[tangent_p] = _jvp_rule(tangent_p, 3, _dense_tangent)
ad.primitive_jvps[cotangent_p] = _jvp_rule(cotangent_p, 2,
                                           blockwise.attention_cotangent)


# ---------------------------------------------------------------------------
# vmap: fold the mapped axis into the batch axis
# ---------------------------------------------------------------------------


def _batching_rule(prim):
  def rule(args, dims, *, spec, backward):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    moved = [jnp.broadcast_to(x, (size,) + x.shape) if d is None else
             jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]
    B = moved[0].shape[1]
    flat = [x.reshape((size * B,) + x.shape[2:]) for x in moved]
    spec = dataclasses.replace(spec, batch=size * B)
    outs = prim.bind(*flat, spec=spec, backward=backward)
    return [o.reshape((size, B) + o.shape[1:]) for o in outs], [0] * len(outs)
  return rule


batching.primitive_batchers[tangent_p] = _batching_rule(tangent_p)
batching.primitive_batchers[cotangent_p] = _batching_rule(cotangent_p)
