"""Flax serving: SelfAttention(decode=True) takes a whole prompt in one call
(prefill), then one token per call, linen and nnx, on the xla backend.

Every output is measured against a float64 cache-free causal forward of the
same module (projections by hand + reference.attention); the error must stay
within twice that of the same formula in the test's dtype on XLA. Cache
slots no query reads and padded prompt positions hold NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import jax_flash.flax as jff  # noqa: E402
import reference  # noqa: E402

IMPL = "xla"
HEADS, KV_HEADS, HEAD_DIM, FEATURES = 4, 2, 6, 20  # GQA, odd sizes


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


class _Linen:
  """jff.SelfAttention with random parameters and a cache filled with `fill`."""

  def __init__(self, dtype, rng, **options):
    kw = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
              causal=True, implementation=IMPL, param_dtype=dtype)
    kw.update(options)
    self.module = jff.SelfAttention(**kw)
    self.decoder = jff.SelfAttention(**kw, decode=True)
    self.dtype = dtype
    shapes = jax.eval_shape(self.module.init, jax.random.key(0),
                            jnp.zeros((1, 3, FEATURES), dtype))
    self.params = jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s.shape) / 3, s.dtype), shapes)
    self.cache = None
    self._step = jax.jit(lambda p, c, x, n: self.decoder.apply(
        {**p, "cache": c}, x, lengths=n, mutable=["cache"]))

  def weights(self):
    p = self.params["params"]
    return {n: (np.asarray(p[n]["kernel"]), np.asarray(p[n]["bias"]))
            for n in ("query", "key", "value", "out")}

  def init_cache(self, batch, max_len, fill):
    shapes = jax.eval_shape(self.decoder.init, jax.random.key(0),
                            jnp.zeros((batch, max_len, FEATURES), self.dtype))
    self.cache = {n: (jnp.zeros(s.shape, s.dtype) if n == "cache_index" else
                      jnp.full(s.shape, fill, s.dtype))
                  for n, s in shapes["cache"].items()}

  def decode(self, x, lengths=None, jit=True):
    step = self._step if jit else self._step.__wrapped__
    out, upd = step(self.params, self.cache, x, lengths)
    self.cache = upd["cache"]
    return out

  def cache_index(self):
    return np.asarray(self.cache["cache_index"])


class _Nnx:
  """jff.nnx.SelfAttention with random parameters (biases included)."""

  def __init__(self, dtype, rng, **options):
    kw = dict(num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, causal=True,
              implementation=IMPL, param_dtype=dtype)
    kw.update(options)
    self.module = jff.nnx.SelfAttention(HEADS, FEATURES, rngs=nnx.Rngs(0),
                                        **kw)
    self.dtype = dtype
    for layer in (self.module.query, self.module.key, self.module.value,
                  self.module.out):
      for p in (layer.kernel, layer.bias):
        p[...] = jnp.asarray(rng.normal(size=p.shape) / 3, dtype)
    self._step = nnx.jit(lambda m, x, n: m(x, lengths=n, decode=True))

  def weights(self):
    m = self.module
    return {n: (np.asarray(getattr(m, n).kernel[...]),
                np.asarray(getattr(m, n).bias[...]))
            for n in ("query", "key", "value", "out")}

  def init_cache(self, batch, max_len, fill):
    self.module.init_cache((batch, max_len, FEATURES), self.dtype)
    for c in (self.module.cached_key, self.module.cached_value):
      c[...] = jnp.full(c.shape, fill, c.dtype)

  def decode(self, x, lengths=None, jit=True):
    if jit:
      return self._step(self.module, x, lengths)
    return self.module(x, lengths=lengths, decode=True)

  def cache_index(self):
    return np.asarray(self.module.cache_index[...])


KINDS = {"linen": _Linen, "nnx": _Nnx}


def _forward(w, x, *, window=None, xp=np, dtype=np.float64, attend=None):
  """The module's cache-free causal forward, written out with `xp` (numpy in
  float64, or jax.numpy in the test's dtype)."""
  x = xp.asarray(x, dtype)
  proj = lambda n: (xp.einsum("btf,fhd->bthd", x, xp.asarray(w[n][0], dtype))
                    + xp.asarray(w[n][1], dtype))
  o = attend(proj("query"), proj("key"), proj("value"))
  return (xp.einsum("bthd,hdf->btf", o, xp.asarray(w["out"][0], dtype)) +
          xp.asarray(w["out"][1], dtype))


def _truth_and_xla(w, x, dtype, window):
  """(float64 truth, same formula in `dtype` on XLA) of the causal forward."""
  T = x.shape[1]
  truth = _forward(w, x, attend=lambda q, k, v: reference.attention(
      q, k, v, causal=True, window=window)[0])
  mask = jnp.asarray(reference.mask(T, T, causal=True, window=window))[:, None]
  xla = _forward(w, x, xp=jnp, dtype=dtype,
                 attend=lambda q, k, v: jax.nn.dot_product_attention(
                     q, k, v, mask=mask, implementation="xla"))
  return truth, np.asarray(xla, np.float64)


def _assert_close(got, truth, xla, dtype):
  """|got - truth| <= 2 |xla - truth| (+ a few ulps of the outputs' size)."""
  got = np.asarray(got, np.float64)
  assert np.all(np.isfinite(got))
  floor = 8 * np.finfo(dtype).eps * np.max(np.abs(truth))
  err, err_xla = np.max(np.abs(got - truth)), np.max(np.abs(xla - truth))
  assert err <= 2 * err_xla + floor, (err, err_xla)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dtype_name,window", [("float32", None),
                                                ("float64", (4, 0))])
def test_prefill_then_steps_match_causal_forward(kind, dtype_name, window,
                                                 rng, x64):
  """A prompt of 11 tokens in one call, then 4 single-token steps, against a
  cache of 19 slots whose unread ones hold NaN."""
  dtype = jnp.dtype(dtype_name)
  B, prompt, steps, max_len = 3, 11, 4, 19
  x = rng.normal(size=(B, prompt + steps, FEATURES))
  model = KINDS[kind](dtype, rng, window=window)
  truth, xla = _truth_and_xla(model.weights(), x, dtype, window)
  model.init_cache(B, max_len, np.nan)
  xs = jnp.asarray(x, dtype)
  outs = [model.decode(xs[:, :prompt])]
  outs += [model.decode(xs[:, t:t + 1]) for t in range(prompt, prompt + steps)]
  np.testing.assert_array_equal(model.cache_index(), [prompt + steps] * B)
  _assert_close(jnp.concatenate(outs, 1), truth, xla, dtype)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_right_padded_prompts_of_different_lengths(kind, rng):
  """lengths=: rows with prompts of 9, 4 and 7 tokens in one padded call
  (padding NaN), then 3 steps; each row equals its own causal forward."""
  dtype = jnp.float32
  lengths, steps = np.array([9, 4, 7]), 3
  B, T = len(lengths), int(lengths.max())
  model = KINDS[kind](dtype, rng)
  model.init_cache(B, T + steps + 2, np.nan)
  seqs = [rng.normal(size=(n + steps, FEATURES)) for n in lengths]
  chunk = np.full((B, T, FEATURES), np.nan)
  for b, n in enumerate(lengths):
    chunk[b, :n] = seqs[b][:n]
  first = model.decode(jnp.asarray(chunk, dtype), jnp.asarray(lengths))
  assert np.all(np.isfinite(np.asarray(first)))  # padding never leaks NaN
  np.testing.assert_array_equal(model.cache_index(), lengths)
  later = [model.decode(jnp.asarray(np.stack(
      [s[n + i] for s, n in zip(seqs, lengths)])[:, None], dtype))
           for i in range(steps)]
  np.testing.assert_array_equal(model.cache_index(), lengths + steps)
  for b, n in enumerate(lengths):
    got = np.concatenate([np.asarray(first)[b, :n]] +
                         [np.asarray(o)[b] for o in later])
    truth, xla = _truth_and_xla(model.weights(), seqs[b][None], dtype, None)
    _assert_close(got[None], truth, xla, dtype)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_decode_errors(kind, rng):
  """Clear ValueErrors: a prompt longer than the cache (also under jit), a
  chunk that overflows the tokens held, bad lengths."""
  dtype = jnp.float32
  model = KINDS[kind](dtype, rng)
  model.init_cache(2, 6, 0.0)
  x = jnp.asarray(rng.normal(size=(2, 7, FEATURES)), dtype)
  for jit in (True, False):
    with pytest.raises(ValueError, match="chunk of 7 tokens is longer than "
                       "the cache"):
      model.decode(x, jit=jit)
  model.decode(x[:, :4], jit=False)
  with pytest.raises(ValueError, match="holds 4 tokens; a chunk of 3"):
    model.decode(x[:, :3], jit=False)
  with pytest.raises(ValueError, match="lengths out of range"):
    model.decode(x[:, :2], jnp.array([1, 3]), jit=False)
  with pytest.raises(ValueError, match=r"lengths must be an integer array "
                     r"\[batch\]"):
    model.decode(x[:, :2], jnp.array([1.0, 2.0]), jit=False)


def test_lengths_need_causal_and_decode(rng):
  model = _Nnx(jnp.float32, rng, causal=False)
  model.init_cache(2, 6, 0.0)
  x = jnp.asarray(rng.normal(size=(2, 3, FEATURES)), jnp.float32)
  with pytest.raises(ValueError, match="needs causal=True"):
    model.decode(x, jnp.array([1, 3]), jit=False)
  with pytest.raises(ValueError, match="lengths= is for decode=True"):
    model.module(x, lengths=jnp.array([1, 3]))
  fresh = jff.nnx.SelfAttention(2, 8, rngs=nnx.Rngs(0), decode=True)
  with pytest.raises(ValueError, match="call init_cache"):
    fresh(x[..., :8])


def test_nnx_state_loads_from_flax_multi_head_attention(rng):
  """jff.nnx.SelfAttention takes nnx.MultiHeadAttention's parameters as they
  are and computes the same causal attention."""
  kw = dict(num_heads=HEADS, in_features=FEATURES, qkv_features=HEADS * 5,
            num_kv_heads=KV_HEADS)
  stock = nnx.MultiHeadAttention(**kw, decode=False, rngs=nnx.Rngs(1))
  ours = jff.nnx.SelfAttention(**kw, causal=True, implementation=IMPL,
                               rngs=nnx.Rngs(2))
  nnx.update(ours, nnx.state(stock, nnx.Param))
  x = jnp.asarray(rng.normal(size=(2, 9, FEATURES)), jnp.float32)
  np.testing.assert_allclose(ours(x), stock(x, is_causal=True), rtol=2e-5,
                             atol=2e-6)
