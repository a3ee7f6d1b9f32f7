"""Attention dropout (jax_flash.attention(dropout_rate=, dropout_rng=)):
outputs and gradients against a float64 reference that is given the same
mask explicitly (dropout.keep_mask at global positions), at odd sizes with
GQA, causal, windows, segment ids, softcap and return_lse; the keep rate;
reproducibility per key; vmap (a batched key: each element its own mask; a
shared key: the same one, as jax.random); check_grads; fully masked rows;
the Flax drop-in's dropout (broadcast_dropout included); argument errors.
The CUDA kernels' dropout (GPU): outputs and gradients against the float64
xla result with the same key, both kernel families (and the sm90 kernels
forced on Hopper, every head-dim bucket), deterministic mode, keys no query
sees holding NaN/Inf, the default dispatch."""

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


# ---------------------------------------------------------------------------
# implementation="cuda" with dropout: the kernels draw the mask of the xla
# path (GPU; skipped without a GPU or without the compiled extension).
# ---------------------------------------------------------------------------

import dataclasses  # noqa: E402
import re  # noqa: E402
import zlib  # noqa: E402

from jax_flash._src.backends import cuda as cuda_backend  # noqa: E402
from jax_flash._src.backends import ffi  # noqa: E402
from jax_flash._src.backends import registry as backends  # noqa: E402
from jax_flash._src.core.spec import AttentionSpec  # noqa: E402
from reference import assert_close_to_reference, enable_x64  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
CUDA_MARKS = (
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (ON_GPU and ffi.available()),
        reason="needs a CUDA GPU" if not ON_GPU else
        f"CUDA extension not built: {ffi.unavailable_reason()}"),
)


def cuda_only(f):
  for mark in CUDA_MARKS:
    f = mark(f)
  return f


# Each case: B=2; (T, S, H, H_kv), dtype, rate, and attention's options.
# Lengths are not multiples of 64/128 and T != S (bottom-right alignment)
# except for the packed documents; every head dim runs every case.
# segs: "packed" (T == S, documents of different lengths per row), "cross"
# (T != S, contiguous ids; the queries' last id has no key: empty rows).
CUDA_CASES = {
    "plain_77x131": dict(shape=(77, 131, 4, 4), dtype="bfloat16", rate=0.1),
    "gqa_causal_200x333": dict(shape=(200, 333, 4, 2), dtype="bfloat16",
                               rate=0.5, causal=True),
    "mqa_77x131_fp16": dict(shape=(77, 131, 4, 1), dtype="float16",
                            rate=0.1),
    "mqa_causal_200x333_fp16": dict(shape=(200, 333, 4, 1), dtype="float16",
                                    rate=0.5, causal=True),
    "window_200x333": dict(shape=(200, 333, 4, 2), dtype="bfloat16",
                           rate=0.1, window=(61, 17)),
    "causal_window_200x333_fp16": dict(shape=(200, 333, 4, 2),
                                       dtype="float16", rate=0.5,
                                       causal=True, window=(90, -1)),
    "packed_causal_300": dict(shape=(300, 300, 4, 2), dtype="bfloat16",
                              rate=0.1, causal=True, segs="packed"),
    "segments_77x131_fp16": dict(shape=(77, 131, 4, 2), dtype="float16",
                                 rate=0.5, segs="cross"),
    "broadcast_causal_200x333": dict(shape=(200, 333, 4, 2),
                                     dtype="bfloat16", rate=0.1, causal=True,
                                     dropout_broadcast=True),
    "broadcast_mqa_77x131_fp16": dict(shape=(77, 131, 4, 1), dtype="float16",
                                      rate=0.5, dropout_broadcast=True),
    "softcap_200x333": dict(shape=(200, 333, 4, 2), dtype="bfloat16",
                            rate=0.1, softcap=20.0),
}
# Head dims of the CUDA checks: the buckets' and DeepSeek MLA's head-dim pair
# (D, D_v) = (192, 128) (the sm90 forward's kernels of its own on Hopper).
CUDA_HEAD_DIMS = (64, 96, 128, 256, (192, 128))
_head_dim_id = lambda d: f"{d[0]}v{d[1]}" if isinstance(d, tuple) else str(d)
_FAMILY_CODES = {"auto": 0, "sm80": 80}


def _segment_ids(kind, B, T, S):
  if kind == "packed":
    assert T == S
    rows = [[0] * 100 + [1] * 120 + [2] * (T - 220),
            [0] * 37 + [1] * 200 + [2] * (T - 237)]
    q = np.asarray(rows, np.int32)[:B]
    return jnp.asarray(q), jnp.asarray(q)
  q = np.asarray([[0] * 30 + [1] * 40 + [5] * (T - 70)] * B, np.int32)
  kv = np.asarray([[0] * 50 + [1] * (S - 50)] * B, np.int32)
  return jnp.asarray(q), jnp.asarray(kv)


def _case_inputs(name, head_dim):
  """(q, k, v, do, attention kwargs, dropout key): inputs in the case's
  dtype, fixed per (case, head dim). head_dim: D, or (D, D_v) for v and do
  with a head dim of their own."""
  c = dict(CUDA_CASES[name])
  T, S, H, Hk = c.pop("shape")
  dtype = jnp.dtype(c.pop("dtype"))
  D, Dv = head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)
  B = 2
  rng = np.random.default_rng(zlib.crc32(f"{name}/{head_dim}".encode()))
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  q, k, v, do = mk(B, T, H, D), mk(B, S, Hk, D), mk(B, S, Hk, Dv), mk(B, T, H, Dv)
  segs = c.pop("segs", None)
  rate = c.pop("rate")
  kw = dict(c, dropout_rate=rate)  # causal, window, softcap, broadcast
  if segs is not None:
    kw["segment_ids"] = _segment_ids(segs, B, T, S)
  key = jax.random.key(zlib.crc32(name.encode()) % 2**31)
  return q, k, v, do, kw, key


def _attention_results(impl, q, k, v, do, kw, key):
  """(jitted fn, (o, lse, dq, dk, dv)): the call and its VJP applied to do."""
  def run(q, k, v, do):
    f = lambda q, k, v: jax_flash.attention(
        q, k, v, dropout_rng=key, return_lse=True, implementation=impl, **kw)
    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse) + tuple(vjp((do, jnp.zeros_like(lse))))
  g = jax.jit(run)
  return g, g(q, k, v, do)


_XLA_REFS = {}


def _xla_references(name, head_dim):
  """(inputs, float64 xla results, same-dtype xla results) of a case; the
  float64 run takes the same (already rounded) inputs and the same key."""
  if (name, head_dim) not in _XLA_REFS:
    q, k, v, do, kw, key = _case_inputs(name, head_dim)
    _, base = _attention_results("xla", q, k, v, do, kw, key)
    base = tuple(np.asarray(x, np.float64) for x in base)
    with enable_x64():
      up = lambda x: jnp.asarray(np.asarray(x, np.float64))
      _, ref = _attention_results("xla", up(q), up(k), up(v), up(do), kw,
                                  key)
      ref = tuple(np.asarray(x, np.float64) for x in ref)
    _XLA_REFS[(name, head_dim)] = ((q, k, v, do, kw, key), ref, base)
  return _XLA_REFS[(name, head_dim)]


def _check_against_xla(impl, name, head_dim):
  """impl's outputs, LSE and gradients vs the float64 xla result with the
  same dropout key: error <= 2x that of xla in the same dtype (+ 1e-5), so
  a different mask (O(1) differences) fails. Returns impl's jitted call and
  its arguments."""
  (q, k, v, do, kw, key), ref, base = _xla_references(name, head_dim)
  g, got = _attention_results(impl, q, k, v, do, kw, key)
  for what, a, r, b in zip(("o", "lse", "dq", "dk", "dv"), got, ref, base):
    assert a.dtype == (jnp.float32 if what == "lse" else q.dtype), what
    assert_close_to_reference(f"{name} D={head_dim} {what}", a, r, b)
  return g, (q, k, v, do)


def _kernel_families(g, args):
  """The kernel_family attributes of the jax_flash custom calls of a jitted
  call (in the lowered module, else in the compiled HLO)."""
  lowered = g.lower(*args)
  found = re.findall(r"kernel_family\s*=\s*(\d+)", lowered.as_text())
  if not found:
    found = re.findall(r"kernel_family\s*=\s*(\d+)",
                       lowered.compile().as_text())
  return {int(x) for x in found}


@pytest.fixture(params=["auto", "sm80"])
def cuda_family(request, monkeypatch):
  """JAX_FLASH_CUDA_FAMILY for the test's traces: "auto" (sm90 on Hopper
  where it serves the call, else sm80) and "sm80" (the portable kernels, on
  an H200 too). jax's trace caches are cleared around it, and each test
  checks that its calls carry the family (_kernel_families)."""
  if request.param != "auto":
    assert request.param in ffi.families(), ffi.families()
  monkeypatch.setenv("JAX_FLASH_CUDA_FAMILY", request.param)
  jax.clear_caches()
  yield request.param
  jax.clear_caches()


@cuda_only
@pytest.mark.parametrize("head_dim", CUDA_HEAD_DIMS, ids=_head_dim_id)
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_cuda_dropout_matches_xla(case, head_dim, cuda_family):
  """implementation="cuda" draws the xla path's mask: outputs, LSE and
  gradients (jax.vjp, random cotangent) against the float64 xla result."""
  g, args = _check_against_xla("cuda", case, head_dim)
  assert _kernel_families(g, args) == {_FAMILY_CODES[cuda_family]}


ON_HOPPER = (ON_GPU and ffi.available()
             and cuda_backend._compute_capability() == (9, 0))
# The cases the sm90 kernels serve with dropout (softcap with dropout runs
# the sm80 backward).
SM90_DROPOUT_CASES = [c for c in CUDA_CASES if "softcap" not in CUDA_CASES[c]]


@pytest.fixture
def sm90_family(monkeypatch):
  """JAX_FLASH_CUDA_FAMILY=sm90: the handlers fail rather than fall back, so
  a passing call proves the sm90 kernels computed it (jax's trace caches
  cleared around it, as cuda_family)."""
  assert "sm90" in ffi.families(), "extension built without the sm90 family"
  monkeypatch.setenv("JAX_FLASH_CUDA_FAMILY", "sm90")
  jax.clear_caches()
  yield
  jax.clear_caches()


@cuda_only
@pytest.mark.skipif(not ON_HOPPER,
                    reason="the sm90 kernels need an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256, 200])
@pytest.mark.parametrize("case", SM90_DROPOUT_CASES)
def test_sm90_dropout_matches_xla(case, head_dim, sm90_family):
  """The sm90 forward and backward (forced: no fallback) draw the xla
  path's mask in every head-dim bucket: the key split's backward (64, 96,
  128) and the column split's (256, and 200 zero-padded into it)."""
  g, args = _check_against_xla("cuda", case, head_dim)
  assert _kernel_families(g, args) == {90}


@cuda_only
@pytest.mark.skipif(not ON_HOPPER,
                    reason="the sm90 kernels need an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("head_dim", [128, 256])
def test_sm90_dropout_deterministic_is_bitwise_reproducible(head_dim,
                                                            sm90_family):
  _check_deterministic_dropout(head_dim, 90)


def test_cuda_harness_with_pallas_standing_in():
  """The check above, run here with the Pallas kernels (interpret mode on
  CPU) in the place of the CUDA ones: the harness itself (inputs, empty
  rows, fp16, the criterion) accepts a backend that draws the same mask."""
  for name, head_dim in (("segments_77x131_fp16", 64),
                         ("broadcast_mqa_77x131_fp16", 96)):
    _check_against_xla("pallas", name, head_dim)


@pytest.mark.parametrize("case", ["plain_77x131", "gqa_causal_200x333"])
def test_cuda_criterion_rejects_another_mask(case):
  """The criterion of test_cuda_dropout_matches_xla fails for results drawn
  with another key (xla in the same dtype standing in for a kernel whose
  mask is wrong), for the output and for every gradient."""
  (q, k, v, do, kw, key), ref, base = _xla_references(case, 64)
  _, other = _attention_results("xla", q, k, v, do, kw,
                                jax.random.fold_in(key, 1))
  for what, a, r, b in zip(("o", "lse", "dq", "dk", "dv"), other, ref, base):
    if what == "lse":  # the LSE is that of the undropped P: the same
      assert_close_to_reference(what, a, r, b)
      continue
    with pytest.raises(AssertionError, match="max abs err"):
      assert_close_to_reference(what, a, r, b)


@cuda_only
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_dropout_deterministic_is_bitwise_reproducible(head_dim,
                                                            cuda_family):
  _check_deterministic_dropout(head_dim, _FAMILY_CODES[cuda_family])


def _check_deterministic_dropout(head_dim, family_code):
  """deterministic=True with dropout: the gradients of four calls are
  bitwise equal, run by the kernel family family_code."""
  B, T, S, H, Hk = 2, 291, 403, 8, 2
  rng = np.random.default_rng(head_dim)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q, k, v = mk(B, T, H, head_dim), mk(B, S, Hk, head_dim), mk(B, S, Hk, head_dim)
  do = mk(B, T, H, head_dim)

  @jax.jit
  def grads(q, k, v, do):
    _, vjp = jax.vjp(lambda q, k, v: jax_flash.attention(
        q, k, v, causal=True, implementation="cuda", deterministic=True,
        dropout_rate=0.1, dropout_rng=jax.random.key(3)), q, k, v)
    return vjp(do)

  assert _kernel_families(grads, (q, k, v, do)) == {family_code}
  first = [np.asarray(x) for x in grads(q, k, v, do)]
  for _ in range(3):
    for name, a, b in zip(("dq", "dk", "dv"), first, grads(q, k, v, do)):
      np.testing.assert_array_equal(a.view(np.uint16),
                                    np.asarray(b).view(np.uint16),
                                    err_msg=f"{name} not bitwise reproducible")


def _poison(x, bad):
  """x with NaN in the even and Inf in the odd positions where bad [B, S]."""
  S = x.shape[1]
  nan_or_inf = jnp.where(jnp.arange(S) % 2 == 0, jnp.nan,
                         jnp.inf)[None, :, None, None]
  return jnp.where(bad[:, :, None, None], nan_or_inf.astype(x.dtype), x)


UNSEEN_CASES = ("segment_padding", "before_window")


def _unseen_inputs(case):
  rng = np.random.default_rng(zlib.crc32(case.encode()))
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  if case == "segment_padding":  # tail keys with an id no query has
    B, T, S, H, Hk, D = 2, 77, 131, 4, 2, 64
    q_seg = jnp.asarray(np.repeat([[0] * 30 + [1] * 47], B, 0), jnp.int32)
    kv_seg = np.repeat([[0] * 50 + [1] * 60 + [-1] * 21], B, 0)
    kv_seg[1, 90:] = -1
    kv_seg = jnp.asarray(kv_seg, jnp.int32)
    kw = dict(segment_ids=(q_seg, kv_seg), causal=True)
    bad = kv_seg == -1
  else:  # a sliding window, T < S: keys before the first query's window
    B, T, S, H, Hk, D = 2, 70, 333, 4, 2, 128
    left = 40
    kw = dict(window=(left, 0))
    bad = jnp.broadcast_to(jnp.arange(S)[None, :] < S - T - left, (B, S))
  q, k, v, do = mk(B, T, H, D), mk(B, S, Hk, D), mk(B, S, Hk, D), mk(B, T, H, D)
  return q, k, v, do, kw, bad


def _check_unseen_with_dropout(impl, case):
  q, k, v, do, kw, bad = _unseen_inputs(case)
  key = jax.random.key(17)
  kw = dict(kw, dropout_rate=0.25)
  g, clean = _attention_results(impl, q, k, v, do, kw, key)
  _, poisoned = _attention_results(impl, q, _poison(k, bad), _poison(v, bad),
                                   do, kw, key)
  for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), clean, poisoned):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if name in ("dk", "dv"):
      assert not np.any(a[np.asarray(bad)]), name  # no query sees them
    assert np.isfinite(b[np.isfinite(a)]).all(), name
    # (the dQ sums of atomics may add in another order: bf16 rounding)
    np.testing.assert_allclose(b, a, rtol=1e-2, atol=1e-2, err_msg=name)
  return g, (q, k, v, do)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("case", UNSEEN_CASES)
def test_unseen_keys_never_reach_results_with_dropout(impl, case):
  """Keys and values no query may see (padding ids, before every window)
  hold NaN/Inf: with dropout on, outputs and gradients equal the finite
  inputs' ones (tests/test_unseen_inputs.py without dropout)."""
  _check_unseen_with_dropout(impl, case)


@cuda_only
@pytest.mark.parametrize("case", UNSEEN_CASES)
def test_cuda_unseen_keys_never_reach_results_with_dropout(case, cuda_family):
  g, args = _check_unseen_with_dropout("cuda", case)
  assert _kernel_families(g, args) == {_FAMILY_CODES[cuda_family]}


@cuda_only
def test_default_implementation_picks_cuda_for_dropout():
  """implementation=None runs dropout on the CUDA kernels on a GPU: the
  registry's choice, and the same bits as implementation="cuda"."""
  spec = AttentionSpec(scale=0.125, batch=2, q_len=77, kv_len=131,
                       num_heads=4, num_kv_heads=2, head_dim=64,
                       dtype="bfloat16", dropout_rate=0.1)
  assert backends.choose(spec, None, "gpu").name == "cuda"
  for changes in (dict(causal=True, window_right=0),
                  dict(dropout_broadcast=True), dict(dtype="float16")):
    assert backends.choose(dataclasses.replace(spec, **changes), None,
                           "gpu").name == "cuda", changes
  # float32 is not the kernels': another backend serves it.
  assert backends.choose(dataclasses.replace(spec, dtype="float32"), None,
                         "gpu").name != "cuda"
  q, k, v, do, kw, key = _case_inputs("gqa_causal_200x333", 64)
  run = lambda impl: jax.jit(lambda q, k, v: jax_flash.attention(
      q, k, v, dropout_rng=key, implementation=impl, **kw))(q, k, v)
  auto, cuda, xla = (np.asarray(run(i)) for i in (None, "cuda", "xla"))
  np.testing.assert_array_equal(auto.view(np.uint16), cuda.view(np.uint16))
  assert not np.array_equal(cuda.view(np.uint16), xla.view(np.uint16))
