"""Attention dropout in jax_flash.ring_attention over the 8 host devices.

Each ring step draws its blocks' masks at their global (row, column) origin,
so the ring gives the single-device mask: o, lse and gradients (through o
and lse) against the float64 reference given that mask explicitly
(core/dropout.py keep_mask at global positions; the project's error
criterion) and against the unsharded `jax_flash.attention` with the same key;
causal and not, zigzag and contiguous layouts, the all_gather strategy, GQA,
batch/head meshes, packed documents that cross shards, keys of no query's
document holding NaN/Inf, a sliding window, the broadcast mask; the Pallas
per-step kernels (interpret mode); the inside-shard_map entry with the
preordered zigzag layout; the plan's one-pair calls; the cuda backend's
refusal of block origins; argument errors.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flash
import reference
import ring_helpers
from jax_flash._src.backends import registry as backends
from jax_flash._src.backends.cuda import CudaBackend
from jax_flash._src.core import dropout
from jax_flash._src.core.spec import AttentionSpec
from jax_flash._src.ring import plan as ring_plan
from jax_flash._src.ring import zigzag

_mesh = ring_helpers.mesh
_weights = ring_helpers.weights
_loss = ring_helpers.loss
_fwd_and_grads = ring_helpers.fwd_and_grads


RATE = 0.25
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _ieee_float32():
  with jax.default_matmul_precision("highest"):
    yield


def _qkv(rng, B, T, H, Hk, D, dtype=np.float32):
  mk = lambda *s: jnp.asarray(rng.standard_normal(s).astype(dtype))
  return mk(B, T, H, D), mk(B, T, Hk, D), mk(B, T, Hk, D)


def _documents(rng, B, T):
  """Packed documents of 1..13 tokens (they cross shard boundaries), the
  queries of one document given an id no key has (rows that see no key),
  and a tail of keys with an id no query has: (q_ids, kv_ids, unseen keys)."""
  ids = np.zeros((B, T), np.int32)
  for b in range(B):
    ids[b] = np.searchsorted(np.cumsum(rng.integers(1, 14, T)), np.arange(T),
                             side="right")
  q_ids, kv_ids = ids.copy(), ids.copy()
  q_ids[q_ids == 1] = 1000
  kv_ids[:, -5:] = -1
  return jnp.asarray(q_ids), jnp.asarray(kv_ids), kv_ids == -1


def _poison(x, bad):
  """x with NaN / Inf at the keys `bad` [B, S]."""
  nan_or_inf = jnp.where(jnp.arange(x.shape[1]) % 2 == 0, jnp.nan, jnp.inf)
  return jnp.where(jnp.asarray(bad)[:, :, None, None],
                   nan_or_inf[None, :, None, None].astype(x.dtype), x)


def _keep(key, B, H, T, rate=RATE, broadcast=False):
  """The scaled keep mask [B, H, T, T] of the whole request."""
  b = jnp.arange(B)[:, None, None, None]
  h = jnp.arange(H)[None, :, None, None]
  if broadcast:
    b, h = 0 * b, 0 * h
  keep = dropout.keep_mask(dropout.seed_words(key), b, h,
                           jnp.arange(T)[None, None, :, None],
                           jnp.arange(T)[None, None, None, :], rate)
  return np.asarray(keep, np.float64) * dropout.keep_scale(rate)


def _check_vs_reference(got, q, k, v, keep, **kw):
  """The error criterion against float64 with the mask `keep` given."""
  (o, lse), grads = got
  ref_o, ref_lse = reference.attention(q, k, v, keep=keep, **kw)
  dense = functools.partial(reference.dense_attention_jax, keep=keep, **kw)
  (base_o, base_lse), base_g = jax.jit(
      functools.partial(_fwd_and_grads, dense))(q, k, v)
  reference.assert_close_to_reference("o", o, ref_o, base_o)
  reference.assert_close_to_reference("lse", lse, ref_lse, base_lse)
  dlse = np.where(np.isfinite(ref_lse), 0.1, 0.0)
  ref_g = reference.attention_vjp(q, k, v, np.asarray(_weights(o.shape)),
                                  dlse=dlse, keep=keep, **kw)
  for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref_g, base_g):
    reference.assert_close_to_reference(name, g, r, b)


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape)
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    fin = np.isfinite(y)
    np.testing.assert_array_equal(x[~fin], y[~fin])
    np.testing.assert_allclose(x[fin], y[fin], **TOL)


# (mesh, B, T, H, H_kv, D, options). T / chunks: 3 (zigzag on 8), 5 (zigzag
# on 4, contiguous on 8), 11 (contiguous on 4): no tile multiple.
CASES = {
    "seq8_causal_zigzag": ("seq8", 2, 48, 4, 2, 16, dict(causal=True)),
    "batch2_seq4_documents_zigzag": ("batch2_seq4", 2, 40, 4, 2, 16, dict(
        causal=True, documents=True)),
    "batch2_seq4_documents_all_gather": ("batch2_seq4", 2, 40, 4, 2, 16, dict(
        causal=True, documents=True, strategy="all_gather")),
    "seq8_full_contiguous_all_gather": ("seq8", 1, 40, 2, 1, 16, dict(
        layout="contiguous", strategy="all_gather")),
    "heads2_seq4_window_contiguous": ("heads2_seq4", 1, 44, 4, 2, 16, dict(
        window=(7, 3), softcap=4.0)),
    "seq8_broadcast_zigzag": ("seq8", 2, 48, 4, 4, 8, dict(
        causal=True, dropout_broadcast=True)),
}
FAST = ("batch2_seq4_documents_zigzag",)


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=() if c in FAST else pytest.mark.slow)
    for c in CASES])
def test_matches_reference_and_one_device(case, rng):
  """jit on NamedSharding inputs: the ring's o, lse and grads with dropout vs
  float64 with the single-device mask, and vs jax_flash.attention with the
  same key (a mask drawn elsewhere would differ by O(1)). With packed
  documents the keys no query's document holds are NaN/Inf in the ring's
  inputs: nothing of them reaches a result."""
  mesh_name, B, T, H, Hk, D, kw = CASES[case]
  mesh, axes, spec = _mesh(mesh_name)
  q, k, v = _qkv(rng, B, T, H, Hk, D)
  kw = dict(kw)
  layout, strategy = kw.pop("layout", None), kw.pop("strategy", "ring")
  broadcast = kw.pop("dropout_broadcast", False)
  unseen = None
  if kw.pop("documents", False):
    q_ids, kv_ids, unseen = _documents(rng, B, T)
    kw["segment_ids"] = (q_ids, kv_ids)
  key = jax.random.key(int(rng.integers(1 << 30)))
  drop = dict(dropout_rate=RATE, dropout_rng=key, dropout_broadcast=broadcast)

  def ring_attn(q, k, v):
    return jax_flash.ring_attention(q, k, v, mesh=mesh, layout=layout,
                                    strategy=strategy, return_lse=True,
                                    **axes, **kw, **drop)

  def one_device(q, k, v):
    return jax_flash.attention(q, k, v, return_lse=True, **kw, **drop)

  sh = NamedSharding(mesh, spec)
  ring_k, ring_v = (k, v) if unseen is None else (_poison(k, unseen),
                                                  _poison(v, unseen))
  qs, ks, vs = (jax.device_put(x, sh) for x in (q, ring_k, ring_v))
  got = jax.jit(functools.partial(_fwd_and_grads, ring_attn))(qs, ks, vs)
  if unseen is not None:
    for g in got[1][1:]:  # dk, dv of keys no query sees
      assert not np.any(np.asarray(g)[unseen])
  _check_vs_reference(got, q, k, v, _keep(key, B, H, T, broadcast=broadcast),
                      **kw)
  _close(got, jax.jit(functools.partial(_fwd_and_grads, one_device))(q, k, v))


@pytest.mark.parametrize("n,kw", [
    (2, dict(causal=True)),  # zigzag: chunks of 3
    (4, dict(window=(5, 2), layout="contiguous")),
])
@pytest.mark.slow
def test_pallas_per_step_kernels(n, kw, rng):
  """The Pallas backend's kernels (interpret mode on CPU) as the ring's
  per-step kernels draw the single-device mask too."""
  if "pallas" not in jax_flash.available_implementations():
    pytest.skip("pallas backend not registered")
  mesh, axes, _ = _mesh(f"seq{n}")
  B, T, H, Hk, D = 1, 6 * n, 2, 1, 32
  q, k, v = _qkv(rng, B, T, H, Hk, D)
  key = jax.random.key(int(rng.integers(1 << 30)))
  attn = functools.partial(jax_flash.ring_attention, mesh=mesh,
                           return_lse=True, implementation="pallas",
                           dropout_rate=RATE, dropout_rng=key, **axes, **kw)
  got = jax.jit(functools.partial(_fwd_and_grads, attn))(q, k, v)
  kw.pop("layout", None)
  _check_vs_reference(got, q, k, v, _keep(key, B, H, T), **kw)


@pytest.mark.slow
def test_inside_shard_map_preordered(rng):
  """mesh=None inside the user's shard_map on inputs kept in zigzag order:
  the mask of the natural positions, as one device draws it."""
  mesh, _, _ = _mesh("seq4")
  n = 4
  B, T, H, Hk, D = 1, 40, 2, 2, 16
  q, k, v = _qkv(rng, B, T, H, Hk, D)
  key = jax.random.key(int(rng.integers(1 << 30)))
  perm = lambda x, a=1: zigzag.zigzag_permute(x, n, a)
  unperm = lambda x, a=1: zigzag.zigzag_unpermute(x, n, a)

  def local(q, k, v):
    return jax_flash.ring_attention(q, k, v, seq_axis="s", causal=True,
                                    layout="zigzag_preordered",
                                    return_lse=True, dropout_rate=RATE,
                                    dropout_rng=key)

  attn_sm = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "s"),) * 3,
                          out_specs=(P(None, "s"), P(None, None, "s")))

  def attn(q, k, v):
    o, lse = attn_sm(perm(q), perm(k), perm(v))
    return unperm(o), unperm(lse, 2)

  got = jax.jit(functools.partial(_fwd_and_grads, attn))(q, k, v)
  _check_vs_reference(got, q, k, v, _keep(key, B, H, T), causal=True)


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (5, 0)])
def test_plan_calls_with_dropout_are_one_pair_each(window):
  """With dropout each kernel call is one (q chunk, kv chunk) pair (it has
  one global origin), covering the pairs the merged calls cover."""
  base = AttentionSpec(scale=0.25, window_left=window[0],
                       window_right=window[1], q_len=12, kv_len=12)
  drop = dataclasses.replace(base, dropout_rate=RATE, dropout_origin=3)
  for zigzag in (True, False):
    for step, step_d in zip(ring_plan.plan(base, 4, zigzag),
                            ring_plan.plan(drop, 4, zigzag)):
      assert step.shift == step_d.shift and step.table == step_d.table
      for case, case_d in zip(step.cases, step_d.cases):
        calls, calls_d = ring_plan.calls(case), ring_plan.calls(case_d)
        assert all(c.q1 - c.q0 == 1 and c.k1 - c.k0 == 1 for c in calls_d)
        want = {(a, b): p for a, row in enumerate(case_d)
                for b, p in enumerate(row) if p is not None}
        assert {(c.q0, c.k0): c.spec for c in calls_d} == want
        # The same visible pairs as the merged calls of the same case.
        seen = lambda cs: {(a, b) for c in cs for a in range(c.q0, c.q1)
                           for b in range(c.k0, c.k1)}
        assert set(want) <= seen(calls) and len(calls_d) >= len(calls)


@pytest.mark.parametrize("chunk,served", [(96, False), (128, True)])
def test_cuda_serves_block_origins_on_64_column_chunks(chunk, served):
  """The CUDA kernels draw dropout in 64-column chunks: ring blocks whose
  column origins are multiples of 64 are theirs (when the extension and a
  GPU are there), others are refused naming the chunk length, and the
  default choice falls back to a backend that serves them."""
  spec = AttentionSpec(scale=0.125, batch=1, q_len=chunk, kv_len=chunk,
                       num_heads=2, num_kv_heads=2, head_dim=64,
                       dtype="bfloat16", dropout_rate=0.1,
                       dropout_origin=chunk)
  if not served:
    with pytest.raises(backends.Unsupported, match="64-column chunks"):
      CudaBackend().check(spec, "gpu")
    assert backends.choose(spec, None, "gpu").name in ("xla", "pallas")
    return
  try:
    CudaBackend().check(spec, "gpu")
  except backends.Unsupported as e:  # no extension or no GPU here
    assert "64-column" not in str(e), e


def test_cuda_implementation_is_refused_in_the_ring_off_64_columns(rng):
  mesh, axes, _ = _mesh("seq8")
  q, k, v = _qkv(rng, 1, 16, 2, 2, 64, np.float16)
  with pytest.raises(backends.Unsupported, match="64-column chunks"):
    jax_flash.ring_attention(q, k, v, mesh=mesh, implementation="cuda",
                             dropout_rate=0.1, dropout_rng=jax.random.key(0),
                             **axes)


@pytest.mark.parametrize("kw,match", [
    (dict(dropout_rate=0.1), "needs dropout_rng"),
    (dict(dropout_rng=jax.random.key(0)), "dropout_rate=0.0"),
    (dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), r"\[0, 1\)"),
    (dict(dropout_rate=0.1, dropout_rng=jnp.zeros((3,), jnp.float32)),
     "dropout_rng must be a jax.random key"),
])
def test_errors(kw, match, rng):
  mesh, axes, _ = _mesh("seq8")
  q, k, v = _qkv(rng, 1, 16, 2, 2, 8)
  with pytest.raises(ValueError, match=match):
    jax_flash.ring_attention(q, k, v, mesh=mesh, **axes, **kw)


@pytest.mark.gpu
def test_cuda_ring_blocks_draw_the_single_device_mask(rng):
  """On one GPU a one-device ring still runs block calls at nonzero row and
  column origins (zigzag: chunk pairs (0, 1) and (1, 0)); the CUDA kernels
  must draw there what xla draws: same outputs and gradients to bf16
  rounding. Chunks of 192 tokens (a multiple of 64, not of 128), GQA."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  try:
    CudaBackend().check(AttentionSpec(
        scale=0.125, batch=1, q_len=192, kv_len=192, num_heads=4,
        num_kv_heads=2, head_dim=64, dtype="bfloat16", dropout_rate=RATE,
        dropout_origin=192), "gpu")
  except backends.Unsupported as e:
    pytest.skip(f"cuda: {e}")
  mesh = Mesh(np.array(jax.devices()[:1]), ("s",))
  T, layout = 384, "zigzag"
  q, k, v = _qkv(rng, 2, T, 4, 2, 64, np.float32)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  key = jax.random.key(11)
  run = lambda impl: jax.jit(functools.partial(_fwd_and_grads, functools.partial(
      jax_flash.ring_attention, mesh=mesh, seq_axis="s", layout=layout,
      causal=True, dropout_rate=RATE, dropout_rng=key, return_lse=True,
      implementation=impl)))(q, k, v)
  f64 = lambda x: np.asarray(x, np.float64)
  for got, want in zip(jax.tree.leaves(run("cuda")),
                       jax.tree.leaves(run("xla"))):
    got, want = f64(got), f64(want)
    assert np.isfinite(got).all()
    # A mask drawn elsewhere differs by O(1) in a quarter of the entries.
    np.testing.assert_allclose(got, want, atol=3e-2 * np.abs(want).max(),
                               rtol=0)
