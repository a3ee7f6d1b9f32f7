"""One spec, one backend interface, one chooser, one autodiff entry point."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash  # noqa: F401  (registers the backends)
from jax_flash._src.autodiff.differentiable import Kernels, differentiable
from jax_flash._src.backends import ffi
from jax_flash._src.backends import registry as backends
from jax_flash._src.core.spec import AttentionSpec, Fp8Scheme

SPEC = AttentionSpec(scale=0.125, batch=1, q_len=128, kv_len=128, num_heads=2,
                     num_kv_heads=2, head_dim=64, dtype="float32")


MODEL_SHAPE_OPTIONS = [
    pytest.param(dict(has_sinks=True), "sinks", id="sinks"),
    pytest.param(dict(value_head_dim=32), "value head_dim", id="value_dim"),
]


def test_cuda_refuses_value_head_dim_without_kernels():
  """The CUDA kernels have a distinct value head dim only for their head-dim
  pairs (DeepSeek MLA's 192 / 128): another pair is refused naming it and
  the served ones (before any platform or build reason), the default chooser
  takes pallas on a GPU and xla elsewhere."""
  spec = dataclasses.replace(SPEC, dtype="bfloat16", value_head_dim=32)
  for platform in ("gpu", "cpu"):
    with pytest.raises(backends.Unsupported,
                       match=r"implementation='cuda'.*value head_dim.*"
                       r"\(192, 128\).*got \(64, 32\)"):
      backends.choose(spec, "cuda", platform)
  assert backends.choose(spec, None, "gpu").name == "pallas"
  assert backends.choose(spec, None, "cpu").name == "xla"
  staged = backends.choose_per_platform(spec, None, "cpu")
  assert set(staged) == {"default"} and staged["default"].name == "xla"
  for name in ("xla", "pallas"):
    backends.get(name).check(spec, "cpu")  # served
  # The pair the other way round has no kernel either.
  swapped = dataclasses.replace(SPEC, dtype="bfloat16", head_dim=128,
                                value_head_dim=192)
  with pytest.raises(backends.Unsupported, match="got \\(128, 192\\)"):
    backends.choose(swapped, "cuda", "gpu")


def test_cuda_serves_its_head_dim_pairs():
  """(192, 128) passes the value head dim check: on a CPU the explicit
  request fails for the platform; on a GPU with the extension built the
  default chooser takes cuda."""
  spec = dataclasses.replace(SPEC, dtype="bfloat16", head_dim=192,
                             value_head_dim=128)
  with pytest.raises(backends.Unsupported, match="needs an NVIDIA GPU"):
    backends.choose(spec, "cuda", "cpu")
  want = "cuda" if ffi.available() else "pallas"
  assert backends.choose(spec, None, "gpu").name == want
  assert backends.choose(spec, None, "cpu").name == "xla"


def test_sinks_choice():
  """The CUDA forwards fold the sinks into each row's LSE: the default on a
  GPU where the extension is built, pallas on one without it, xla on a CPU;
  an explicit cuda request on a CPU fails for the platform, not the sinks."""
  spec = dataclasses.replace(SPEC, dtype="bfloat16", has_sinks=True)
  want = "cuda" if ffi.available() else "pallas"
  assert backends.choose(spec, None, "gpu").name == want
  assert backends.choose(spec, None, "cpu").name == "xla"
  with pytest.raises(backends.Unsupported, match="needs an NVIDIA GPU"):
    backends.choose(spec, "cuda", "cpu")


@pytest.mark.parametrize("option, match", MODEL_SHAPE_OPTIONS)
def test_fp8_refuses_sinks_and_value_head_dim(option, match):
  from jax_flash._src.fp8 import checks as fp8_checks
  spec = dataclasses.replace(SPEC, fp8=Fp8Scheme(logical_head_dim=64),
                             **option)
  with pytest.raises(backends.Unsupported, match=f"fp8_attention.*{match}"):
    fp8_checks.choose(spec, None, "cpu")


def test_fp8_spec_choice():
  spec = dataclasses.replace(SPEC, fp8=Fp8Scheme(logical_head_dim=64))
  with pytest.raises(backends.Unsupported, match="has no FP8 path"):
    backends.choose(spec, "pallas", "cpu")
  assert backends.choose(spec, None, "gpu").name in ("cuda", "xla")
  assert backends.choose(spec, None, "cpu").name == "xla"


def test_dropout_spec_choice():
  spec = dataclasses.replace(SPEC, dropout_rate=0.1, dtype="bfloat16")
  # The CUDA kernels draw dropout themselves: the default on a GPU where the
  # extension is built (a bf16 request), else xla.
  want = "cuda" if ffi.available() else "xla"
  assert backends.choose(spec, None, "gpu").name == want
  # float32 has no CUDA kernel: xla, dropout or not.
  assert backends.choose(dataclasses.replace(spec, dtype="float32"), None,
                         "gpu").name == "xla"
  assert backends.choose(spec, "pallas", "cpu").name == "pallas"
  if not ffi.available():
    with pytest.raises(backends.Unsupported, match="extension"):
      backends.choose(spec, "cuda", "gpu")
  # Staged from a CPU host: the CUDA kernels for a 'cuda' lowering when the
  # extension is built (they draw the same masks as xla), xla elsewhere.
  staged = backends.choose_per_platform(spec, None, "cpu")
  assert staged["default"].name == "xla"
  assert set(staged) == ({"cuda", "default"} if ffi.available() else
                         {"default"})


def _toy_kernels(**kw):
  """o = n q (k + v), lse its row sums; a backward that records its delta."""
  seen = {}

  def forward(q, k, v, n):
    o = q * (k + v) * n
    return o, jnp.sum(o, axis=-1).transpose(0, 2, 1)

  def backward(q, k, v, o, lse, do, delta, n):
    seen["delta"] = delta
    return do * (k + v) * n, do * q * n, do * q * n

  return Kernels(forward, backward, **kw), seen


def test_first_order_op_delta_and_raw_cotangents():
  shape = (1, 3, 1, 2)  # [B, T, H, D]
  q, k, v = (jnp.full(shape, x, jnp.float32) for x in (1.0, 2.0, 3.0))
  n = jnp.int32(2)
  for with_delta in (True, False):
    kernels, seen = _toy_kernels(delta=with_delta)
    fn = differentiable(kernels)
    o, lse = fn(q, k, v, n)
    _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, n), q, k, v)
    do, dlse = jnp.ones_like(o), jnp.full_like(lse, 0.5)
    dq, dk, dv = vjp((do, dlse))
    np.testing.assert_allclose(dq, 10.0)
    np.testing.assert_allclose(dk, 2.0)
    # delta = rowsum(do * o) - dlse = 2 * 10 - 0.5, or the raw dlse.
    np.testing.assert_allclose(seen["delta"], 19.5 if with_delta else 0.5)


def test_first_order_op_with_sinks_and_raw_cotangents(rng):
  """delta=False with sinks (a backward that recomputes the forward): the
  backward gets the raw cotangents and the sinks, no cotangent for them;
  the sinks' one is sinks.py's, from the op's o and lse."""
  from jax_flash._src.autodiff.sinks import sink_cotangent
  seen = {}

  def forward(q, k, v, sinks, n):
    o = q * (k + v) * n
    lse = jnp.logaddexp(jnp.sum(o, -1).transpose(0, 2, 1), sinks[..., None])
    return o, lse

  def backward(q, k, v, o, lse, do, dlse, sinks, n):
    seen["sinks"], seen["dlse"] = sinks, dlse
    return do * (k + v) * n, do * q * n, do * q * n

  fn = differentiable(Kernels(forward, backward, delta=False, sinks=True))
  q, k, v = (jnp.asarray(rng.standard_normal((2, 3, 4, 5)), jnp.float32)
             for _ in range(3))
  sinks = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
  n = jnp.int32(2)
  (o, lse), vjp = jax.vjp(lambda q, k, v, s: fn(q, k, v, s, n), q, k, v, sinks)
  do = jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
  dlse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
  dq, _, _, dsinks = vjp((do, dlse))
  np.testing.assert_array_equal(seen["sinks"], sinks)
  np.testing.assert_array_equal(seen["dlse"], dlse)
  np.testing.assert_allclose(dq, do * (k + v) * 2)
  np.testing.assert_allclose(dsinks, sink_cotangent(sinks, o, lse, do, dlse),
                             rtol=1e-6)
