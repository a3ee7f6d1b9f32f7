"""Learnable sinks through the decoding kernels' path of
`attention_with_kvcache`, on the CPU: the kernel call replaced by its
contract (decode_contract.py), so this checks the Python wiring (the sinks
operand, its order among the caches, descales and tables, the sharding and
vmap wrappers, gradients through the reference path with the sinks' own).
The kernels themselves: cuda/tests/selftest_decode.cu (emulator, float64
reference: one split and several, GQA packing, empty rows, paged, FP8) and
tests/test_decode_cuda.py on a GPU.

Every cache slot that no query may read (past a sequence's length, pages no
sequence maps) holds NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import reference
from decode_contract import use_contract

B, H, H_KV, D, S_MAX, PAGE = 3, 6, 2, 24, 80, 16


def _caches(rng, seqlens, paged):
  """(k_cache, v_cache, extra kwargs, k_seq, v_seq): NaN outside each
  sequence's first seqlens[b] keys; paged: a shuffled table over a pool with
  two spare pages."""
  k_seq = rng.standard_normal((B, S_MAX, H_KV, D))
  v_seq = rng.standard_normal((B, S_MAX, H_KV, D))
  if paged:
    n = S_MAX // PAGE
    table = rng.permutation(B * n + 2)[:B * n].reshape(B, n).astype(np.int32)
    k_cache = np.full((B * n + 2, PAGE, H_KV, D), np.nan)
    v_cache = np.full_like(k_cache, np.nan)
    for b in range(B):
      for j in range(seqlens[b]):
        k_cache[table[b, j // PAGE], j % PAGE] = k_seq[b, j]
        v_cache[table[b, j // PAGE], j % PAGE] = v_seq[b, j]
    extra = dict(page_table=jnp.asarray(table))
  else:
    rows = np.array([2, 0, 1], np.int32)
    k_cache = np.full((B, S_MAX, H_KV, D), np.nan)
    v_cache = np.full_like(k_cache, np.nan)
    for b in range(B):
      k_cache[rows[b], :seqlens[b]] = k_seq[b, :seqlens[b]]
      v_cache[rows[b], :seqlens[b]] = v_seq[b, :seqlens[b]]
    extra = dict(cache_batch_idx=jnp.asarray(rows))
  return jnp.asarray(k_cache), jnp.asarray(v_cache), extra, k_seq, v_seq


def _reference(q, k_seq, v_seq, seqlens, sinks, **kw):
  """float64 (o, lse) per sequence over its first seqlens[b] keys (none:
  O = 0, LSE = the sink)."""
  o = np.zeros(q.shape)
  lse = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None],
                        (q.shape[0], q.shape[2], q.shape[1])).copy()
  for b in range(q.shape[0]):
    L = seqlens[b]
    if L:
      o[b], lse[b] = (x[0] for x in reference.attention(
          q[b:b + 1], k_seq[b:b + 1, :L], v_seq[b:b + 1, :L], sinks=sinks,
          **kw))
  return o, lse


@pytest.mark.parametrize("paged, splits", [(False, 1), (True, 3)],
                         ids=["contiguous-split1", "paged-split3"])
def test_kernel_path_with_sinks(paged, splits, rng, x64, monkeypatch):
  calls = use_contract(monkeypatch)
  seqlens = np.array([0, 37, S_MAX], np.int32)  # empty, odd, full
  T = 3
  q = jnp.asarray(rng.standard_normal((B, T, H, D)))
  sinks = jnp.asarray(rng.normal(0.5, 2.0, H))
  k_cache, v_cache, extra, k_seq, v_seq = _caches(rng, seqlens, paged)
  kw = dict(causal=True, window=(30, -1))
  fn = lambda q, s, impl=None: jax_flash.attention_with_kvcache(
      q, k_cache, v_cache, jnp.asarray(seqlens), **extra, **kw, sinks=s,
      return_lse=True, num_splits=splits, implementation=impl)
  o, lse = jax.jit(fn)(q, sinks)
  assert calls == [splits]
  want_o, want_lse = _reference(np.asarray(q), k_seq, v_seq, seqlens,
                                np.asarray(sinks), **kw)
  np.testing.assert_allclose(np.asarray(o), want_o, atol=1e-10)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-10)
  # The empty sequence: O = 0, LSE = the sink.
  np.testing.assert_array_equal(np.asarray(o[0]), 0.0)
  np.testing.assert_allclose(np.asarray(lse[0]),
                             np.broadcast_to(np.asarray(sinks)[:, None],
                                             (H, T)))
  # Gradients in q and the sinks (theirs from o and lse) match the
  # reference path's, from cotangents on both outputs.
  w_o = jnp.asarray(rng.standard_normal(o.shape))
  w_l = jnp.asarray(rng.standard_normal(lse.shape))
  loss = lambda impl: lambda q, s: sum(
      jnp.sum(x * w) for x, w in zip(fn(q, s, impl), (w_o, w_l)))
  got = jax.jit(jax.grad(loss(None), argnums=(0, 1)))(q, sinks)
  want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1)))(q, sinks)
  for g, w in zip(got, want):
    assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-10)


def test_vmap_over_sinks(rng, x64, monkeypatch):
  """Per-element sinks under vmap (folded into the batch with q): each
  element with its own."""
  calls = use_contract(monkeypatch)
  seqlens = np.array([5, 37, 61], np.int32)
  k_cache, v_cache, extra, k_seq, v_seq = _caches(rng, seqlens, paged=True)
  qs = jnp.asarray(rng.standard_normal((2, B, 1, H, D)))
  sinks = jnp.asarray(rng.normal(0.0, 2.0, (2, H)))
  fn = lambda q, s: jax_flash.attention_with_kvcache(
      q, k_cache, v_cache, jnp.asarray(seqlens), **extra, sinks=s)
  got = jax.jit(jax.vmap(fn))(qs, sinks)
  assert calls and calls[-1] is None
  for i in range(2):
    want, _ = _reference(np.asarray(qs[i]), k_seq, v_seq, seqlens,
                         np.asarray(sinks[i]), causal=True)
    np.testing.assert_allclose(np.asarray(got[i]), want, atol=1e-10)


def test_fp8_cache_with_sinks(rng, monkeypatch):
  """An FP8 cache: the sinks before the descales in the op's operands; the
  same o, lse and sinks gradient as the reference path on that cache."""
  calls = use_contract(monkeypatch)
  seqlens = np.array([0, 23, 48], np.int32)
  x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, sinks = x(B, 2, H, 64), jnp.asarray(rng.normal(0.5, 2.0, H), jnp.float32)
  kq, vq = (jax_flash.quantize_kv_cache(x(B, 48, H_KV, 64), rotate=True,
                                        seed=3) for _ in range(2))
  fn = lambda q, s, impl=None: jax_flash.attention_with_kvcache(
      q, kq, vq, jnp.asarray(seqlens), sinks=s, return_lse=True,
      implementation=impl)
  loss = lambda impl: lambda q, s: jnp.sum(
      jnp.sin(fn(q, s, impl)[0])) + jnp.sum(jnp.cos(fn(q, s, impl)[1]))
  with jax.default_matmul_precision("highest"):
    got = jax.jit(fn)(q, sinks)
    assert calls == [None]
    want = jax.jit(lambda q, s: fn(q, s, "xla"))(q, sinks)
    g = jax.jit(jax.grad(loss(None), argnums=(0, 1)))(q, sinks)
    g_want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1)))(q, sinks)
  for a, b in zip(got + g, want + g_want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
  np.testing.assert_allclose(np.asarray(got[1][0]),
                             np.broadcast_to(np.asarray(sinks)[:, None],
                                             (H, 2)), atol=1e-6)
