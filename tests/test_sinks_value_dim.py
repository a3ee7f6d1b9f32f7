"""Learnable attention sinks (sinks=) and a value head dim other than q/k's,
through every entry point: attention, varlen, kvcache, ring,
dot_product_attention, the Flax module; jit, vmap, higher derivatives,
fully masked rows, unseen NaN inputs and the refusals.

The backends' own suites (attention_suite.py: the sinks_* and value_dim_*
cases, the support-matrix probes) compare forward and gradients against the
float64 reference at every dtype; these tests cover the rest in float64.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flash
import reference

IMPLS = ("xla", "pallas")
# Pallas in interpret mode compiles slowly on CPU: its heavier variants are
# in the slow tier.
IMPLS_FAST_XLA = ("xla", pytest.param("pallas", marks=pytest.mark.slow))
TOL = dict(rtol=1e-9, atol=1e-9)


def _problem(rng, B=2, T=37, S=53, H=4, Hk=2, D=40, Dv=24):
  mk = lambda *s: jnp.asarray(rng.standard_normal(s))
  sinks = jnp.asarray(rng.normal(0.5, 1.5, H))
  return mk(B, T, H, D), mk(B, S, Hk, D), mk(B, S, Hk, Dv), sinks


def _vjp(f, args, cotangent):
  """(f(*args), the vjp of `cotangent`), for one jit of both."""
  out, vjp = jax.vjp(f, *args)
  return out, vjp(cotangent)


def _close(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.shape == y.shape, (x.shape, y.shape)
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **(tol or TOL))


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_and_unseen_nan(impl, rng, x64):
  """Rows that see no key give o = 0 and lse = sink; keys no query sees may
  hold NaN; every gradient (the sinks' included) is finite and right."""
  q, k, v, sinks = _problem(rng, T=21, S=29, Dv=36)
  q_ids = np.repeat(np.arange(21)[None] // 7, 2, 0)  # ids 0, 1, 2
  q_ids[:, 14:] = 9                                    # never among the keys
  kv_ids = np.repeat(np.arange(29)[None] // 10, 2, 0)  # ids 0, 1, 2
  kv_ids[:, 20:] = 5                                   # seen by no query
  k = k.at[:, 20:].set(jnp.nan)
  v = v.at[:, 20:].set(jnp.inf)
  segs = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
  do = jnp.asarray(rng.standard_normal(q.shape[:-1] + v.shape[-1:]))
  dlse = jnp.asarray(rng.standard_normal((2, 4, 21)))

  def f(q, k, v, s):
    return jax_flash.attention(q, k, v, sinks=s, segment_ids=segs,
                               causal=True, return_lse=True,
                               implementation=impl)

  (o, lse), grads = jax.jit(lambda *a: _vjp(f, a, (do, dlse)))(q, k, v,
                                                               sinks)
  np.testing.assert_array_equal(o[:, 14:], 0.0)
  _close(lse[:, :, 14:], jnp.broadcast_to(sinks[:, None], (2, 4, 7)))
  clean = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)
  kw = dict(segment_ids=(q_ids, kv_ids), causal=True, sinks=sinks)
  ref_o, ref_lse = reference.attention(q, clean(k), clean(v), **kw)
  _close((o, lse), (ref_o, ref_lse))
  ref = reference.attention_vjp(q, clean(k), clean(v), do, dlse=dlse, **kw)
  assert all(bool(jnp.isfinite(g).all()) for g in grads)
  _close((grads[0], grads[1][:, :20], grads[2][:, :20], grads[3]),
         (ref[0], ref[1][:, :20], ref[2][:, :20], ref[3]))
  np.testing.assert_array_equal(grads[2][:, 20:], 0.0)


def test_sinks_gradient_formula(rng, x64):
  """d sinks_h = -sum_{b,t} exp(sink_h - lse) (rowsum(dO * O) - dLSE), and
  it matches jax.grad of a dense float64 attention with the sink as one
  more logit."""
  q, k, v, sinks = _problem(rng)
  do = jnp.asarray(rng.standard_normal(q.shape[:-1] + v.shape[-1:]))
  dlse = jnp.asarray(rng.standard_normal((2, 4, 37)))
  f = lambda s: jax_flash.attention(q, k, v, sinks=s, window=(11, 3),
                                    return_lse=True)
  (o, lse), (ds,) = jax.jit(lambda s: _vjp(f, (s,), (do, dlse)))(sinks)
  delta = jnp.einsum("bthd,bthd->bht", do, o) - dlse
  want = -jnp.sum(jnp.exp(sinks[None, :, None] - lse) * delta, (0, 2))
  _close(ds, want)
  dense = lambda s: reference.dense_attention_jax(q, k, v, window=(11, 3),
                                                  sinks=s)
  _close(ds, jax.vjp(dense, sinks)[1]((do, dlse))[0])


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_jit_vmap_and_second_order(impl, rng, x64):
  """vmap over per-element sinks folds into the batch; jvp-of-grad (a
  Hessian-vector product) in every input matches the dense float64 one."""
  q, k, v, _ = _problem(rng, B=1, T=19, S=27, Dv=33)
  sinks = jnp.asarray(rng.normal(0.0, 1.0, (3, 4)))  # one row per vmap entry
  attn = lambda q, k, v, s: jax_flash.attention(
      q, k, v, sinks=s, causal=True, implementation=impl)
  dense = lambda q, k, v, s: reference.dense_attention_jax(
      q, k, v, causal=True, sinks=s)[0]
  qs = jnp.stack([q, 0.5 * q, -q])
  got = jax.jit(jax.vmap(attn, in_axes=(0, None, None, 0)))(qs, k, v, sinks)
  _close(got, jnp.stack([dense(qs[i], k, v, sinks[i]) for i in range(3)]))

  w = jnp.asarray(rng.standard_normal(q.shape[:-1] + v.shape[-1:]))
  args = (q, k, v, sinks[0])
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape)) for x in args)
  hvp = lambda fn: jax.jvp(
      jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a)) * w), argnums=(0, 1, 2, 3)),
      args, tangents)[1]
  _close(jax.jit(lambda: hvp(attn))(), hvp(dense), rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("impl", IMPLS_FAST_XLA)
def test_varlen(impl, rng, x64):
  q, k, v, sinks = _problem(rng, B=1, T=41, S=50, Dv=56)
  q, k, v = q[0], k[0], v[0]
  cu_q, cu_k = np.array([0, 12, 12, 37]), np.array([0, 20, 31, 48])
  vis = reference.varlen_mask(cu_q, cu_k, 41, 50, causal=True)
  do = jnp.asarray(rng.standard_normal((41, 4, 56)))

  def f(q, k, v, s):
    return jax_flash.varlen_attention(
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), max_seqlen_q=25,
        max_seqlen_k=20, causal=True, sinks=s, implementation=impl)

  o, grads = jax.jit(lambda *a: _vjp(f, a, do))(q, k, v, sinks)
  kw = dict(visibility=vis, sinks=sinks)
  _close(o, reference.attention(q[None], k[None], v[None], **kw)[0][0])
  ref = reference.attention_vjp(q[None], k[None], v[None], do[None], **kw)
  _close(grads, (ref[0][0], ref[1][0], ref[2][0], ref[3]))


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache(paged, rng, x64):
  """Both features together: the reference path (the decoding kernels need
  D_v == D; their sinks: test_kvcache_sinks.py, test_decode_cuda.py)."""
  B, T, H, Hk, D, Dv, S_max = 2, 3, 4, 2, 40, 24, 32
  q, _, _, sinks = _problem(rng, B=B, T=T, H=H, Hk=Hk, D=D)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s))
  k_cache, v_cache = mk(B, S_max, Hk, D), mk(B, S_max, Hk, Dv)
  k_new, v_new = mk(B, T, Hk, D), mk(B, T, Hk, Dv)
  lens = np.array([5, 17])
  table = None
  kc, vc = k_cache, v_cache
  if paged:  # 8 pages of 8 slots, sequence b in pages [4b, 4b + 4), reversed
    table = jnp.asarray(np.array([[3, 2, 1, 0], [7, 6, 5, 4]]))
    page = lambda c: c.reshape(B, 4, 8, Hk, -1)[:, ::-1].reshape(
        8, 8, Hk, -1)
    kc, vc = page(k_cache), page(v_cache)
  o, lse, _, v_out = jax_flash.attention_with_kvcache(
      q, kc, vc, jnp.asarray(lens), k_new=k_new, v_new=v_new,
      page_table=table, causal=True, sinks=sinks, return_lse=True)
  assert v_out.shape == vc.shape
  for b in range(B):
    n = lens[b] + T
    k_b = jnp.concatenate([k_cache[b, :lens[b]], k_new[b]])[None]
    v_b = jnp.concatenate([v_cache[b, :lens[b]], v_new[b]])[None]
    ref_o, ref_lse = reference.attention(q[b:b + 1], k_b, v_b, causal=True,
                                         sinks=sinks)
    assert k_b.shape[1] == n
    _close((o[b:b + 1], lse[b:b + 1]), (ref_o, ref_lse))


def test_ring(rng, x64):
  devices = jax.devices()
  if len(devices) < 4:
    pytest.skip("needs 4 devices (conftest asks XLA for 8 host devices)")
  mesh = Mesh(np.array(devices[:4]), ("s",))
  q, k, v, sinks = _problem(rng, B=2, T=40, S=40, H=4, Hk=2, D=16, Dv=24)
  do = jnp.asarray(rng.standard_normal(q.shape[:-1] + v.shape[-1:]))
  dlse = jnp.asarray(rng.standard_normal((2, 4, 40)))

  def f(q, k, v, s):
    return jax_flash.ring_attention(q, k, v, mesh=mesh, seq_axis="s",
                                    causal=True, sinks=s, return_lse=True)

  out, grads = jax.jit(lambda *a: _vjp(f, a, (do, dlse)))(q, k, v, sinks)
  kw = dict(causal=True, sinks=sinks)
  _close(out, reference.attention(q, k, v, **kw))
  _close(grads, reference.attention_vjp(q, k, v, do, dlse=dlse, **kw))


@pytest.mark.parametrize("dense", [False, True])
def test_dot_product_attention(dense, rng, x64):
  """The jax.nn drop-in: blockwise, or the dense path (a mask array)."""
  q, k, v, sinks = _problem(rng, T=29, S=29)
  mask = None
  vis = reference.mask(29, 29, causal=True)
  if dense:
    vis = vis & (rng.random((2, 1, 29, 29)) < 0.7)
    vis[:, :, :, 0] = True  # jax.nn's empty rows average v; not this test
    mask = jnp.asarray(vis)
  f = lambda q, k, v, s: jax_flash.dot_product_attention(
      q, k, v, mask=mask, is_causal=True, sinks=s)
  do = jnp.asarray(rng.standard_normal(q.shape[:-1] + v.shape[-1:]))
  o, grads = jax.jit(lambda *a: _vjp(f, a, do))(q, k, v, sinks)
  kw = dict(visibility=vis[:, 0] if dense else vis, sinks=sinks)
  _close(o, reference.attention(q, k, v, **kw)[0])
  _close(grads, reference.attention_vjp(q, k, v, do, **kw))


@pytest.mark.gpu
def test_dot_product_attention_top_left_sinks_on_gpu(rng):
  """jax.nn's top-left alignment with T > S and a window leaves rows that
  see no key; on the CUDA kernels (a prefix of the rows) their LSE must be
  the sink, or the sinks' gradient meets exp(sink + inf) * 0 = NaN."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  T, S, H, D = 70, 40, 4, 64
  q, k, v, sinks = _problem(rng, T=T, S=S, H=H, Hk=2, D=D, Dv=D)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  sinks = sinks.astype(jnp.float32)
  f = lambda q, k, v, s: jax_flash.dot_product_attention(
      q, k, v, is_causal=True, local_window_size=(3, 0), sinks=s)
  do = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  o, grads = jax.jit(lambda *a: _vjp(f, a, do))(q, k, v, sinks)
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  vis = (j <= i) & (j >= i - 3)
  assert not vis[-1].any()  # rows that see no key
  f64 = lambda x: np.asarray(x, np.float64)
  kw = dict(visibility=vis[None], sinks=f64(sinks))
  want_o = reference.attention(f64(q), f64(k), f64(v), **kw)[0]
  want_g = reference.attention_vjp(f64(q), f64(k), f64(v), f64(do), **kw)
  for got, want in zip((o,) + tuple(grads), (want_o,) + tuple(want_g)):
    got = f64(got)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=3e-2 * max(np.abs(want).max(), 1e-3))


def test_flax_self_attention(rng, x64):
  """use_sinks adds a learnable 'sinks' [num_heads] parameter, value_head_dim
  the value projection's width; value and gradients match the module's
  math written out with the float64 reference attention."""
  jff = pytest.importorskip("jax_flash.flax")
  mod = jff.SelfAttention(num_heads=4, num_kv_heads=2, head_dim=16,
                          value_head_dim=24, use_sinks=True, causal=True,
                          param_dtype=jnp.float64)
  x = jnp.asarray(rng.standard_normal((2, 13, 20)))
  params = mod.init(jax.random.key(0), x)["params"]
  assert params["sinks"].shape == (4,)
  np.testing.assert_array_equal(params["sinks"], 0.0)  # the default init
  assert params["value"]["kernel"].shape == (20, 2, 24)
  params = dict(params, sinks=jnp.asarray(rng.normal(0.0, 2.0, 4)))

  def manual(p):
    proj = lambda name, x: (jnp.einsum("btf,fhd->bthd", x, p[name]["kernel"])
                            + p[name]["bias"])
    o = reference.dense_attention_jax(proj("query", x), proj("key", x),
                                      proj("value", x), causal=True,
                                      sinks=p["sinks"])[0]
    return jnp.einsum("bthd,hdf->btf", o, p["out"]["kernel"]) + p["out"][
        "bias"]

  w = jnp.asarray(rng.standard_normal((2, 13, 20)))
  y, grads = jax.jit(lambda p: _vjp(lambda p: mod.apply({"params": p}, x),
                                    (p,), w))(params)
  want_y, want_grads = jax.jit(lambda p: _vjp(manual, (p,), w))(params)
  _close((y, grads), (want_y, want_grads))


@pytest.mark.slow
def test_pallas_batch_head_sharded(rng):
  """custom_partitioning with sinks and a value head dim: each device runs
  its batch/head shard (sharding/rule.py's v/o factor e, the sinks' b H)."""
  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip("needs 8 devices")
  mesh = Mesh(np.array(devices[:8]).reshape(2, 4), ("b", "h"))
  q, k, v, sinks = (x.astype(jnp.float32) for x in _problem(
      rng, B=2, T=13, S=21, H=8, Hk=4, D=32, Dv=48))

  def run(q, k, v, s):
    f = lambda q, k, v, s: jax_flash.attention(
        q, k, v, sinks=s, causal=True, implementation="pallas",
        return_lse=True)
    (o, lse), vjp = jax.vjp(f, q, k, v, s)
    return o, lse, vjp((jnp.cos(o), jnp.sin(lse)))

  with jax.default_matmul_precision("highest"):
    want = jax.jit(run)(q, k, v, sinks)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    spec = P("b", None, "h")
    args = (put(q, spec), put(k, spec), put(v, spec), put(sinks, P("h")))
    compiled = jax.jit(run).lower(*args).compile()
    got = compiled(*args)
  assert "all-gather" not in compiled.as_text()
  _close(got, want, rtol=1e-5, atol=1e-5)


# -- refusals ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    np.zeros((5,), np.float32),           # not H
    np.zeros((1, 4), np.float32),         # not [H]
    np.zeros((4,), np.int32),             # not float
    [0.0, 0.0, 0.0, 0.0],                 # not an array
])
def test_bad_sinks_are_refused(bad, rng):
  q, k, v, _ = (x.astype(jnp.float32) for x in _problem(rng, B=1, T=5, S=5))
  lens = jnp.asarray([3])
  calls = [
      lambda: jax_flash.attention(q, k, v, sinks=bad),
      lambda: jax_flash.varlen_attention(
          q[0], k[0], v[0], jnp.asarray([0, 5]), jnp.asarray([0, 5]),
          max_seqlen_q=5, max_seqlen_k=5, sinks=bad),
      lambda: jax_flash.attention_with_kvcache(q, k, k, lens, sinks=bad),
      lambda: jax_flash.dot_product_attention(q, k, v, sinks=bad),
  ]
  for call in calls:
    with pytest.raises(ValueError, match="sinks"):
      call()


def test_bad_value_shapes_are_refused(rng):
  q, k, v, _ = (x.astype(jnp.float32) for x in _problem(rng, B=1, T=5, S=5))
  with pytest.raises(ValueError, match="value head_dim 300"):
    jax_flash.attention(q, k, jnp.zeros(k.shape[:-1] + (300,)))
  with pytest.raises(ValueError, match="key and value"):
    jax_flash.attention(q, k, v[:, :4])
  with pytest.raises(ValueError, match="fp8_attention.*value head_dim"):
    jax_flash.fp8_attention(q, k, v)


def test_cuda_refuses_by_name(rng):
  """implementation='cuda' names the argument it has no kernel for (before
  any platform or build reason: a value head dim outside the kernels'
  head-dim pairs); the default picks another backend. The pair (192, 128)
  passes that check (on a CPU it then fails for the platform)."""
  q, k, v, sinks = (x.astype(jnp.bfloat16) for x in _problem(
      rng, B=1, T=5, S=5, D=64, Dv=32))
  sinks = sinks.astype(jnp.float32)
  with pytest.raises(jax_flash.Unsupported,
                     match=r"'cuda'.*value head_dim.*\(192, 128\).*got \(64, 32\)"):
    jax_flash.attention(q, k, v, implementation="cuda")
  q192, k192, v128, _ = (x.astype(jnp.bfloat16) for x in _problem(
      rng, B=1, T=5, S=5, D=192, Dv=128))
  if jax.default_backend() == "cpu":
    with pytest.raises(jax_flash.Unsupported, match="'cuda'.*NVIDIA GPU"):
      jax_flash.attention(q192, k192, v128, implementation="cuda")
  with pytest.raises(jax_flash.Unsupported, match="'cuda'.*value head_dim"):
    jax_flash.attention_with_kvcache(q, k, v, jnp.asarray([3]),
                                     implementation="cuda")
  assert jax_flash.attention(q, k, v, sinks=sinks).shape == (1, 5, 4, 32)
