"""Flax integration: attention_fn drop-in (linen + nnx), SelfAttention, a tiny LM.

Everything runs with implementation="xla" (the CPU default) unless said
otherwise; one short check runs the Pallas backend when it is registered.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_flash  # noqa: E402
import jax_flash.flax as jff  # noqa: E402

IMPL = "xla"
F32 = dict(rtol=2e-5, atol=2e-6)


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
  # Stock flax uses XLA's default matmul precision, which is TF32 on recent
  # GPUs; pin both sides to true fp32 so "tight" means tight everywhere.
  with jax.default_matmul_precision("highest"):
    yield


def _x(shape, seed=0, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _allclose(a, b, **tol):
  a, b = (np.asarray(jnp.asarray(t, jnp.float32)) for t in (a, b))
  np.testing.assert_allclose(a, b, **(tol or F32))


def _tree_allclose(a, b, rtol=1e-4, atol=1e-5):
  """Leafwise allclose; atol is relative to the largest |b| over all leaves.

  (Some gradients are zero up to rounding, e.g. that of the key bias, which
  softmax cancels, so their noise is only small relative to the others.)
  """
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb) and la
  scale = max(float(jnp.max(jnp.abs(y))) for y in lb)
  for x, y in zip(la, lb):
    _allclose(x, y, rtol=rtol, atol=atol * max(scale, 1.0))


def _init(module, *args):
  """Random parameters with `module.init`'s tree, without running init.

  Flax's init executes the module eagerly, op by op, which costs more than
  the rest of most tests here; random weights (biases included) ~1/sqrt(fan_in)
  test the drop-in just as well.
  """
  shapes = jax.eval_shape(module.init, jax.random.key(0), *args)
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  return treedef.unflatten([
      jax.random.normal(k, s.shape, s.dtype) / np.sqrt(s.shape[0] if
                                                       s.ndim > 1 else 10)
      for k, s in zip(keys, leaves)])


def bottom_right_causal_mask(T, S):
  """jax_flash's causal convention as a flax mask: query i sees j <= i + S - T."""
  i = jnp.arange(T)[:, None] + (S - T)
  return (jnp.arange(S)[None, :] <= i)[None, None]


# --------------------------------------------------------------------------
# import hygiene


def test_import_jax_flash_does_not_import_flax():
  code = ("import sys, jax_flash; "
          "assert 'flax' not in sys.modules, sorted(m for m in sys.modules "
          "if m.startswith('flax'))")
  # Import the same jax_flash as this process (installed copy or source tree).
  root = os.path.dirname(os.path.dirname(os.path.abspath(jax_flash.__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  subprocess.run([sys.executable, "-c", code], check=True, env=env)


# --------------------------------------------------------------------------
# linen MultiHeadDotProductAttention drop-in


@pytest.mark.parametrize("batch,fn", [
    ((2, 3), jff.make_attention_fn(implementation=IMPL)),
    ((), jff.attention_fn),  # the plain default drop-in
])
def test_linen_mha_matches_stock(batch, fn):
  x = _x(batch + (17, 32))
  stock = nn.MultiHeadDotProductAttention(num_heads=4)
  ours = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=fn)
  params = _init(stock, x)
  _allclose(jax.jit(ours.apply)(params, x), jax.jit(stock.apply)(params, x))


def test_linen_mha_causal_value_and_grad_match_stock_causal_mask():
  x = _x((2, 3, 19, 32))  # two batch dims
  stock = nn.MultiHeadDotProductAttention(num_heads=4)
  ours = nn.MultiHeadDotProductAttention(
      num_heads=4,
      attention_fn=jff.make_attention_fn(causal=True, implementation=IMPL))
  params = _init(stock, x)
  mask = nn.make_causal_mask(x[..., 0])
  w = _x(x.shape, 7)
  f_ref = lambda p, x: jnp.sum(w * stock.apply(p, x, mask=mask))
  f = lambda p, x: jnp.sum(w * ours.apply(p, x))
  want = jax.jit(jax.value_and_grad(f_ref, argnums=(0, 1)))(params, x)
  got = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x)
  _tree_allclose(got, want)


def test_linen_cross_attention_causal_is_bottom_right():
  xq, xkv = _x((2, 5, 32), 0), _x((2, 12, 32), 1)
  stock = nn.MultiHeadDotProductAttention(num_heads=4)
  ours = nn.MultiHeadDotProductAttention(
      num_heads=4,
      attention_fn=jff.make_attention_fn(causal=True, implementation=IMPL))
  params = _init(stock, xq, xkv)
  ref = jax.jit(stock.apply)(params, xq, xkv,
                             mask=bottom_right_causal_mask(5, 12))
  _allclose(jax.jit(ours.apply)(params, xq, xkv), ref)


def test_linen_mha_bf16_dtype_follows_flax():
  x = _x((2, 16, 32), dtype=jnp.bfloat16)
  kw = dict(num_heads=4, dtype=jnp.bfloat16, force_fp32_for_softmax=True)
  stock = nn.MultiHeadDotProductAttention(**kw)
  ours = nn.MultiHeadDotProductAttention(
      **kw, attention_fn=jff.make_attention_fn(implementation=IMPL))
  params = _init(stock, x)
  a, b = jax.jit(ours.apply)(params, x), jax.jit(stock.apply)(params, x)
  assert a.dtype == b.dtype == jnp.bfloat16
  _allclose(a, b, rtol=5e-2, atol=5e-2)


def test_options_are_forwarded_to_jax_flash_attention():
  q, k, v = _x((2, 24, 4, 16), 0), _x((2, 24, 2, 16), 1), _x((2, 24, 2, 16), 2)
  seg = jnp.repeat(jnp.arange(3), 8)[None].repeat(2, 0)
  opts = dict(causal=True, window=(5, 0), softcap=3.0, scale=0.3,
              implementation=IMPL)
  fn = jff.make_attention_fn(**opts)
  got, want = jax.jit(lambda q, k, v, seg: (
      fn(q, k, v, segment_ids=seg),
      jax_flash.attention(q, k, v, segment_ids=seg, **opts)))(q, k, v, seg)
  _allclose(got, want, rtol=0, atol=0)


def test_promotes_dtypes_like_flax():
  q = _x((1, 8, 2, 16), 0, jnp.bfloat16)
  k, v = _x((1, 8, 2, 16), 1), _x((1, 8, 2, 16), 2)
  shape = lambda **kw: jax.eval_shape(
      lambda *a: jff.attention_fn(*a, **kw), q, k, v)
  assert shape().dtype == jnp.float32
  assert shape(dtype=jnp.bfloat16).dtype == jnp.bfloat16


# --------------------------------------------------------------------------
# what the drop-in refuses, loudly


def test_rejects_mask_bias_and_sow_weights():
  # Everything is refused at trace time, so abstract values suffice.
  x = jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)
  ours = nn.MultiHeadDotProductAttention(num_heads=2,
                                         attention_fn=jff.attention_fn)
  params = jax.eval_shape(ours.init, jax.random.key(1), x)
  trace = lambda f, *args: jax.eval_shape(f, *args)
  with pytest.raises(NotImplementedError, match="make_attention_fn"):
    trace(lambda p, x: ours.apply(
        p, x, mask=nn.make_causal_mask(x[..., 0])), params, x)
  with pytest.raises(NotImplementedError, match="sow_weights"):
    trace(lambda p, x: ours.apply(p, x, sow_weights=True), params, x)
  drop = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1,
                                         attention_fn=jff.attention_fn)
  # Attention dropout is honoured (tests/test_dropout.py); switched off at
  # call time it is the plain drop-in.
  trace(lambda p, x: drop.apply(p, x, deterministic=False,
                                rngs={"dropout": jax.random.key(0)}), params, x)
  trace(lambda p, x: drop.apply(p, x, deterministic=True), params, x)
  q = jax.ShapeDtypeStruct((2, 8, 2, 32), jnp.float32)
  q5 = jax.ShapeDtypeStruct((2, 5, 2, 32), jnp.float32)
  fn = lambda **kw: (lambda q, k, v: jff.attention_fn(q, k, v, **kw))
  with pytest.raises(NotImplementedError, match="bias"):
    trace(fn(bias=jnp.zeros((2, 2, 8, 8))), q, q, q)
  with pytest.raises(NotImplementedError, match="einsum"):
    trace(fn(qk_attn_weights_einsum=jnp.einsum,
             attn_weights_value_einsum=jnp.einsum), q, q, q)
  with pytest.raises(NotImplementedError, match="input_positions"):
    trace(fn(input_positions=jnp.arange(8)), q, q, q)
  with pytest.raises(NotImplementedError, match="frobnicate"):
    trace(fn(frobnicate=3), q, q, q)
  # Unknown keywords that ask for nothing are accepted (forward compatible).
  trace(fn(some_future_flag=None), q, q, q)
  # nnx's is_causal is top-left aligned; ours bottom-right: refuse T != S.
  with pytest.raises(NotImplementedError, match="bottom-right"):
    trace(fn(is_causal=True), q, q5, q5)
  trace(jff.make_attention_fn(causal=True), q, q5, q5)  # explicit: fine


# --------------------------------------------------------------------------
# nnx MultiHeadAttention drop-in


def test_nnx_mha_matches_stock():
  x = _x((2, 13, 32))
  kw = dict(num_heads=4, in_features=32, decode=False)
  stock = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  ours = nnx.MultiHeadAttention(
      **kw, attention_fn=jff.make_attention_fn(implementation=IMPL),
      rngs=nnx.Rngs(0))
  ref = nnx.jit(lambda m, x: m(x))(stock, x)
  out = nnx.jit(lambda m, x: m(x))(ours, x)
  _allclose(out, ref)


def test_nnx_mha_causal_gqa_value_and_grad_match_stock():
  x = _x((2, 16, 32))
  kw = dict(num_heads=4, in_features=32, num_kv_heads=2, decode=False)
  stock = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  ours = nnx.MultiHeadAttention(**kw, attention_fn=jff.attention_fn,
                                rngs=nnx.Rngs(0))
  loss = lambda m, x: jnp.sum(jnp.sin(m(x, is_causal=True)))
  l_ref, g_ref = nnx.jit(nnx.value_and_grad(loss))(stock, x)
  l, g = nnx.jit(nnx.value_and_grad(loss))(ours, x)
  _tree_allclose((l, nnx.state(g)), (l_ref, nnx.state(g_ref)))


# --------------------------------------------------------------------------
# SelfAttention (linen module)


def _reference_self_attention(params, x, *, num_heads, num_kv_heads, causal,
                              segment_ids=None):
  """Projections by hand + jax.nn.dot_product_attention (the XLA einsum path)."""
  p = params["params"]
  proj = lambda n: (jnp.einsum("...tf,fhd->...thd", x, p[n]["kernel"]) +
                    p[n]["bias"])
  q, k, v = proj("query"), proj("key"), proj("value")
  assert q.shape[-2] == num_heads and k.shape[-2] == num_kv_heads
  T = x.shape[-2]
  mask = jnp.ones((1, 1, T, T), bool)
  if causal:
    mask = mask & jnp.tril(jnp.ones((T, T), bool))
  if segment_ids is not None:
    mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None])
  o = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
  return jnp.einsum("...thd,hdf->...tf", o, p["out"]["kernel"]) + p["out"][
      "bias"]


def test_self_attention_matches_stock_mha_params():
  x = _x((2, 16, 32))
  stock = nn.MultiHeadDotProductAttention(num_heads=4)
  ours = jff.SelfAttention(num_heads=4, causal=True, implementation=IMPL)
  params = _init(stock, x)
  assert (jax.tree.map(jnp.shape, _init(ours, x)) ==
          jax.tree.map(jnp.shape, params))
  _allclose(jax.jit(ours.apply)(params, x),
            jax.jit(stock.apply)(params, x,
                                 mask=nn.make_causal_mask(x[..., 0])))


def test_self_attention_gqa_segment_ids_value_and_grad():
  x = _x((2, 24, 32))
  seg = jnp.array([[0] * 10 + [1] * 9 + [2] * 5, [0] * 24], jnp.int32)
  mod = jff.SelfAttention(num_heads=4, num_kv_heads=2, head_dim=16,
                          causal=True, implementation=IMPL)
  params = _init(mod, x, seg)
  assert params["params"]["key"]["kernel"].shape == (32, 2, 16)
  ref = lambda p, x: _reference_self_attention(
      p, x, num_heads=4, num_kv_heads=2, causal=True, segment_ids=seg)
  w = _x((2, 24, 32), 5)
  f_ref = lambda p, x: jnp.sum(w * ref(p, x))
  f = lambda p, x: jnp.sum(w * mod.apply(p, x, seg))
  want = jax.jit(jax.value_and_grad(f_ref, argnums=(0, 1)))(params, x)
  got = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x)
  _tree_allclose(got, want)


def test_self_attention_vmap_and_lse():
  xs = _x((3, 2, 16, 32))
  mod = jff.SelfAttention(num_heads=4, qkv_features=64, out_features=24,
                          implementation=IMPL)
  params = _init(mod, xs[0])

  @jax.jit
  def run(p, xs):
    return (jax.vmap(lambda x: mod.apply(p, x))(xs), mod.apply(p, xs),
            mod.apply(p, xs[0], return_lse=True))

  out, out_batched, (out0, lse) = run(params, xs)
  assert out.shape == (3, 2, 16, 24)
  _allclose(out, out_batched)  # vmap == an extra batch dim
  _allclose(out0, out[0])
  assert lse.shape == (2, 4, 16) and lse.dtype == jnp.float32


def test_self_attention_bad_config():
  x = _x((1, 4, 30))
  with pytest.raises(ValueError, match="divisible"):
    jff.SelfAttention(num_heads=4).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="num_kv_heads"):
    jff.SelfAttention(num_heads=4, num_kv_heads=3, head_dim=8).init(
        jax.random.key(0), x)


# --------------------------------------------------------------------------
# A tiny causal LM trained a few steps, stock attention vs jax_flash


class _Block(nn.Module):
  d_model: int
  num_heads: int
  attention_fn: object  # None = stock flax attention with an explicit mask
  dtype: object

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(dtype=self.dtype)(x)
    kw = dict(num_heads=self.num_heads, dtype=self.dtype,
              force_fp32_for_softmax=True, name="attn")
    if self.attention_fn is None:
      mask = nn.make_causal_mask(jnp.ones(x.shape[:-1]))
      h = nn.MultiHeadDotProductAttention(**kw)(h, mask=mask)
    else:
      h = nn.MultiHeadDotProductAttention(**kw,
                                          attention_fn=self.attention_fn)(h)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.Dense(4 * self.d_model, dtype=self.dtype)(h)
    h = nn.Dense(self.d_model, dtype=self.dtype)(nn.gelu(h))
    return x + h


class _TinyLM(nn.Module):
  vocab: int = 64
  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 2
  attention_fn: object = None
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d_model, dtype=self.dtype)(tokens)
    pos = self.param("pos", nn.initializers.normal(0.02),
                     (tokens.shape[-1], self.d_model))
    x = x + pos.astype(x.dtype)
    for i in range(self.num_layers):
      x = _Block(self.d_model, self.num_heads, self.attention_fn, self.dtype,
                 name=f"block{i}")(x)
    x = nn.LayerNorm(dtype=self.dtype)(x)
    return nn.Dense(self.vocab, dtype=self.dtype)(x)


def _loss(model, params, tokens):
  logits = model.apply(params, tokens[:, :-1]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


@functools.partial(jax.jit, static_argnums=0)
def _sgd_step(model, params, tokens, lr):
  loss, g = jax.value_and_grad(functools.partial(_loss, model))(params, tokens)
  return jax.tree.map(lambda a, b: a - lr * b, params, g), loss


def _train_losses(model, params, tokens, steps, lr=0.3):
  losses = []
  for _ in range(steps):
    params, loss = _sgd_step(model, params, tokens, lr)
    losses.append(float(loss))
  return np.array(losses)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-4),
                                        (jnp.bfloat16, 2e-2)])
def test_tiny_lm_training_matches_stock(dtype, rtol):
  """2 layers, d_model 64, 4 heads, seq 32, vocab 64: 5 SGD steps."""
  tokens = jax.random.randint(jax.random.key(0), (4, 33), 0, 64)
  stock = _TinyLM(dtype=dtype)
  ours = _TinyLM(dtype=dtype, attention_fn=jff.make_attention_fn(
      causal=True, implementation=IMPL))
  params = stock.init(jax.random.key(1), tokens[:, :-1])
  ref = _train_losses(stock, params, tokens, steps=5)
  got = _train_losses(ours, params, tokens, steps=5)
  assert np.all(np.isfinite(got))
  assert got[-1] < got[0]  # it trains
  np.testing.assert_allclose(got, ref, rtol=rtol)


@pytest.mark.slow
def test_pallas_drop_in_value_and_grad():
  if "pallas" not in jax_flash.available_implementations():
    pytest.skip("pallas backend not registered")
  # Pallas on CPU runs in interpret mode: keep it tiny. head_dim 32.
  x = _x((1, 16, 64))
  stock = nn.MultiHeadDotProductAttention(num_heads=2)
  ours = nn.MultiHeadDotProductAttention(
      num_heads=2,
      attention_fn=jff.make_attention_fn(causal=True, implementation="pallas"))
  params = _init(stock, x)
  mask = nn.make_causal_mask(x[..., 0])
  w = _x((1, 16, 64), 7)
  f_ref = lambda p, x: jnp.sum(w * stock.apply(p, x, mask=mask))
  f = lambda p, x: jnp.sum(w * ours.apply(p, x))
  want = jax.jit(jax.value_and_grad(f_ref, argnums=(0, 1)))(params, x)
  got = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x)
  _tree_allclose(got, want)


def test_self_attention_decode_matches_full_forward():
  """decode=True: init sizes the cache; prefill of 5 tokens, then one token
  per step; each step's output equals the cache-free causal forward's row."""
  B, L, F = 2, 12, 32
  x = _x((B, L, F))
  full = jff.SelfAttention(num_heads=4, num_kv_heads=2, causal=True,
                           implementation=IMPL)
  dec = jff.SelfAttention(num_heads=4, num_kv_heads=2, causal=True,
                          implementation=IMPL, decode=True)
  params = _init(full, x)
  cache = dec.init(jax.random.key(0), x)["cache"]
  assert cache["cached_key"].shape == (B, L, 2, 8)
  assert cache["cache_index"].shape == (B,)
  want = full.apply(params, x)
  step = jax.jit(lambda c, xs: dec.apply({**params, "cache": c}, xs,
                                         mutable=["cache"]))
  got, upd = step(cache, x[:, :5])
  outs = [got]
  cache = upd["cache"]
  for t in range(5, L):
    got, upd = step(cache, x[:, t:t + 1])
    cache = upd["cache"]
    outs.append(got)
  np.testing.assert_array_equal(np.asarray(cache["cache_index"]), [L, L])
  _allclose(jnp.concatenate(outs, 1), want)


def test_self_attention_decode_rejects_segment_ids():
  x = _x((1, 4, 16))
  dec = jff.SelfAttention(num_heads=2, causal=True, decode=True,
                          implementation=IMPL)
  variables = dec.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="segment_ids"):
    dec.apply(variables, x[:, :1], jnp.zeros((1, 1), jnp.int32),
              mutable=["cache"])


def test_generate_example_small(monkeypatch, capsys):
  """examples/generate.py --small: one-call prefill then decoding; the greedy
  tokens of jax_flash's decoder and of flax's own equal those a float32
  cache-free forward picks."""
  gen = _load_example("generate.py", monkeypatch)
  assert gen.main(["--small", "--repeats", "1", "--implementation",
                   IMPL]) == 0
  out = capsys.readouterr().out
  for name in ("jax_flash", "flax"):
    assert (f"float32 check, {name}: greedy tokens identical to a cache-free "
            f"forward: 1.000") in out
  assert "end-to-end speed-up of jax_flash over flax" in out


@pytest.mark.slow
def test_generate_example_fails_on_disagreement(monkeypatch, capsys):
  """The example's check can fail: with no tolerance on the logits (they
  differ from the cache-free forward by rounding) it exits 1."""
  gen = _load_example("generate.py", monkeypatch)
  monkeypatch.setattr(gen, "LOGITS_RTOL", 0.0)
  assert gen.main(["--small", "--repeats", "1", "--prompt", "6", "--new",
                   "3", "--implementation", IMPL]) == 1
  assert "FAILED: a decoder disagrees" in capsys.readouterr().out


@pytest.mark.parametrize("example", ["flax_lm.py", "generate.py",
                                     "sharded_attention.py"])
def test_example_implementation_flag(example, monkeypatch):
  """--implementation None is Python's None (the best available backend), as
  --help lists it; an unknown name is an argparse error naming the flag."""
  import argparse
  import importlib.util
  import pathlib
  import sys
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / example
  spec = importlib.util.spec_from_file_location("example_" + path.stem, path)
  mod = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "example_" + path.stem, mod)
  spec.loader.exec_module(mod)
  assert mod.implementation_arg("None") is None
  assert mod.implementation_arg("xla") == "xla"
  with pytest.raises(argparse.ArgumentTypeError, match="--implementation"):
    mod.implementation_arg("cudaa")


def _load_example(name, monkeypatch):
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / name
  spec = importlib.util.spec_from_file_location("example_" + path.stem, path)
  mod = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "example_" + path.stem, mod)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.slow
def test_flax_lm_compare_dropout_xla_pallas(monkeypatch, capsys):
  """examples/flax_lm.py --compare-dropout xla pallas: the same training
  (init, batches, dropout keys) on both backends follows one loss curve,
  and the control run (other dropout keys) is told apart."""
  if "pallas" not in jax_flash.available_implementations():
    pytest.skip("pallas backend not registered")
  lm = _load_example("flax_lm.py", monkeypatch)
  assert lm.main(["--compare-dropout", "xla", "pallas", "--steps", "3",
                  "--batch", "2", "--log-every", "1"]) == 0
  out = capsys.readouterr().out
  assert "OK: xla and pallas follow the same loss curve" in out
  assert "control: xla with other dropout keys differs by up to" in out


def test_flax_lm_compare_dropout_fails_on_another_mask(monkeypatch, capsys):
  """The comparison fails (exit 1) when the second run draws other masks:
  here xla against xla with its dropout keys changed."""
  lm = _load_example("flax_lm.py", monkeypatch)
  train = lm.train
  calls = []

  def second_run_other_keys(args, implementation, rate, dropout_seed, **kw):
    calls.append(dropout_seed)
    if len(calls) == 2:  # the IMPL_B run
      dropout_seed += 10
    return train(args, implementation, rate, dropout_seed, **kw)

  monkeypatch.setattr(lm, "train", second_run_other_keys)
  assert lm.main(["--compare-dropout", "xla", "xla", "--steps", "3",
                  "--batch", "2", "--no-control"]) == 1
  assert calls == [1, 1]
  assert "FAILED: xla and xla diverge" in capsys.readouterr().out


def test_flax_lm_trains_with_attention_dropout(monkeypatch, capsys):
  """examples/flax_lm.py --dropout: training with attention dropout on, the
  loss falls; a dropout rate outside [0, 1) is an argparse error."""
  lm = _load_example("flax_lm.py", monkeypatch)
  assert lm.main(["--dropout", "0.1", "--steps", "12", "--batch", "4",
                  "--implementation", IMPL]) == 0
  assert "attention dropout 0.1" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    lm.main(["--dropout", "1.0"])
