"""Long chunks of new tokens (a prompt's prefill) in `attention_with_kvcache`:
more than decode_cuda.PREFILL_MIN_TOKENS go to the dense path (`attention`
with kv_seq_lengths: the dense forward kernels on a GPU), fewer to the
decoding kernels. On the CPU the kernels are replaced by their contract
(decode_contract.py), so both routes run; GPU: tests/test_decode_cuda.py.

The dense path must be the kvcache semantics exactly: the new tokens land at
each sequence's end, the queries are its last T_new tokens (causal and
window bands aligned there). Checked against float64 per sequence, against
the unrouted call (the same chunk on the kernel path), and against the same
prompt fed in short chunks. Unread cache slots hold NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import reference
from decode_contract import use_contract
from jax_flash._src.decode import cuda as decode_cuda

B, H, H_KV, D, CAP, PAGE = 2, 4, 2, 16, 160, 32
LONG = decode_cuda.PREFILL_MIN_TOKENS + 13  # routed to the dense path


def _setup(rng, layout, seqlens, dtype, fp8=False):
  """(k_cache, v_cache, extra kwargs, views) with NaN in every slot past
  seqlens; views(k_cache) -> each sequence's [B, CAP, H_KV, D] in float64."""
  seq = rng.standard_normal((2, B, CAP, H_KV, D))
  seq[:, np.arange(CAP)[None, :] >= np.asarray(seqlens)[:, None]] = np.nan
  if layout == "paged":
    n = CAP // PAGE
    table = rng.permutation(B * n + 2)[:B * n].reshape(B, n).astype(np.int32)
    pool = np.full((2, B * n + 2, PAGE, H_KV, D), np.nan)
    pool[:, table] = seq.reshape(2, B, n, PAGE, H_KV, D)
    extra = dict(page_table=jnp.asarray(table))
    view = lambda c: c[table].reshape(B, CAP, H_KV, D)
  elif layout == "rows":  # cache_batch_idx over a cache with a spare row
    rows = np.array([2, 0], np.int32)
    pool = np.full((2, B + 1, CAP, H_KV, D), np.nan)
    pool[:, rows] = seq
    extra = dict(cache_batch_idx=jnp.asarray(rows))
    view = lambda c: c[rows]
  else:  # row b is sequence b
    pool, extra, view = seq, {}, lambda c: c
  k, v = (jnp.asarray(x, dtype) for x in pool)
  if fp8:
    k, v = (jax_flash.quantize_kv_cache(x) for x in (k, v))
    views = lambda c: np.asarray(view(np.asarray(c.dequantize())), np.float64)
  else:
    views = lambda c: np.asarray(view(np.asarray(c)), np.float64)
  return k, v, extra, views


def _reference(q, k_seq, v_seq, lengths, sinks, **kw):
  """float64 out per sequence: q attends to its first lengths[b] keys."""
  return np.concatenate([reference.attention(
      q[b:b + 1], k_seq[b:b + 1, :lengths[b]], v_seq[b:b + 1, :lengths[b]],
      sinks=sinks, **kw)[0] for b in range(q.shape[0])])


@pytest.mark.parametrize("layout, kw", [
    ("identity", dict(causal=True)),
    ("rows", dict(causal=True, window=(50, 0))),
    ("paged", dict(causal=True, window=(50, 0))),
], ids=["identity-causal", "rows-window", "paged-window"])
def test_long_chunk_takes_the_dense_path(layout, kw, rng, x64, monkeypatch):
  calls = use_contract(monkeypatch)
  seqlens = np.array([0, 61], np.int32)
  k_cache, v_cache, extra, views = _setup(rng, layout, seqlens, jnp.float64)
  x = lambda *s: jnp.asarray(rng.standard_normal(s))
  q, k_new, v_new = x(B, LONG, H, D), x(B, LONG, H_KV, D), x(B, LONG, H_KV, D)
  sinks = jnp.asarray(rng.normal(0.0, 2.0, H))

  def step(q, k_new, v_new):
    return jax_flash.attention_with_kvcache(
        q, k_cache, v_cache, jnp.asarray(seqlens), k_new=k_new, v_new=v_new,
        **extra, **kw, sinks=sinks)

  out, kc, vc = jax.jit(step)(q, k_new, v_new)
  assert calls == []  # no decoding kernel call
  k_seq, v_seq = views(kc), views(vc)
  for b in range(B):  # the new tokens at each sequence's end
    L = seqlens[b]
    np.testing.assert_array_equal(k_seq[b, L:L + LONG], k_new[b])
    np.testing.assert_array_equal(v_seq[b, L:L + LONG], v_new[b])
  want = _reference(np.asarray(q), k_seq, v_seq, seqlens + LONG,
                    np.asarray(sinks), **kw)
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-10)
  # The unrouted call (the kernel path; traced anew) gives the same.
  monkeypatch.setattr(decode_cuda, "PREFILL_MIN_TOKENS", LONG)
  unrouted, kc2, vc2 = jax.jit(lambda *a: step(*a))(q, k_new, v_new)
  assert len(calls) == 1
  # A cache whose row b is sequence b takes the append kernel, the others
  # XLA's scatter; both leave the same caches.
  assert calls.appends == (layout == "identity")
  np.testing.assert_array_equal(np.asarray(kc2), np.asarray(kc))
  np.testing.assert_array_equal(np.asarray(vc2), np.asarray(vc))
  np.testing.assert_allclose(np.asarray(unrouted), np.asarray(out),
                             atol=1e-10)


@pytest.mark.parametrize("fp8", [pytest.param(False, marks=pytest.mark.slow),
                                 True], ids=["bf16", "fp8"])
def test_prefill_equals_short_chunks(fp8, rng, monkeypatch):
  """One call of a long prompt (dense path) gives the outputs and caches of
  the same prompt fed in chunks (kernel path), rows at different lengths."""
  calls = use_contract(monkeypatch)
  seqlens = np.array([9, 40], np.int32)
  dt = jnp.float32 if fp8 else jnp.bfloat16
  k_cache, v_cache, extra, views = _setup(rng, "paged", seqlens, dt, fp8)
  T = LONG + 7
  x = lambda *s: jnp.asarray(rng.standard_normal(s), dt)
  q, k_new, v_new = x(B, T, H, D), x(B, T, H_KV, D), x(B, T, H_KV, D)
  step = jax.jit(lambda q, kc, vc, n, kn, vn: jax_flash.attention_with_kvcache(
      q, kc, vc, n, k_new=kn, v_new=vn, **extra, window=(70, 0)))
  whole, kc, vc = step(q, k_cache, v_cache, jnp.asarray(seqlens), k_new, v_new)
  assert calls == []
  parts, kp, vp, at = [], k_cache, v_cache, 0
  for n in (decode_cuda.PREFILL_MIN_TOKENS, 1, T - 1 -
            decode_cuda.PREFILL_MIN_TOKENS):
    chunk = slice(at, at + n)
    o, kp, vp = step(q[:, chunk], kp, vp, jnp.asarray(seqlens + at),
                     k_new[:, chunk], v_new[:, chunk])
    parts.append(o)
    at += n
  assert len(calls) == 3
  np.testing.assert_array_equal(views(kp), views(kc))
  np.testing.assert_array_equal(views(vp), views(vc))
  # The same math in another association: float32 accumulation apart, then
  # the output's rounding (bf16: 2^-8 relative).
  got, want = (np.asarray(x, np.float64) for x in
               (jnp.concatenate(parts, 1), whole))
  tol = 2e-5 if fp8 else 2 ** -7 * np.abs(want).max()
  np.testing.assert_allclose(got, want, atol=tol)
