"""Forward-mode and higher-order autodiff of jax_flash.attention.

Every derivative (jvp, linearize, jacfwd, jacrev, hessian, HVPs under vmap,
check_grads to order 2 in both modes) is compared with the same derivative of
a dense float64 attention written in jnp (the mask from reference.py), on
fresh random inputs at odd sizes (T != S, GQA) with causal, window, softcap,
segment ids and return_lse. Reverse mode must still run the backend's fused
backward: the jaxpr of jax.grad holds that backend's cotangent primitive and
the backend's `backward` is what it calls, and no T x S array is built.

Pallas runs in interpret mode on CPU (head_dim >= 32, so a few cases only);
the `gpu` tests run the same checks on implementation="cuda".
"""

from __future__ import annotations

import collections
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash
import reference
from jax_flash._src.backends import registry as backends
from jax_flash._src.autodiff import derivatives
from jax_flash._src.autodiff import kernels
from reference import enable_x64

F64_TOL = dict(rtol=1e-9, atol=1e-9)

# (B, T, S, H, Hk, D): odd lengths, T != S, GQA.
SMALL = (2, 5, 7, 4, 2, 3)
PALLAS = (1, 5, 7, 2, 1, 32)  # the smallest head_dim Pallas serves

CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(2, 1)),
    "softcap_causal": dict(softcap=1.5, causal=True),
    "segments": dict(segments=True),
    "lse": dict(return_lse=True, window=(3, -1)),
}


def dense_attention(q, k, v, *, causal=False, window=None, softcap=None,
                    segment_ids=None, return_lse=False, scale=None):
  """Differentiable dense attention in jnp (any dtype; float64 here).

  Masked entries get -inf before the exp and fully masked rows give o = 0,
  lse = -inf, with finite derivatives everywhere.
  """
  B, T, H, D = q.shape
  S, Hk = k.shape[1], k.shape[2]
  scale = 1 / np.sqrt(D) if scale is None else scale
  k, v = (jnp.repeat(x, H // Hk, axis=2) for x in (k, v))
  s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  q_seg = kv_seg = None
  if segment_ids is not None:
    q_seg, kv_seg = segment_ids
  m = jnp.asarray(reference.mask(T, S, causal=causal, window=window,
                                 q_seg=q_seg, kv_seg=kv_seg))[:, None]
  s = jnp.where(m, s, -jnp.inf)
  mx = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  e = jnp.exp(s - mx)
  l = e.sum(-1, keepdims=True)
  has = l > 0
  o = jnp.einsum("bhts,bshd->bthd", e / jnp.where(has, l, 1.0), v)
  if not return_lse:
    return o
  lse = jnp.where(has, jnp.log(jnp.where(has, l, 1.0)) + mx, -jnp.inf)
  return o, lse[..., 0]


def _inputs(rng, shape, case, dtype=np.float64):
  B, T, S, H, Hk, D = shape
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  q, k, v = mk(B, T, H, D), mk(B, S, Hk, D), mk(B, S, Hk, D)
  kw = dict(CASES[case])
  if kw.pop("segments", False):
    # Two segments each; some query rows may see no key of their segment.
    q_seg = jnp.asarray(rng.integers(0, 2, (B, T)), jnp.int32)
    kv_seg = jnp.asarray(rng.integers(0, 2, (B, S)), jnp.int32)
    kw["segment_ids"] = (q_seg, kv_seg)
  return (q, k, v), kw


def _pair(impl, kw):
  """(jax_flash function, dense reference) of (q, k, v)."""
  f = lambda q, k, v: jax_flash.attention(q, k, v, implementation=impl, **kw)
  ref = lambda q, k, v: dense_attention(q, k, v, **kw)
  return f, ref


def _tangents(rng, args):
  return tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype)
               for x in args)


def _close(a, b, tol=F64_TOL):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    finite = np.isfinite(y)
    np.testing.assert_array_equal(np.isfinite(x), finite)
    np.testing.assert_allclose(x[finite], y[finite], **tol)


def _sum_sq(fn):
  """A scalar loss of every output (o and, if returned, lse)."""
  def loss(*args):
    out = fn(*args)
    leaves = jax.tree.leaves(out)
    return sum(jnp.sum(jnp.where(jnp.isfinite(x), x, 0.0) ** 2)
               for x in leaves)
  return loss


@pytest.fixture(params=["xla", "pallas"])
def impl(request):
  _available(request.param, float64="x64" in request.fixturenames)
  return request.param


def _available(impl, float64=True):
  if impl not in jax_flash.available_implementations():
    pytest.skip(f"implementation {impl!r} is not registered")
  if float64 and impl == "pallas" and jax.default_backend() != "cpu":
    pytest.skip("Pallas has no float64 on GPU (interpret mode on CPU has); "
                "the float32 and gpu tests cover it there")


def _shape(impl):
  return PALLAS if impl == "pallas" else SMALL


# ---------------------------------------------------------------------------
# First order, forward mode
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_jvp_matches_float64(impl, case, rng, x64):
  if impl == "pallas" and case not in ("causal", "segments", "lse"):
    pytest.skip("Pallas interpret mode is slow; three cases cover it on CPU")
  args, kw = _inputs(rng, _shape(impl), case)
  f, ref = _pair(impl, kw)
  dots = _tangents(rng, args)
  out, t = jax.jvp(f, args, dots)
  ref_out, ref_t = jax.jvp(ref, args, dots)
  _close(out, ref_out)
  _close(t, ref_t)


def test_jvp_partial_tangents_and_jit(rng, x64):
  """Tangent for one input only (the others symbolic zeros), under jit."""
  args, kw = _inputs(rng, SMALL, "causal")
  f, ref = _pair("xla", kw)
  k_dot = _tangents(rng, args)[1]
  fk = lambda f: jax.jit(lambda k: jax.jvp(lambda k: f(args[0], k, args[2]),
                                           (k,), (k_dot,)))
  _close(fk(f)(args[1]), fk(ref)(args[1]))


@pytest.mark.parametrize("case", ["window", "lse"])
def test_linearize_matches_float64(case, rng, x64):
  args, kw = _inputs(rng, SMALL, case)
  f, ref = _pair("xla", kw)
  out, f_lin = jax.linearize(f, *args)
  ref_out, ref_lin = jax.linearize(ref, *args)
  _close(out, ref_out)
  for _ in range(2):  # the linear map is reusable
    dots = _tangents(rng, args)
    _close(f_lin(*dots), ref_lin(*dots))


@pytest.mark.parametrize("case", ["causal", "segments"])
def test_jacfwd_equals_jacrev_and_float64(case, rng, x64):
  args, kw = _inputs(rng, (1, 4, 5, 2, 1, 3), case)
  f, ref = _pair("xla", kw)
  jf = jax.jacfwd(f, argnums=(0, 1, 2))(*args)
  jr = jax.jacrev(f, argnums=(0, 1, 2))(*args)
  _close(jf, jax.jacfwd(ref, argnums=(0, 1, 2))(*args))
  _close(jr, jf)


# ---------------------------------------------------------------------------
# Second order
# ---------------------------------------------------------------------------


# Second derivatives of a Pallas kernel in interpret mode take minutes on CPU.
IMPLS_PALLAS_SLOW = ["xla", pytest.param("pallas", marks=pytest.mark.slow)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", IMPLS_PALLAS_SLOW)
def test_check_grads_order2(impl, case, rng, x64):
  """check_grads with its default modes (fwd and rev) to order 2."""
  _available(impl)
  if impl == "pallas" and case not in ("causal", "lse"):
    pytest.skip("Pallas interpret mode is slow; two cases cover it on CPU")
  shape = (1, 3, 4, 2, 1, 32) if impl == "pallas" else (1, 4, 5, 2, 1, 3)
  args, kw = _inputs(rng, shape, case)
  f, _ = _pair(impl, kw)
  check_grads(f, args, order=2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 3, 3, 1, 1, 2), (1, 20, 20, 2, 2, 16)],
                         ids=["1x3x1x2", "1x20x2x16"])
def test_hessian_matches_float64(shape, rng, x64):
  """jax.hessian (jacfwd of jacrev) of a scalar loss, in q, k and v."""
  args, kw = _inputs(rng, shape, "causal")
  f, ref = _pair("xla", kw)
  for argnum in (0, 1, 2):
    h = jax.hessian(_sum_sq(f), argnums=argnum)(*args)
    h_ref = jax.hessian(_sum_sq(ref), argnums=argnum)(*args)
    _close(h, h_ref, dict(rtol=1e-8, atol=1e-8))


@pytest.mark.parametrize("case", ["window", "segments", "lse"])
@pytest.mark.parametrize("impl", IMPLS_PALLAS_SLOW)
def test_hvp_modes_match_float64(impl, case, rng, x64):
  """Hessian-vector products four ways: fwd-over-rev, rev-over-fwd,
  rev-over-rev and fwd-over-fwd (jvp of jvp)."""
  if impl == "pallas" and case != "lse":
    pytest.skip("Pallas interpret mode is slow; one case covers it on CPU")
  _available(impl)
  args, kw = _inputs(rng, _shape(impl), case)
  f, ref = _pair(impl, kw)
  dots = _tangents(rng, args)

  def hvps(fn):
    loss = _sum_sq(fn)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    fwd_rev = jax.jvp(lambda *a: grad(*a), args, dots)[1]
    dir_deriv = lambda *a: jax.jvp(loss, a, dots)[1]
    rev_fwd = jax.grad(dir_deriv, argnums=(0, 1, 2))(*args)
    rev_rev = jax.grad(lambda *a: jnp.vdot(
        jnp.concatenate([g.ravel() for g in grad(*a)]),
        jnp.concatenate([d.ravel() for d in dots])), argnums=(0, 1, 2))(*args)
    second = jax.jvp(lambda *a: jax.jvp(fn, a, dots)[1], args, dots)[1]
    return fwd_rev, rev_fwd, rev_rev, second

  got, want = hvps(f), hvps(ref)
  for g, w in zip(got, want):
    _close(g, w, dict(rtol=1e-8, atol=1e-8))


@pytest.mark.parametrize("impl", IMPLS_PALLAS_SLOW)
def test_vmap_of_hvp_equals_loop(impl, rng, x64):
  _available(impl)
  args, kw = _inputs(rng, _shape(impl), "causal")
  f, ref = _pair(impl, kw)
  q, k, v = args
  loss = lambda fn: lambda q: _sum_sq(fn)(q, k, v)
  hvp = lambda fn: lambda t: jax.jvp(jax.grad(loss(fn)), (q,), (t,))[1]
  ts = jnp.asarray(rng.standard_normal((3,) + q.shape))
  batched = jax.vmap(hvp(f))(ts)
  _close(batched, jnp.stack([hvp(f)(t) for t in ts]), dict(rtol=1e-12,
                                                           atol=1e-12))
  _close(batched, jax.vmap(hvp(ref))(ts))


def test_third_order_matches_float64(rng, x64):
  args, kw = _inputs(rng, (1, 3, 4, 1, 1, 2), "window")
  f, ref = _pair("xla", kw)
  d = _tangents(rng, args)
  third = lambda fn: jax.jvp(lambda *a: jax.jvp(
      lambda *b: jax.jvp(fn, b, d)[1], a, d)[1], args, d)[1]
  _close(third(f), third(ref))
  g3 = lambda fn: jax.grad(lambda q: jax.grad(
      lambda q: jax.grad(lambda q: _sum_sq(fn)(q, *args[1:]))(q).sum())(
          q).sum())(args[0])
  _close(g3(f), g3(ref))


# ---------------------------------------------------------------------------
# Reverse mode keeps the fused backward
# ---------------------------------------------------------------------------


def _eqns(jaxpr):
  """Every equation of a jaxpr and of the jaxprs in its parameters."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def test_grad_runs_the_backend_backward(impl, rng, monkeypatch):
  args, kw = _inputs(rng, _shape(impl), "causal", np.float32)
  f, _ = _pair(impl, kw)
  loss = lambda *a: jnp.sum(f(*a) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args).jaxpr
  prims = [e for e in _eqns(jaxpr)
           if e.primitive in (derivatives.tangent_p, derivatives.cotangent_p)]
  assert [e.primitive for e in prims] == [derivatives.cotangent_p]
  assert prims[0].params["backward"].backend == impl

  # ... and the backend's own backward is what that primitive calls, with the
  # custom_vjp's inputs: residuals (q, k, v, o, lse), dO and delta.
  cls = type(backends.get(impl))
  original = cls.backward
  seen = []
  if isinstance(inspect.getattr_static(cls, "backward"), staticmethod):
    spy = staticmethod(lambda *a: (seen.append(a), original(*a))[1])
  else:  # a method: keep `self` out of what is recorded
    spy = lambda self, *a: (seen.append(a), original(self, *a))[1]
  monkeypatch.setattr(cls, "backward", spy)
  jax.clear_caches()
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
  assert len(seen) == 1
  spec, q, k, v, o, lse, do, delta = seen[0][:8]
  assert spec.q_len == q.shape[1] and do.shape == q.shape
  assert delta.shape == lse.shape == (q.shape[0], q.shape[2], q.shape[1])
  monkeypatch.undo()
  jax.clear_caches()
  expected = jax.grad(loss, argnums=(0, 1, 2))(*args)
  _close(grads, expected, dict(rtol=1e-5, atol=1e-5))


def test_grad_compiles_to_the_custom_vjp_program():
  """jax.grad compiles to the same XLA program, op for op, as a custom_vjp
  of the same forward and backward kernel calls (the design before forward
  mode existed): the backward pays nothing for forward mode."""
  from jax_flash._src.core.spec import AttentionSpec
  B, T, H, D = 2, 1100, 4, 64  # several blocks of 512
  spec = AttentionSpec(scale=D ** -0.5, causal=True, window_right=0, batch=B,
                       q_len=T, kv_len=T, num_heads=H, num_kv_heads=H,
                       head_dim=D, dtype="float32")
  fwd = kernels.kernel_call("forward", "xla", spec)
  bwd = kernels.kernel_call("backward", "xla", spec)

  @jax.custom_vjp
  def custom_vjp_attention(q, k, v):
    return fwd(q, k, v)

  def vjp_fwd(q, k, v):
    o, lse = fwd(q, k, v)
    return (o, lse), (q, k, v, o, lse)

  def vjp_bwd(res, ct):
    q, k, v, o, lse = res
    do, dlse = ct
    return bwd(q, k, v, o, lse, do, derivatives.softmax_delta(o, do, dlse))

  custom_vjp_attention.defvjp(vjp_fwd, vjp_bwd)
  ours = lambda q, k, v: jax_flash.attention(q, k, v, causal=True,
                                             return_lse=True,
                                             implementation="xla")

  def ops(fn):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v)[0] ** 2)
    sds = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32)
    text = jax.jit(jax.grad(loss, (0, 1, 2))).lower(
        sds, sds, sds).compile().as_text()
    return collections.Counter(
        re.findall(r"= \S+\[[^\]]*\]\S* ([\w-]+)\(", text))

  want = ops(custom_vjp_attention)
  assert sum(want.values()) > 100  # the regex does see the program
  assert ops(ours) == want


# Shapes like f32[1,8,4096,64] in the HLO text.
_HLO_SHAPE = re.compile(r"\b(?:pred|[suf]\d+|bf16)\[([0-9,]*)\]")


def _largest_buffer(text: str) -> int:
  return max((int(np.prod([int(d) for d in dims.split(",")]))
              for dims in _HLO_SHAPE.findall(text) if dims), default=0)


@pytest.mark.parametrize("what", ["jvp", "hvp"])
def test_derivatives_compile_without_dense_scores(what):
  """jvp and a Hessian-vector product at 8k tokens: no buffer as large as
  one T x S score matrix, temporaries linear in the sequence."""
  N, H, D = 8192, 2, 64
  sds = jax.ShapeDtypeStruct((1, N, H, D), jnp.float32)
  f = lambda q, k, v: jax_flash.attention(q, k, v, causal=True)
  if what == "jvp":
    fn = lambda q, k, v: jax.jvp(f, (q, k, v), (q, k, v))
  else:
    grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), (0, 1, 2))
    fn = lambda q, k, v: jax.jvp(grad, (q, k, v), (q, k, v))
  compiled = jax.jit(fn).lower(sds, sds, sds).compile()
  assert _largest_buffer(compiled.as_text()) < N * N
  stats = compiled.memory_analysis()
  if stats is not None and hasattr(stats, "temp_size_in_bytes"):
    linear = N * H * D * 4
    assert stats.temp_size_in_bytes <= 64 * linear, (
        f"temp {stats.temp_size_in_bytes / 2**20:.0f} MiB")


# ---------------------------------------------------------------------------
# The same on the GPU with the CUDA kernels
# ---------------------------------------------------------------------------


def _cuda_or_skip():
  try:
    backends.choose(_probe_spec(), "cuda", jax.default_backend())
  except backends.Unsupported as e:
    pytest.skip(str(e))


def _probe_spec():
  from jax_flash._src.core.spec import AttentionSpec
  return AttentionSpec(scale=1.0, head_dim=64, dtype="float16")


def _err(a, b):
  return max(float(np.max(np.abs(np.asarray(x, np.float64) -
                                 np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal", "window", "segments", "lse"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_derivatives_match_float64(case, dtype, rng):
  """jvp, HVP (fwd-over-rev, rev-over-rev) and jvp-of-jvp on the CUDA
  kernels, against float64: error at most 2x the same-dtype XLA backend's
  (+ a rounding floor)."""
  _cuda_or_skip()

  def derivs(impl, args, dots):
    f = lambda q, k, v: jax_flash.attention(q, k, v, implementation=impl,
                                            **kw)

    def loss(*a):
      acc = lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32))
      return sum(jnp.sum(acc(jnp.where(jnp.isfinite(x), x, 0.0)) ** 2)
                 for x in jax.tree.leaves(f(*a)))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    return (jax.jvp(f, args, dots)[1],
            jax.jvp(grad, args, dots)[1],
            jax.jvp(lambda *a: jax.jvp(f, a, dots)[1], args, dots)[1])

  with enable_x64():
    args64, kw = _inputs(rng, (2, 67, 131, 4, 2, 64), case)
    dots64 = _tangents(rng, args64)
    want = derivs("xla", args64, dots64)
  low = lambda xs: tuple(jnp.asarray(np.asarray(x), dtype) for x in xs)
  args, dots = low(args64), low(dots64)
  got = jax.jit(lambda a, d: derivs("cuda", a, d))(args, dots)
  xla = jax.jit(lambda a, d: derivs("xla", a, d))(args, dots)
  for g, x, w in zip(got, xla, want):
    scale = max(float(np.max(np.abs(np.asarray(l, np.float64))))
                for l in jax.tree.leaves(w) if np.isfinite(l).all())
    assert _err(g, w) <= 2 * _err(x, w) + 1e-3 * scale


@pytest.mark.gpu
def test_cuda_check_grads_order2(rng):
  """check_grads (default modes, order 2) on the CUDA kernels: float32 in and
  out around a float16 attention. Finite differences of a float16 function
  are noisy (each output carries ~5e-4 relative rounding, and check_grads
  compares sums over every output), hence few outputs, a large step and
  loose tolerances; the same settings pass for the xla backend in float16."""
  _cuda_or_skip()
  args, kw = _inputs(rng, (1, 5, 8, 1, 1, 64), "causal", np.float32)

  def f(q, k, v):
    cast = lambda x: x.astype(jnp.float16)
    return jax_flash.attention(cast(q), cast(k), cast(v),
                               implementation="cuda", **kw).astype(
                                   jnp.float32)

  check_grads(f, args, order=2, eps=0.05, atol=0.1, rtol=0.1)


@pytest.mark.gpu
def test_cuda_grad_runs_the_cuda_backward(rng):
  _cuda_or_skip()
  args, kw = _inputs(rng, (1, 128, 128, 2, 2, 64), "causal", np.float16)
  loss = lambda *a: jnp.sum(jax_flash.attention(
      *a, implementation="cuda", **kw).astype(jnp.float32))
  grad = jax.grad(loss, argnums=(0, 1, 2))
  jaxpr = jax.make_jaxpr(grad)(*args).jaxpr
  prims = [e for e in _eqns(jaxpr)
           if e.primitive in (derivatives.tangent_p, derivatives.cotangent_p)]
  assert [(e.primitive, e.params["backward"].backend) for e in prims] == [
      (derivatives.cotangent_p, "cuda")]
  from jax_flash._src.backends import ffi
  assert ffi.BWD in jax.jit(grad).lower(*args).as_text()
