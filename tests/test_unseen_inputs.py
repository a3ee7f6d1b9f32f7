"""Keys and values that no query may see (past `kv_seq_lengths`, in a
segment no query has, past a cache's `cache_seqlens`, before every query's
window) may hold anything,
NaN and Inf included: a preallocated or paged cache holds whatever was there
before. On every backend such inputs must never reach an output or a
gradient: with NaN/Inf there the results equal those with finite values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash

IMPLS = ["xla", "pallas"]


def _qkv(rng, B, T, S, H, Hk, D):
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  return mk(B, T, H, D), mk(B, S, Hk, D), mk(B, S, Hk, D)


def _poison(x, bad):
  """x with NaN in the even and Inf in the odd positions where bad [B, S]."""
  S = x.shape[1]
  nan_or_inf = jnp.where(jnp.arange(S) % 2 == 0, jnp.nan, jnp.inf)[None, :, None, None]
  return jnp.where(bad[:, :, None, None], nan_or_inf, x)


def _results(f, q, k, v):
  o, vjp = jax.vjp(f, q, k, v)
  return (o,) + vjp(jnp.ones_like(o))


def _check_unseen(f, q, k, v, bad):
  """f's output and gradients with NaN/Inf in the keys and values at bad
  [B, S] equal those with the finite inputs (the unseen keys' dK, dV: 0)."""
  clean = _results(f, q, k, v)
  poisoned = _results(f, q, _poison(k, bad), _poison(v, bad))
  for name, a, b in zip(("o", "dq", "dk", "dv"), clean, poisoned):
    a, b = np.asarray(a), np.asarray(b)
    if name in ("dk", "dv"):
      a = np.where(np.asarray(bad)[:, :, None, None], 0.0, a)
    assert np.isfinite(b).all(), name
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_keys_past_kv_seq_lengths(impl, causal, rng):
  B, T, S, H, Hk, D = 2, 37, 83, 4, 2, 32
  q, k, v = _qkv(rng, B, T, S, H, Hk, D)
  lengths = jnp.array([61, 40])
  bad = jnp.arange(S)[None, :] >= lengths[:, None]
  f = lambda q, k, v: jax_flash.attention(
      q, k, v, kv_seq_lengths=lengths, causal=causal, implementation=impl)
  _check_unseen(f, q, k, v, bad)


@pytest.mark.parametrize("impl", IMPLS)
def test_keys_of_a_segment_no_query_has(impl, rng):
  """Packed rows whose tail keys carry a padding id (-1) that no query has."""
  B, T, S, H, Hk, D = 2, 45, 70, 2, 1, 64
  q, k, v = _qkv(rng, B, T, S, H, Hk, D)
  q_seg = jnp.asarray(np.repeat([[0] * 20 + [1] * 25], B, 0), jnp.int32)
  kv_seg = np.repeat([[0] * 30 + [1] * 28 + [-1] * 12], B, 0)
  kv_seg[1, 50:] = -1
  kv_seg = jnp.asarray(kv_seg, jnp.int32)
  bad = kv_seg == -1
  f = lambda q, k, v: jax_flash.attention(
      q, k, v, segment_ids=(q_seg, kv_seg), implementation=impl)
  _check_unseen(f, q, k, v, bad)


@pytest.mark.parametrize("impl", IMPLS)
def test_unread_cache_slots(impl, rng):
  """A preallocated cache: slots past cache_seqlens hold garbage."""
  B, T, S, H, Hk, D = 3, 2, 96, 4, 2, 64
  q, k, v = _qkv(rng, B, T, S, H, Hk, D)
  seqlens = jnp.array([5, 96, 50], jnp.int32)
  bad = jnp.arange(S)[None, :] >= seqlens[:, None]
  f = lambda k, v: jax_flash.attention_with_kvcache(
      q, k, v, seqlens, implementation=impl)
  clean, poisoned = f(k, v), f(_poison(k, bad), _poison(v, bad))
  assert np.isfinite(np.asarray(poisoned)).all()
  np.testing.assert_allclose(np.asarray(poisoned), np.asarray(clean),
                             atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_keys_before_every_window(impl, rng):
  """A sliding window (bottom-right aligned, T < S): the keys before the
  first query's window are seen by no query."""
  B, T, S, H, Hk, D = 1, 20, 100, 2, 2, 32
  q, k, v = _qkv(rng, B, T, S, H, Hk, D)
  left = 8
  bad = jnp.broadcast_to(jnp.arange(S)[None, :] < S - T - left, (B, S))
  f = lambda q, k, v: jax_flash.attention(q, k, v, window=(left, 0),
                                          implementation=impl)
  _check_unseen(f, q, k, v, bad)
