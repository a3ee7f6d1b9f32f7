"""Attention dropout (jax_flash.attention(dropout_rate=, dropout_rng=)):
outputs and gradients against a float64 reference that is given the same
mask explicitly (dropout.keep_mask at global positions), at odd sizes with
GQA, causal, windows, segment ids, softcap and return_lse; the keep rate;
reproducibility per key; vmap (a batched key: each element its own mask; a
shared key: the same one, as jax.random); check_grads; fully masked rows;
the Flax drop-in's dropout (broadcast_dropout included); argument errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash
import reference as numpy_reference
from jax_flash._src.core import dropout

RATE = 0.25


def _qkv(rng, B, T, S, H, Hk, D, dtype=np.float64):
  mk = lambda *s: jnp.asarray(rng.standard_normal(s).astype(dtype))
  return mk(B, T, H, D), mk(B, S, Hk, D), mk(B, S, Hk, D)


def _mask(rng_key, B, H, T, S, rate=RATE, broadcast=False):
  """[B, H, T, S] keep mask * 1 / (1 - rate) as the kernels draw it."""
  words = dropout.seed_words(rng_key)
  b = jnp.arange(B)[:, None, None, None]
  h = jnp.arange(H)[None, :, None, None]
  if broadcast:
    b, h = 0 * b, 0 * h
  keep = dropout.keep_mask(words, b, h, jnp.arange(T)[None, None, :, None],
                           jnp.arange(S)[None, None, None, :], rate)
  return np.asarray(keep, np.float64) * dropout.keep_scale(rate)


def _visible(B, T, S, *, causal=False, window=None, segs=None):
  """[B, 1, T, S] bool: the bottom-right masking convention (spec.py)."""
  i = np.arange(T)[:, None] + (S - T)
  j = np.arange(S)[None, :]
  vis = np.ones((T, S), bool)
  left, right = window if window is not None else (-1, -1)
  if causal:
    right = 0 if right < 0 else min(right, 0)
  if left >= 0:
    vis &= j >= i - left
  if right >= 0:
    vis &= j <= i + right
  vis = np.broadcast_to(vis, (B, 1, T, S))
  if segs is not None:
    qs, ks = (np.asarray(x) for x in segs)
    vis = vis & (qs[:, None, :, None] == ks[:, None, None, :])
  return vis


def _reference(q, k, v, z, *, causal=False, window=None, softcap=None,
               segs=None):
  """float64 dense attention with dropout mask z [B, H, T, S] (scaled)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, D = q.shape
  S, Hk = k.shape[1], k.shape[2]
  k, v = np.repeat(k, H // Hk, axis=2), np.repeat(v, H // Hk, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
  if softcap:
    s = softcap * np.tanh(s / softcap)
  vis = _visible(B, T, S, causal=causal, window=window, segs=segs)
  s = np.where(vis, s, -np.inf)
  m = np.max(s, -1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.exp(s - m)
  l = p.sum(-1, keepdims=True)
  lse = np.where(l[..., 0] > 0, np.log(np.maximum(l[..., 0], 1e-300)) + m[..., 0], -np.inf)
  p = p / np.where(l > 0, l, 1.0)
  o = np.einsum("bhts,bshd->bthd", p * z, v)
  return o, lse


CASES = {
    "plain": dict(),
    "causal_gqa": dict(causal=True),
    "window_softcap": dict(window=(7, 3), softcap=5.0),
    "segments": dict(segs=True),
}


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=() if c == "causal_gqa" else pytest.mark.slow)
    for c in CASES])
def test_matches_float64_reference_with_the_same_mask(case, rng, x64):
  B, T, S, H, Hk, D = 2, 37, 70, 4, 2, 16
  kw = dict(CASES[case])
  q, k, v = _qkv(rng, B, T, S, H, Hk, D)
  segs = None
  if kw.pop("segs", False):
    segs = (jnp.asarray(rng.integers(0, 3, (B, T))), jnp.asarray(rng.integers(0, 3, (B, S))))
  key = jax.random.key(3)
  z = _mask(key, B, H, T, S)
  f = lambda q, k, v: jax_flash.attention(
      q, k, v, dropout_rate=RATE, dropout_rng=key, return_lse=True,
      segment_ids=segs, **kw)
  (o, lse), vjp = jax.vjp(f, q, k, v)
  ref_o, ref_lse = _reference(q, k, v, z, segs=segs, **kw)
  np.testing.assert_allclose(o, ref_o, atol=1e-12)
  finite = np.isfinite(ref_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], atol=1e-12)
  assert np.all(np.isneginf(np.asarray(lse)[~finite]))
  # Gradients against jax.vjp of the dense reference written in jnp.
  do = jnp.asarray(rng.standard_normal(o.shape))
  grads = vjp((do, jnp.zeros_like(lse)))
  want = jax.vjp(lambda q, k, v: _dense_jnp(q, k, v, z, segs=segs, **kw), q, k, v)[1](do)
  for g, w in zip(grads, want):
    np.testing.assert_allclose(g, w, atol=1e-11)


def _dense_jnp(q, k, v, z, *, causal=False, window=None, softcap=None, segs=None):
  B, T, H, D = q.shape
  S, Hk = k.shape[1], k.shape[2]
  k, v = jnp.repeat(k, H // Hk, axis=2), jnp.repeat(v, H // Hk, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
  if softcap:
    s = softcap * jnp.tanh(s / softcap)
  vis = jnp.asarray(_visible(B, T, S, causal=causal, window=window, segs=segs))
  s = jnp.where(vis, s, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(vis, s, -1e300), -1, keepdims=True))
  p = jnp.where(vis, jnp.exp(s - m), 0.0)
  l = p.sum(-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1.0)
  return jnp.einsum("bhts,bshd->bthd", p * z, v)


def test_fully_masked_rows_are_zero_with_zero_gradients(rng, x64):
  B, T, S, H, D = 1, 9, 12, 2, 8
  q, k, v = _qkv(rng, B, T, S, H, H, D)
  segs = (jnp.asarray(np.r_[np.zeros(5), np.full(4, 7)][None], jnp.int32),
          jnp.zeros((1, S), jnp.int32))
  f = lambda q, k, v: jax_flash.attention(q, k, v, segment_ids=segs, dropout_rate=0.5,
                                          dropout_rng=jax.random.key(0))
  o, vjp = jax.vjp(f, q, k, v)
  assert not np.any(np.isnan(o)) and not np.any(o[:, 5:])
  dq, dk, dv = vjp(jnp.ones_like(o))
  assert not np.any(dq[:, 5:]) and np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))


def test_keep_rate_and_expectation(rng):
  """The realised keep fraction of the probabilities is binomial around 1 -
  rate: with v = 1, out = sum_j p_j z_j / (1 - rate), mean 1."""
  B, T, S, H, D = 2, 64, 256, 4, 8
  q = jnp.asarray(rng.standard_normal((B, T, H, D)) * 0.01, jnp.float32)
  v = jnp.ones((B, S, H, D), jnp.float32)
  o = jax_flash.attention(q, q[:, :1].repeat(S, 1), v, dropout_rate=0.1,
                          dropout_rng=jax.random.key(5))
  # near-uniform p: each row's output is ~ the kept fraction / (1 - rate)
  kept = np.asarray(o[..., 0]) * (1 - dropout.effective_rate(0.1))
  p = 1 - dropout.effective_rate(0.1)
  n = S
  assert abs(kept.mean() - p) < 5 * np.sqrt(p * (1 - p) / (n * kept.size))
  assert 0.5 < float(np.mean(o)) < 1.5


def test_same_key_same_result_other_key_other_mask(rng):
  q, k, v = _qkv(rng, 2, 33, 65, 2, 2, 16, np.float32)
  f = jax.jit(lambda key: jax_flash.attention(q, k, v, dropout_rate=0.3, dropout_rng=key))
  a, b = f(jax.random.key(1)), f(jax.random.key(1))
  np.testing.assert_array_equal(a, b)
  c = f(jax.random.key(2))
  assert float(jnp.max(jnp.abs(a - c))) > 1e-2
  # rate 0 with a key is refused: the key would be silently unused
  with pytest.raises(ValueError, match=r"dropout_rng was given with "
                     r"dropout_rate=0\.0"):
    jax_flash.attention(q, k, v, dropout_rate=0.0, dropout_rng=jax.random.key(1))


def test_vmap_over_keys_and_shared_key(rng):
  q, k, v = _qkv(rng, 1, 20, 30, 2, 2, 8, np.float32)
  keys = jax.random.split(jax.random.key(0), 3)
  f = lambda key, q: jax_flash.attention(q, k, v, dropout_rate=0.5, dropout_rng=key)
  batched = jax.vmap(f, in_axes=(0, None))(keys, q)
  for n in range(3):
    np.testing.assert_allclose(batched[n], f(keys[n], q), atol=1e-6)
  assert float(jnp.max(jnp.abs(batched[0] - batched[1]))) > 1e-2
  qs = jnp.stack([q, q])
  shared = jax.vmap(f, in_axes=(None, 0))(keys[0], qs)
  np.testing.assert_allclose(shared[0], shared[1], atol=0)  # jax.random: same key, same mask


def test_check_grads(rng, x64):
  q, k, v = _qkv(rng, 1, 11, 13, 2, 1, 8)
  f = lambda q, k, v: jax_flash.attention(q, k, v, causal=True, dropout_rate=0.2,
                                          dropout_rng=jax.random.key(4))
  check_grads(f, (q, k, v), order=1, modes=["rev"])


def test_broadcast_mask_is_shared_by_batch_and_heads(rng, x64):
  B, T, S, H, D = 2, 9, 17, 3, 8
  q, k, v = _qkv(rng, B, T, S, H, H, D)
  key = jax.random.key(9)
  o = jax_flash.attention(q, k, v, dropout_rate=RATE, dropout_rng=key,
                          dropout_broadcast=True)
  z = _mask(key, B, H, T, S, broadcast=True)
  assert np.all(z == z[:1, :1])
  np.testing.assert_allclose(o, _reference(q, k, v, z)[0], atol=1e-12)


def test_flax_drop_in_dropout(rng):
  nn = pytest.importorskip("flax.linen")
  import jax_flash.flax as jff
  x = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.float32)
  for broadcast in (True, False):
    mha = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.2,
                                          broadcast_dropout=broadcast,
                                          attention_fn=jff.attention_fn)
    params = mha.init(jax.random.key(0), x, deterministic=True)
    run = lambda seed: mha.apply(params, x, deterministic=False,
                                 rngs={"dropout": jax.random.key(seed)})
    a, b, c = run(1), run(1), run(2)
    np.testing.assert_array_equal(a, b)
    assert float(jnp.max(jnp.abs(a - c))) > 1e-3
    off = mha.apply(params, x, deterministic=True)
    assert float(jnp.max(jnp.abs(a - off))) > 1e-3


def test_self_attention_module_dropout(rng):
  pytest.importorskip("flax.linen")
  import jax_flash.flax as jff
  x = jnp.asarray(rng.standard_normal((2, 12, 16)), jnp.float32)
  m = jff.SelfAttention(num_heads=2, causal=True, dropout_rate=0.3)
  params = m.init(jax.random.key(0), x, deterministic=True)
  run = lambda seed: m.apply(params, x, deterministic=False,
                             rngs={"dropout": jax.random.key(seed)})
  np.testing.assert_array_equal(run(1), run(1))
  assert float(jnp.max(jnp.abs(run(1) - run(2)))) > 1e-3
  off = m.apply(params, x, deterministic=True)
  assert float(jnp.max(jnp.abs(run(1) - off))) > 1e-3
  plain = jff.SelfAttention(num_heads=2, causal=True).apply(params, x)
  np.testing.assert_allclose(off, plain, atol=0)
  with pytest.raises(ValueError, match="deterministic"):
    m.apply(params, x, rngs={"dropout": jax.random.key(1)})


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(9, 2), softcap=4.0),
                                dict(broadcast=True)], ids=["causal", "window_softcap", "broadcast"])
def test_pallas_draws_the_same_mask_as_xla(kw, rng, x64):
  """Pallas (interpret mode here) and xla: the same generator at the same
  global positions, so values and gradients agree to float64 rounding (a
  different mask would differ by O(1))."""
  kw = dict(kw)
  broadcast = kw.pop("broadcast", False)
  B, T, S, H, Hk, D = 2, 45, 70, 4, 2, 32
  q, k, v = _qkv(rng, B, T, S, H, Hk, D)
  do = jnp.asarray(rng.standard_normal(q.shape))
  def run(impl):
    f = lambda q, k, v: jax_flash.attention(
        q, k, v, dropout_rate=0.3, dropout_rng=jax.random.key(11),
        dropout_broadcast=broadcast, implementation=impl, **kw)
    o, vjp = jax.vjp(f, q, k, v)
    return (o,) + vjp(do)
  for a, b in zip(run("pallas"), run("xla")):
    np.testing.assert_allclose(a, b, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="needs a GPU (Pallas lowered to Triton)")
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(9, 2))],
                         ids=["causal", "window"])
def test_pallas_dropout_on_the_gpu(kw, rng):
  """The Pallas kernels with dropout compiled by Triton draw the xla path's
  mask: float32 values and gradients agree to float32 rounding (a different
  mask would differ by O(1))."""
  B, T, S, H, Hk, D = 2, 45, 70, 4, 2, 64
  q, k, v = _qkv(rng, B, T, S, H, Hk, D, np.float32)
  do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  def run(impl):
    f = lambda q, k, v: jax_flash.attention(
        q, k, v, dropout_rate=0.3, dropout_rng=jax.random.key(11),
        implementation=impl, **kw)
    o, vjp = jax.vjp(f, q, k, v)
    return (o,) + vjp(do)
  for a, b in zip(run("pallas"), run("xla")):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4,
                               rtol=2e-4)


def _kernel_primitives(jaxpr, out, inside=False):
  """Names of the primitives inside every pallas_call of a jaxpr."""
  for eqn in jaxpr.eqns:
    if inside:
      out.add(eqn.primitive.name)
    for p in eqn.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        j = getattr(sub, "jaxpr", sub)
        if hasattr(j, "eqns"):
          _kernel_primitives(j, out, inside or eqn.primitive.name == "pallas_call")
  return out


def test_pallas_dropout_kernels_lower_to_triton():
  """Every primitive of the Pallas kernels with dropout (forward and both
  backward kernels) has a rule in Pallas's Triton lowering, so the GPU path
  lowers (the kernel jaxprs are the same in interpret mode)."""
  try:
    from jax._src.pallas.triton import lowering as triton_lowering
  except ImportError as e:  # the Triton lowering moved or is gone
    pytest.skip(f"jax's Pallas Triton lowering is not importable: {e}")
  rules = {getattr(p, "name", str(p))
           for p in triton_lowering.triton_lowering_rules}
  q = jnp.zeros((1, 200, 2, 64), jnp.bfloat16)
  f = lambda q, k, v: jax_flash.attention(
      q, k, v, implementation="pallas", dropout_rate=0.1,
      dropout_rng=jax.random.key(0), causal=True)
  g = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(),
               argnums=(0, 1, 2))
  prims = set()
  for fn in (f, g):
    _kernel_primitives(jax.make_jaxpr(fn)(q, q, q).jaxpr, prims)
  assert {"xor", "shift_right_logical"} <= prims  # the generator is in there
  assert not prims - rules, sorted(prims - rules)


def test_errors(rng):
  q, k, v = _qkv(rng, 1, 8, 8, 2, 2, 8, np.float32)
  with pytest.raises(ValueError, match="needs dropout_rng"):
    jax_flash.attention(q, k, v, dropout_rate=0.1)
  with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
    jax_flash.attention(q, k, v, dropout_rate=1.0, dropout_rng=jax.random.key(0))
  with pytest.raises(ValueError, match="static value"):
    jax.jit(lambda r: jax_flash.attention(q, k, v, dropout_rate=r,
                                          dropout_rng=jax.random.key(0)))(0.1)
  with pytest.raises(ValueError, match="dropout_rng must be"):
    jax_flash.attention(q, k, v, dropout_rate=0.1, dropout_rng=3)
  with pytest.raises(ValueError, match="one key"):
    jax_flash.attention(q, k, v, dropout_rate=0.1,
                        dropout_rng=jax.random.split(jax.random.key(0), 2))
  with pytest.raises(ValueError, match="kv_seq_lengths"):
    jax_flash.attention(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                        kv_seq_lengths=jnp.array([4]))
  # A raw uint32[2] PRNGKey works like a typed key.
  raw = jax.random.PRNGKey(0)
  np.testing.assert_array_equal(
      jax_flash.attention(q, k, v, dropout_rate=0.1, dropout_rng=raw),
      jax_flash.attention(q, k, v, dropout_rate=0.1,
                          dropout_rng=jax.random.wrap_key_data(raw)))


def test_mask_does_not_depend_on_the_mesh(rng):
  """Batch- and head-sharded inputs, on Auto mesh axes (the xla path is
  plain JAX; XLA partitions it) and on explicit ones (one call per shard):
  the same result, bit for bit, as one device, because the mask is drawn at
  global positions."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (conftest asks XLA for 8 host devices)")
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("b", "h"))  # Auto axes
  q, k, v = _qkv(rng, 4, 33, 47, 8, 4, 16, np.float32)
  f = jax.jit(lambda q, k, v: jax_flash.attention(
      q, k, v, causal=True, dropout_rate=0.4, dropout_rng=jax.random.key(2)))
  want = f(q, k, v)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("b", None, "h")))
  got = f(put(q), put(k), put(v))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  g = jax.jit(jax.grad(lambda q, k, v: jax_flash.attention(
      q, k, v, dropout_rate=0.4, dropout_rng=jax.random.key(2)).sum(), argnums=(0, 1, 2)))
  for a, b in zip(g(put(q), put(k), put(v)), g(q, k, v)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  # Explicit mesh axes run one call per shard (shard_map), each with the key
  # words of its own origin: the same mask again, on every backend that
  # serves the shard, forward and backward.
  explicit = jax.make_mesh((2, 4), ("b", "h"),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  put_e = lambda x: jax.device_put(x, NamedSharding(explicit, P("b", None, "h")))
  use_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
  with use_mesh(explicit):
    got_e = f(put_e(q), put_e(k), put_e(v))
    grads_e = g(put_e(q), put_e(k), put_e(v))
  np.testing.assert_array_equal(np.asarray(got_e), np.asarray(want))
  for a, b in zip(grads_e, g(q, k, v)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  # Batch alone on one axis, the other replicated; and the broadcast mask.
  for spec, kw in ((P("b", None, None), {}), (P(None, None, "h"),
                                             dict(dropout_broadcast=True))):
    h = jax.jit(lambda q, k, v: jax_flash.attention(
        q, k, v, dropout_rate=0.25, dropout_rng=jax.random.key(5), **kw))
    put_s = lambda x: jax.device_put(x, NamedSharding(explicit, spec))
    with use_mesh(explicit):
      got_s = h(put_s(q), put_s(k), put_s(v))
    np.testing.assert_array_equal(np.asarray(got_s), np.asarray(h(q, k, v)))


@pytest.mark.parametrize("rate", [1e-4, 1 / 1024, 1 / 512])
def test_rate_that_rounds_to_zero_is_refused(rng, rate):
  q, k, v = _qkv(rng, 1, 8, 8, 2, 2, 8, np.float32)
  with pytest.raises(ValueError, match=rf"dropout_rate={rate} would apply no "
                     r"dropout: rates round to the nearest 1/256 and the "
                     r"smallest nonzero rate is 1/256"):
    jax_flash.attention(q, k, v, dropout_rate=rate,
                        dropout_rng=jax.random.key(0))


def test_smallest_step_is_accepted(rng):
  q, k, v = _qkv(rng, 1, 8, 8, 2, 2, 8, np.float32)
  o = jax_flash.attention(q, k, v, dropout_rate=1 / 256,
                          dropout_rng=jax.random.key(0))
  assert o.shape == q.shape
