"""jax.export of jax_flash.attention: symbolic shapes and other platforms.

* A symbolic batch exports for xla and pallas; the exported function, also
  after serialize -> deserialize, equals the direct call at two batch sizes.
* Symbolic sequence lengths export for xla (its block counts follow them);
  backends with static launch shapes refuse naming the dimension.
* Exporting for CUDA from a host without a GPU uses the CUDA kernels when the
  extension is built (the module holds the jax_flash custom call), else the
  portable xla backend (dropout included: the kernels draw xla's masks); an
  explicit implementation="cuda" that cannot be staged says why and what to
  do.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_flash
from jax_flash._src.backends import ffi

HAVE_FLATBUFFERS = importlib.util.find_spec("flatbuffers") is not None
TOL = dict(rtol=1e-5, atol=1e-5)


def _qkv(rng, B, T, S, H=2, Hk=1, D=32, dtype=jnp.float32):
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return mk(B, T, H, D), mk(B, S, Hk, D), mk(B, S, Hk, D)


def _exported(fn, q_shape, kv_shape, dtype=jnp.float32, **kw):
  sds = lambda s: jax.ShapeDtypeStruct(s, dtype)
  return export.export(jax.jit(fn), **kw)(sds(q_shape), sds(kv_shape),
                                          sds(kv_shape))


def _round_trip(exp):
  if not HAVE_FLATBUFFERS:
    pytest.skip("jax.export serialization needs the 'flatbuffers' package")
  return export.deserialize(exp.serialize())


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_symbolic_batch_round_trips(impl, rng):
  f = lambda q, k, v: jax_flash.attention(q, k, v, causal=True,
                                          window=(5, -1), implementation=impl)
  b, = export.symbolic_shape("b")
  exp = _exported(f, (b, 9, 2, 32), (b, 13, 1, 32))
  for exp_ in (exp, _round_trip(exp)):
    for B in (1, 3):
      args = _qkv(rng, B, 9, 13)
      np.testing.assert_allclose(exp_.call(*args), f(*args), **TOL)


def test_symbolic_batch_and_lengths_xla(rng):
  f = lambda q, k, v: jax_flash.attention(q, k, v, causal=True,
                                          return_lse=True,
                                          implementation="xla")
  b, t, s = export.symbolic_shape("b, t, s")
  exp = _round_trip(_exported(f, (b, t, 2, 32), (b, s, 1, 32)))
  # Lengths on both sides of the block size, T != S, T > S (empty rows).
  for B, T, S in ((2, 9, 13), (1, 600, 515), (1, 7, 3)):
    args = _qkv(rng, B, T, S)
    o, lse = exp.call(*args)
    o_ref, lse_ref = f(*args)
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_allclose(lse, lse_ref, **TOL)


def test_symbolic_grad_exports_xla(rng):
  """The fused-backward path exports too (jax.grad of a symbolic batch and
  length); equals the direct gradient."""
  loss = lambda q, k, v: jnp.sum(jax_flash.attention(
      q, k, v, causal=True, implementation="xla") ** 2)
  grad = jax.grad(loss, argnums=(0, 1, 2))
  b, t = export.symbolic_shape("b, t")
  exp = _exported(grad, (b, t, 2, 32), (b, t, 1, 32))
  for B, T in ((1, 5), (2, 11)):
    args = _qkv(rng, B, T, T)
    for g, r in zip(exp.call(*args), grad(*args)):
      np.testing.assert_allclose(g, r, **TOL)


@pytest.mark.parametrize("impl", ["pallas", "cuda"])
def test_symbolic_length_refused_naming_it(impl):
  f = lambda q, k, v: jax_flash.attention(q, k, v, implementation=impl)
  b, t = export.symbolic_shape("b, t")
  with pytest.raises(jax_flash.Unsupported,
                     match=r"static the query length \(T\) = t"):
    _exported(f, (b, t, 2, 64), (b, 16, 1, 64))


def test_default_picks_a_backend_that_takes_symbolic_lengths(rng):
  """implementation=None with symbolic lengths falls through to xla."""
  f = lambda q, k, v: jax_flash.attention(q, k, v, causal=True)
  t, = export.symbolic_shape("t")
  exp = _exported(f, (1, t, 2, 32), (1, 20, 1, 32))
  args = _qkv(rng, 1, 7, 20)
  np.testing.assert_allclose(exp.call(*args), f(*args), **TOL)


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="exports for CUDA from a host without a GPU")
def test_export_for_cuda_from_a_cpu_host(rng):
  f = lambda q, k, v: jax_flash.attention(q, k, v, causal=True)
  checks = [export.DisabledSafetyCheck.custom_call(t) for t in ffi.TARGETS]
  f16 = jnp.float16  # a dtype the CUDA kernels serve
  exp = _exported(f, (2, 128, 2, 64), (2, 128, 2, 64), f16,
                  platforms=["cuda"], disabled_checks=checks)
  text = exp.mlir_module()
  if ffi.available():
    assert ffi.FWD in text  # the CUDA kernels, not a baked-in xla backend
  else:
    assert ffi.FWD not in text  # no kernels to stage: the xla backend

  # A CPU + CUDA export runs here with the CPU branch.
  both = _exported(f, (2, 128, 2, 64), (2, 128, 2, 64), f16,
                   platforms=["cpu", "cuda"], disabled_checks=checks)
  args = _qkv(rng, 2, 128, 128, Hk=2, D=64, dtype=f16)
  np.testing.assert_array_equal(both.call(*args), f(*args))

  # The gradient's module holds the CUDA backward.
  loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32))
  grad = _exported(jax.grad(loss, argnums=(0, 1, 2)), (2, 128, 2, 64),
                   (2, 128, 2, 64), f16, platforms=["cuda"],
                   disabled_checks=checks)
  assert (ffi.BWD in grad.mlir_module()) == ffi.available()


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="exports for CUDA from a host without a GPU")
def test_dropout_exports_for_cuda_from_a_cpu_host(rng):
  """The CUDA kernels draw the same masks as xla, so dropout stages them for
  a 'cuda' lowering too; the CPU branch of a CPU + CUDA export is xla's."""
  key = jax.random.key(3)
  f = lambda q, k, v: jax_flash.attention(q, k, v, dropout_rate=0.25,
                                          dropout_rng=key)
  checks = [export.DisabledSafetyCheck.custom_call(t) for t in ffi.TARGETS]
  f16 = jnp.float16
  exp = _exported(f, (1, 96, 2, 64), (1, 80, 2, 64), f16, platforms=["cuda"],
                  disabled_checks=checks)
  assert (ffi.FWD in exp.mlir_module()) == ffi.available()
  both = _exported(f, (1, 96, 2, 64), (1, 80, 2, 64), f16,
                   platforms=["cpu", "cuda"], disabled_checks=checks)
  args = _qkv(rng, 1, 96, 80, Hk=2, D=64, dtype=f16)
  np.testing.assert_array_equal(both.call(*args), jax_flash.attention(
      *args, dropout_rate=0.25, dropout_rng=key, implementation="xla"))


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="exports for CUDA from a host without a GPU")
def test_explicit_cuda_on_a_cpu_host_says_what_to_do():
  f = lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda")
  with pytest.raises(jax_flash.Unsupported,
                     match="leave implementation=None"):
    _exported(f, (1, 16, 2, 64), (1, 16, 2, 64), platforms=["cuda"])


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="exports for CUDA from a host without a GPU")
@pytest.mark.skipif(not ffi.available(), reason="the CUDA extension is not "
                    "built")
def test_cpu_jit_never_compiles_the_cuda_branch(rng):
  """With the extension built on a CPU host, the default call stages a CUDA
  branch; lowering for the CPU keeps only the CPU one."""
  f = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, causal=True))
  args = _qkv(rng, 1, 64, 64, Hk=2, D=64, dtype=jnp.float16)
  assert ffi.FWD not in f.lower(*args).as_text()
  loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))
  assert ffi.BWD not in jax.jit(jax.grad(loss)).lower(*args).as_text()
  np.testing.assert_array_equal(f(*args), jax_flash.attention(
      *args, causal=True, implementation="xla"))
  np.testing.assert_array_equal(jax.grad(loss)(*args), jax.grad(
      lambda *a: jnp.sum(jax_flash.attention(
          *a, causal=True, implementation="xla").astype(jnp.float32)))(*args))
