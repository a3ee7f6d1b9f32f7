"""Empty requests: a batch dim of 0 or zero heads on every backend.

The outputs (o, lse) have the shapes and dtypes a non-empty call would give,
`jax.grad` works and gives zeros of the inputs' shapes and dtypes, and no
kernel runs (a CUDA launch with an empty grid fails; the jaxprs here hold no
kernel call at all). CPU: xla and pallas (interpret mode); the cuda backend
on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_flash

T, S, D = 5, 7, 32

# (id, leading batch dims, H, H_kv)
SHAPES = [
    ("batch0", (0,), 4, 2),
    ("batch_dims_with_0", (2, 0, 3), 2, 2),
    ("rank3_zero_heads", (), 0, 0),
    ("zero_heads", (2,), 0, 0),
    ("zero_q_heads_gqa", (2,), 0, 2),  # dk, dv: zeros of [2, S, 2, D]
]
FEATURES = [
    dict(),
    dict(causal=True, window=(3, -1), softcap=2.0),
    dict(segments=True, deterministic=True),
]


def _call(impl, batch, H, H_kv, dtype, features, rng):
  """(o, lse) and the gradients of a loss through both, under jit."""
  features = dict(features)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)
  q, k, v = mk(*batch, T, H, D), mk(*batch, S, H_kv, D), mk(*batch, S, H_kv, D)
  kw = dict(implementation=impl, return_lse=True)
  if features.pop("segments", False):
    kw["segment_ids"] = (jnp.zeros(batch + (T,), jnp.int32),
                         jnp.zeros(batch + (S,), jnp.int32))
  kw.update(features)
  attn = functools.partial(jax_flash.attention, **kw)

  def loss(q, k, v):
    o, lse = attn(q, k, v)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

  grad = jax.grad(loss, argnums=(0, 1, 2))
  return (q, k, v), jax.jit(attn)(q, k, v), jax.jit(grad)(q, k, v), (
      jax.make_jaxpr(grad)(q, k, v))


def _check(impl, batch, H, H_kv, dtype, features, rng):
  (q, k, v), (o, lse), grads, jaxpr = _call(impl, batch, H, H_kv, dtype,
                                            features, rng)
  assert o.shape == q.shape and o.dtype == q.dtype
  assert lse.shape == batch + (H, T) and lse.dtype == jnp.float32
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape and g.dtype == x.dtype
    assert not np.asarray(g, np.float32).any()  # zeros (where not empty)
  text = str(jaxpr)
  for kernel in ("pallas_call", "ffi_call", "while"):  # kernels, xla loops
    assert kernel not in text, f"{kernel} in the jaxpr of an empty request"


@pytest.mark.parametrize("features", FEATURES, ids=["plain", "masks",
                                                    "segments"])
@pytest.mark.parametrize("name,batch,H,H_kv", SHAPES,
                         ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("impl", ["xla", "pallas", None])
def test_empty_cpu_backends(impl, name, batch, H, H_kv, features, rng):
  del name
  _check(impl, batch, H, H_kv, jnp.float32, features, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("features", FEATURES, ids=["plain", "masks",
                                                    "segments"])
@pytest.mark.parametrize("name,batch,H,H_kv", SHAPES,
                         ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("impl", ["cuda", "pallas", "xla"])
def test_empty_gpu_backends(impl, name, batch, H, H_kv, features, rng):
  del name
  if impl not in jax_flash.available_implementations():
    pytest.fail(f"{impl} is not registered on this GPU machine")
  _check(impl, batch, H, H_kv, jnp.bfloat16, features, rng)


def test_empty_float64_lse(rng, x64):
  (q, _, _), (o, lse), grads, _ = _call("xla", (0,), 2, 2, jnp.float64, {},
                                        rng)
  assert o.dtype == jnp.float64 and lse.dtype == jnp.float64
  assert grads[0].dtype == jnp.float64


def test_empty_still_checks_arguments(rng):
  """Empty inputs are validated like any other: bad arguments still raise,
  and so does a backend that cannot serve the request."""
  q = jnp.zeros((0, T, 2, D), jnp.float32)
  k = jnp.zeros((0, S, 2, D), jnp.float32)
  with pytest.raises(ValueError, match="softcap"):
    jax_flash.attention(q, k, k, softcap=-1.0)
  with pytest.raises(ValueError, match="multiple"):
    jax_flash.attention(jnp.zeros((1, T, 2, D)), jnp.zeros((1, S, 0, D)),
                        jnp.zeros((1, S, 0, D)))
  if jax.default_backend() == "cpu":
    with pytest.raises(jax_flash.Unsupported, match="cuda"):
      jax_flash.attention(q, k, k, implementation="cuda")


def test_empty_eval_shape():
  f = functools.partial(jax_flash.attention, return_lse=True, causal=True)
  q = jax.ShapeDtypeStruct((3, 0, T, 4, D), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((3, 0, S, 2, D), jnp.bfloat16)
  o, lse = jax.eval_shape(f, q, kv, kv)
  assert o.shape == q.shape and o.dtype == q.dtype
  assert lse.shape == (3, 0, 4, T) and lse.dtype == jnp.float32


@pytest.mark.parametrize("batch,H,H_kv", [(0, 4, 2), (2, 0, 0)])
def test_empty_ring_attention(batch, H, H_kv, rng):
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 host devices (conftest sets 8 for CPU)")
  mesh = Mesh(np.array(jax.devices()[:4]), ("s",))
  mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32))
  q, k = mk(batch, 16, H, 8), mk(batch, 16, H_kv, 8)
  attn = functools.partial(jax_flash.ring_attention, mesh=mesh, seq_axis="s",
                           causal=True, return_lse=True)
  o, lse = jax.jit(attn)(q, k, k)
  assert o.shape == q.shape and lse.shape == (batch, H, 16)
  grads = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)[0]),
                   argnums=(0, 1, 2))(q, k, k)
  assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
