"""FP8 (e4m3) KV caches: `quantize_kv_cache`, appends, and
`attention_with_kvcache` on them (reference path here; the kernel path's
wiring with the kernel call replaced by the reference; the kernels
themselves: tests/test_decode_cuda.py on a GPU, cuda/tests/selftest_decode.cu
in the emulator)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import reference
from jax_flash._src.decode import fp8_cache

B, H, H_KV, D, S = 2, 4, 2, 64, 48


def _x(rng, *shape, outliers=True):
  x = rng.standard_normal(shape)
  if outliers:
    x[..., 5] *= 8.0  # one loud channel: what the rotation is for
  return x


@pytest.mark.parametrize("rotate", [True, False])
def test_quantize_round_trip(rotate, rng):
  x = _x(rng, 3, 16, H_KV, D)
  c = jax_flash.quantize_kv_cache(jnp.asarray(x, jnp.float32), rotate=rotate,
                                  seed=3)
  assert c.data.dtype == jnp.float8_e4m3fn and c.data.shape == x.shape
  assert c.descale.shape == (3, H_KV, 16)
  err = np.abs(np.asarray(c.dequantize()) - x).max(-1)
  amax = np.abs(x).max(-1)
  # e4m3: 3 mantissa bits, so at most 1/16 of the row's amax per element
  # (rotated: of the rotated row's amax, never more than the row's norm).
  bound = (np.linalg.norm(x, axis=-1) if rotate else amax) / 16 + 1e-6
  assert (err <= bound).all()
  # With per-row scales, e4m3's floating point keeps a loud channel's
  # neighbours precise: the rotation does not lower the error (why it is off
  # by default).
  if rotate:
    plain = jax_flash.quantize_kv_cache(jnp.asarray(x, jnp.float32))
    rms = lambda c: np.sqrt(((np.asarray(c.dequantize()) - x) ** 2).mean())
    assert rms(plain) <= rms(c)


def _dense_reference(q, k, v, seqlens, **kw):
  outs = []
  for b in range(q.shape[0]):
    L = int(seqlens[b])
    o, _ = reference.attention(q[b:b + 1], k[b:b + 1, :L], v[b:b + 1, :L],
                               **kw)
    outs.append(o[0])
  return np.stack(outs)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_attention_on_fp8_cache_with_appends(paged, rng):
  """Appended tokens are quantised into the cache; the attention equals
  float64 attention on the dequantised cache."""
  t_new = 3
  seqlens = np.array([5, S - t_new], np.int32)
  q = _x(rng, B, t_new, H, D)
  k_seq, v_seq = _x(rng, B, S, H_KV, D), _x(rng, B, S, H_KV, D)
  k_new, v_new = _x(rng, B, t_new, H_KV, D), _x(rng, B, t_new, H_KV, D)
  extra = {}
  if paged:
    page = 8
    table = rng.permutation(B * S // page).reshape(B, -1).astype(np.int32)
    kc = np.zeros((B * S // page, page, H_KV, D))
    vc = np.zeros_like(kc)
    for b in range(B):
      for p in range(table.shape[1]):
        kc[table[b, p]] = k_seq[b, p * page:(p + 1) * page]
        vc[table[b, p]] = v_seq[b, p * page:(p + 1) * page]
    extra["page_table"] = jnp.asarray(table)
  else:
    kc, vc = k_seq, v_seq
  kq = jax_flash.quantize_kv_cache(jnp.asarray(kc, jnp.float32),
                                   rotate=paged, seed=1)
  vq = jax_flash.quantize_kv_cache(jnp.asarray(vc, jnp.float32),
                                   rotate=paged, seed=1)
  step = jax.jit(lambda q, kq, vq, s, kn, vn: jax_flash.attention_with_kvcache(
      q, kq, vq, s, k_new=kn, v_new=vn, causal=True, **extra),
      donate_argnums=(1, 2))
  out, kq2, vq2 = step(jnp.asarray(q, jnp.float32), kq, vq,
                       jnp.asarray(seqlens), jnp.asarray(k_new, jnp.float32),
                       jnp.asarray(v_new, jnp.float32))
  assert isinstance(kq2, jax_flash.Fp8KVCache)
  # Dense per-sequence view of the updated, dequantised cache.
  kd, vd = np.asarray(kq2.dequantize()), np.asarray(vq2.dequantize())
  if paged:
    gather = lambda c: c[table].reshape(B, S, H_KV, D)
    kd, vd = gather(kd), gather(vd)
  for b in range(B):  # the new rows, quantised
    L = seqlens[b]
    np.testing.assert_allclose(kd[b, L:L + t_new], k_new[b],
                               atol=np.abs(k_new).max() / 8)
  want = _dense_reference(q, kd, vd, seqlens + t_new, causal=True)
  np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
  # And close to attention on the unquantised values.
  k_seq[np.arange(B)[:, None], seqlens[:, None] + np.arange(t_new)] = k_new
  v_seq[np.arange(B)[:, None], seqlens[:, None] + np.arange(t_new)] = v_new
  exact = _dense_reference(q, k_seq, v_seq, seqlens + t_new, causal=True)
  assert np.abs(np.asarray(out) - exact).max() < 0.1 * np.abs(exact).max()


def test_kernel_path_rotation_wiring(rng, monkeypatch):
  """The kernel path with the kernel call replaced by its contract (rotated
  q against the rotated, dequantised pages): kvcache.py rotates q, passes
  data and descales, rotates the output back."""
  from jax_flash._src.api import attention as api
  from jax_flash._src.decode import cuda as decode_cuda
  from jax_flash._src.decode.sequences import gather as _gather
  calls = []

  def forward(q, k8, v8, kd, vd, table, seqlens, *, scale, softcap,
              window_left, window_right, num_splits):
    calls.append(k8.dtype)
    deq = lambda x8, d: (x8.astype(jnp.float32) *
                         jnp.swapaxes(d, 1, 2)[..., None])
    return api.attention(q.astype(jnp.float32), _gather(deq(k8, kd), table),
                         _gather(deq(v8, vd), table), scale=scale,
                         softcap=softcap, window=(window_left, window_right),
                         kv_seq_lengths=seqlens, return_lse=True,
                         implementation="xla")

  monkeypatch.setattr(decode_cuda, "unsupported_reason", lambda *a: None)
  monkeypatch.setattr(decode_cuda, "forward", forward)
  seqlens = np.array([17, S], np.int32)
  q = jnp.asarray(_x(rng, B, 2, H, D), jnp.float32)
  kc = jnp.asarray(_x(rng, B, S, H_KV, D), jnp.float32)
  vc = jnp.asarray(_x(rng, B, S, H_KV, D), jnp.float32)
  kq, vq = (jax_flash.quantize_kv_cache(c, rotate=True, seed=7)
            for c in (kc, vc))
  got = jax.jit(lambda q: jax_flash.attention_with_kvcache(
      q, kq, vq, jnp.asarray(seqlens), window=(9, 0)))(q)
  assert calls == [jnp.float8_e4m3fn]
  want = _dense_reference(np.asarray(q), np.asarray(kq.dequantize()),
                          np.asarray(vq.dequantize()), seqlens,
                          window=(9, 0))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)
  # d/dq exists (through the reference path); the caches are data.
  g = jax.grad(lambda q: jnp.sum(jax_flash.attention_with_kvcache(
      q, kq, vq, jnp.asarray(seqlens)) ** 2))(q)
  assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0


def test_errors(rng):
  x = jnp.zeros((2, 16, H_KV, 96), jnp.float32)
  with pytest.raises(ValueError, match="rotate=True"):
    jax_flash.quantize_kv_cache(x, rotate=True)
  with pytest.raises(ValueError, match="multiple of 4"):
    jax_flash.quantize_kv_cache(jnp.zeros((2, 6, H_KV, D)), rotate=False)
  kq = jax_flash.quantize_kv_cache(jnp.zeros((2, 16, H_KV, D)), rotate=True,
                                   seed=1)
  vq = jax_flash.quantize_kv_cache(jnp.zeros((2, 16, H_KV, D)), rotate=True,
                                   seed=2)
  q = jnp.zeros((2, 1, H, D), jnp.float32)
  lens = jnp.array([1, 2])
  with pytest.raises(ValueError, match="rotation"):
    jax_flash.attention_with_kvcache(q, kq, vq, lens)
  with pytest.raises(ValueError, match="both"):
    jax_flash.attention_with_kvcache(q, kq, jnp.zeros((2, 16, H_KV, D)), lens)
