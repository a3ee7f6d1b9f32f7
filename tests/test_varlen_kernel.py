"""The per-sequence sm90 varlen forward (JAX_FLASH_VARLEN_KERNEL, on by
default) and backward (JAX_FLASH_VARLEN_BWD_KERNEL=1, off by default).

CPU: the offsets the CUDA backend derives back from the ids
(cuda.varlen_offsets) are the given ones, for any packing; the spec carries
the layout only with the knob on (off: the program of segment ids).
GPU (H200, outputs NaN-poisoned by JAX_FLASH_POISON_OUTPUTS=1): the lowered
program calls jax_flash_fwd_varlen (the route is checked, not assumed), and
its results at odd lengths (docs of 1, 7, 129, 1000 tokens, empty docs,
queries longer or shorter than keys, tokens outside every sequence) match
the float64 reference forward and backward; the gradients come from the
per-sequence backward (jax_flash_bwd_varlen, route checked too) where it
serves the call (the buckets; the head-dim pair and deterministic calls
keep the packed segment-id backward); NaN in tokens no row sees, and in
another sequence's tokens (q, k, v and dO) next to a sequence's end, never
reaches an output or a gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import reference
from jax_flash._src.api import varlen
from jax_flash._src.backends import cuda, ffi
from reference import assert_close_to_reference

KNOB = "JAX_FLASH_VARLEN_KERNEL"
BWD_KNOB = "JAX_FLASH_VARLEN_BWD_KERNEL"


def _both_kernels(monkeypatch):
  """The per-sequence forward and backward, whatever the defaults."""
  monkeypatch.setenv(KNOB, "1")
  monkeypatch.setenv(BWD_KNOB, "1")

# (query lengths, key lengths): docs of 1, 7, 129 and 1000 tokens, empty
# ones, a doc without keys, queries longer and shorter than their keys.
ODD = ((1, 7, 0, 129, 1000, 3, 64), (1, 7, 0, 129, 1000, 3, 64))
CHUNKED = ((1, 0, 37, 130, 5, 7, 64, 200), (3, 4, 37, 129, 70, 0, 64, 200))
MASKS = [dict(), dict(causal=True), dict(window=(16, 8)),
         dict(causal=True, window=(40, -1)), dict(causal=True, softcap=5.0)]


def _offsets(lens, lead=0):
  return (lead + np.concatenate([[0], np.cumsum(lens)])).astype(np.int32)


@pytest.mark.parametrize("seed", range(6))
def test_offsets_from_ids(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 12))
  lens_q = rng.integers(0, 40, n) * (rng.random(n) < 0.8)
  lens_k = rng.integers(0, 40, n) * (rng.random(n) < 0.8)
  lead = int(rng.integers(0, 5))
  cu_q, cu_k = _offsets(lens_q, lead), _offsets(lens_k)
  Tq, Tk = int(cu_q[-1]) + int(rng.integers(0, 4)), int(cu_k[-1]) + 2
  q_seg, kv_seg = varlen.packing_arrays(jnp.asarray(cu_q), jnp.asarray(cu_k),
                                        Tq, Tk, False)
  for seg, cu in ((q_seg, cu_q), (kv_seg, cu_k)):
    got = np.asarray(cuda.varlen_offsets(jnp.asarray(seg), n))[0]
    assert got.shape == (n + 1,)
    assert np.all(np.diff(got) >= 0) and got[0] >= 0 and got[-1] <= seg.shape[1]
    # Every sequence with tokens starts and ends where the offsets say (an
    # empty one may sit anywhere between its neighbours: it has no row).
    np.testing.assert_array_equal(np.diff(got), np.diff(cu))
    for s in range(n):
      if cu[s + 1] > cu[s]:
        assert got[s] == cu[s], (s, got, cu)


def test_offsets_from_any_ids():
  """Ids that are no layout at all still give in-range, non-decreasing
  offsets (traced decreasing offsets: meaningless, never out of bounds)."""
  seg = jnp.asarray([[3, 0, 0, -1, 7, 1, 1, 2, -2]], jnp.int32)
  got = np.asarray(cuda.varlen_offsets(seg, 3))[0]
  assert np.all(np.diff(got) >= 0) and got[0] >= 0 and got[-1] <= seg.shape[1]


def test_spec_marks_layout_only_with_knob(monkeypatch):
  cu = jnp.asarray(_offsets((3, 5)))
  monkeypatch.delenv(BWD_KNOB, raising=False)
  monkeypatch.setenv(KNOB, "0")
  assert varlen._varlen_fields(cu, cu, 8, 8) == {}
  monkeypatch.delenv(KNOB)  # on by default
  assert varlen._varlen_fields(cu, cu, 8, 8) == dict(
      varlen_seqs=2, varlen_outside=False, varlen_backward=False)
  monkeypatch.setenv(KNOB, "1")
  assert varlen._varlen_fields(cu, cu, 9, 8)["varlen_outside"]
  monkeypatch.setenv(KNOB, "yes")
  with pytest.raises(ValueError, match=KNOB):
    varlen._varlen_fields(cu, cu, 8, 8)


def test_backward_knob(monkeypatch):
  """Read when the forward is traced and kept in the spec: custom_vjp
  traces the backward later, outside the caller's settings."""
  cu = jnp.asarray(_offsets((3, 5)))
  monkeypatch.delenv(BWD_KNOB, raising=False)
  assert not ffi.varlen_bwd_kernel()  # off by default
  assert not varlen._varlen_fields(cu, cu, 8, 8)["varlen_backward"]
  monkeypatch.setenv(BWD_KNOB, "1")
  assert ffi.varlen_bwd_kernel()
  assert varlen._varlen_fields(cu, cu, 8, 8)["varlen_backward"]
  monkeypatch.setenv(BWD_KNOB, "on")
  with pytest.raises(ValueError, match=BWD_KNOB):
    ffi.varlen_bwd_kernel()


def test_knob_on_cpu_keeps_results(monkeypatch, rng, x64):
  """On a CPU the knob changes nothing but the spec: same outputs."""
  _both_kernels(monkeypatch)
  cu = _offsets((5, 0, 9))
  q = jnp.asarray(rng.standard_normal((16, 2, 16)))
  f = lambda: jax_flash.varlen_attention(
      q, q, q, jnp.asarray(cu), jnp.asarray(cu), max_seqlen_q=9,
      max_seqlen_k=9, causal=True, implementation="xla")
  on = f()
  monkeypatch.setenv(KNOB, "0")
  np.testing.assert_array_equal(np.asarray(on), np.asarray(f()))


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------


def _run(q, k, v, cu_q, cu_k, kw, sinks=None):
  lmax = lambda c: max(int(np.max(np.diff(c))), 1)
  return jax_flash.varlen_attention(
      q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), max_seqlen_q=lmax(cu_q),
      max_seqlen_k=lmax(cu_k), return_lse=True, implementation="cuda",
      sinks=sinks, **kw)


def _assert_routed(q, k, v, cu_q, cu_k, kw):
  text = jax.jit(lambda q, k, v: _run(q, k, v, cu_q, cu_k, kw)).lower(
      q, k, v).as_text()
  assert ffi.FWD_VARLEN in text, "the varlen kernel was not taken"


def _assert_bwd_routed(q, k, v, cu_q, cu_k, kw, taken=True):
  def loss(q, k, v):
    o, _ = _run(q, k, v, cu_q, cu_k, kw)
    return o.astype(jnp.float32).sum()
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
  assert (ffi.BWD_VARLEN in text) == taken, (
      "the varlen backward was " + ("not taken" if taken else "taken"))


def _check(rng, lens, H, Hk, D, dtype, kw, *, lead=0, tail=3, grads=True,
           sinks=False, bwd_kernel=True):
  cu_q, cu_k = _offsets(lens[0], lead), _offsets(lens[1], lead)
  Tq, Tk = int(cu_q[-1]) + tail, int(cu_k[-1]) + tail
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  q, k, v, do = mk(Tq, H, D), mk(Tk, Hk, D), mk(Tk, Hk, D), mk(Tq, H, D)
  s = (jnp.asarray(rng.standard_normal(H), jnp.float32) if sinks else None)
  band = {n: kw[n] for n in ("causal", "window") if n in kw}
  extra = {n: kw[n] for n in ("softcap",) if n in kw}
  vis = reference.varlen_mask(cu_q, cu_k, Tq, Tk, **band)
  _assert_routed(q, k, v, cu_q, cu_k, kw)
  (o, lse), vjp = jax.vjp(lambda q, k, v: _run(q, k, v, cu_q, cu_k, kw, s),
                          q, k, v)
  b = lambda x: x[None]
  ref_o, ref_lse = reference.attention(b(q), b(k), b(v), visibility=vis,
                                       sinks=s, **extra)
  base = lambda q, k, v: reference.dense_attention_jax(
      b(q), b(k), b(v), visibility=vis, sinks=s, **extra)
  (base_o, base_lse), base_vjp = jax.vjp(base, q, k, v)
  assert_close_to_reference("o", o, ref_o[0], base_o[0])
  assert_close_to_reference("lse", lse, ref_lse[0], base_lse[0])
  if not grads:
    return
  _assert_bwd_routed(q, k, v, cu_q, cu_k, kw, taken=bwd_kernel)
  got = vjp((do, jnp.zeros_like(lse)))
  ref = reference.attention_vjp(b(q), b(k), b(v), b(do), visibility=vis,
                                sinks=s, **extra)
  want = base_vjp((b(do), jnp.zeros_like(base_lse)))
  for name, g, r, w in zip(("dq", "dk", "dv"), got, ref, want):
    assert_close_to_reference(name, g, r[0], w)


@pytest.mark.gpu
@pytest.mark.skipif(not ffi.available(), reason="CUDA extension not built")
@pytest.mark.parametrize("kw", MASKS, ids=str)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("lens", [ODD, CHUNKED], ids=["odd", "chunked"])
@pytest.mark.parametrize("outside", [False, True], ids=["covering", "outside"])
def test_varlen_kernel(lens, D, kw, outside, rng, monkeypatch):
  _both_kernels(monkeypatch)
  _check(rng, lens, 4, 2, D, jnp.bfloat16, kw,
         lead=5 if outside else 0, tail=3 if outside else 0)


@pytest.mark.gpu
@pytest.mark.skipif(not ffi.available(), reason="CUDA extension not built")
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True)], ids=str)
def test_varlen_kernel_gqa_sinks_d96(dtype, kw, rng, monkeypatch):
  _both_kernels(monkeypatch)
  _check(rng, ODD, 8, 1, 128, dtype, kw, sinks=True)
  _check(rng, CHUNKED, 16, 4, 96, dtype, kw)


@pytest.mark.gpu
@pytest.mark.skipif(not ffi.available(), reason="CUDA extension not built")
@pytest.mark.parametrize("kw", [dict(), dict(causal=True)], ids=str)
def test_varlen_kernel_head_dim_pair(kw, rng, monkeypatch):
  _both_kernels(monkeypatch)
  lens = ODD
  cu = _offsets(lens[0])
  T = int(cu[-1])
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q, k, v = mk(T, 4, 192), mk(T, 2, 192), mk(T, 2, 128)
  vis = reference.varlen_mask(cu, cu, T, T, **kw)
  _assert_routed(q, k, v, cu, cu, kw)
  o, lse = _run(q, k, v, cu, cu, kw)
  b = lambda x: x[None]
  ref_o, ref_lse = reference.attention(b(q), b(k), b(v), visibility=vis)
  base_o, base_lse = reference.dense_attention_jax(b(q), b(k), b(v),
                                                   visibility=vis)
  assert_close_to_reference("o", o, ref_o[0], base_o[0])
  assert_close_to_reference("lse", lse, ref_lse[0], base_lse[0])


@pytest.mark.gpu
@pytest.mark.skipif(not ffi.available(), reason="CUDA extension not built")
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True)], ids=str)
def test_varlen_kernel_nan_isolation(D, kw, rng, monkeypatch):
  """NaN in tokens outside every sequence and in a whole sequence's q, k, v
  (the one right after a sequence whose last KV block is partial, so that
  block's loads read it): every other sequence's rows are finite and
  right, the poisoned sequence's own rows aside."""
  _both_kernels(monkeypatch)
  lens = (7, 129, 50, 1000, 1)
  cu = _offsets(lens, 4)
  T = int(cu[-1]) + 5
  mk = lambda *s: rng.standard_normal(s)
  q, k, v = mk(T, 4, D), mk(T, 2, D), mk(T, 2, D)
  bad = np.zeros(T, bool)
  bad[:cu[0]] = bad[cu[-1]:] = True
  bad[cu[2]:cu[3]] = True  # the 50-token doc after the 129-token one
  clean = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  for x in (q, k, v):
    x[bad] = np.nan
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  _assert_routed(q, k, v, cu, cu, kw)
  o, lse = _run(q, k, v, cu, cu, kw)
  o_ref, lse_ref = _run(*clean, cu, cu, kw)
  keep = ~bad
  o, lse = np.asarray(o, np.float32), np.asarray(lse)
  assert np.isfinite(o[keep]).all() and np.isfinite(lse[:, keep]).all()
  np.testing.assert_array_equal(o[keep], np.asarray(o_ref, np.float32)[keep])
  np.testing.assert_array_equal(lse[:, keep], np.asarray(lse_ref)[:, keep])
  outside = np.zeros(T, bool)
  outside[:cu[0]] = outside[cu[-1]:] = True
  assert (o[outside] == 0).all() and np.isneginf(lse[:, outside]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not ffi.available(), reason="CUDA extension not built")
def test_varlen_defaults(rng, monkeypatch):
  """Default knobs: the per-sequence forward, the packed backward (the
  segment ids of the varlen layout), gradients against float64."""
  monkeypatch.delenv(KNOB, raising=False)
  monkeypatch.delenv(BWD_KNOB, raising=False)
  for kw in (dict(), dict(causal=True)):
    _check(rng, ODD, 4, 2, 128, jnp.bfloat16, kw, tail=5, bwd_kernel=False)


@pytest.mark.gpu
@pytest.mark.skipif(not ffi.available(), reason="CUDA extension not built")
def test_varlen_kernel_long_tail(rng, monkeypatch):
  """A long-tailed mix (8 .. 3000 tokens), causal and not, GQA."""
  _both_kernels(monkeypatch)
  lens = (8, 3000, 17, 1500, 300, 40, 700, 9, 129, 250, 1, 64)
  for kw in (dict(), dict(causal=True)):
    _check(rng, (lens, lens), 4, 1, 128, jnp.bfloat16, kw, grads=False)


@pytest.mark.gpu
@pytest.mark.skipif(not ffi.available(), reason="CUDA extension not built")
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True)], ids=str)
def test_varlen_backward_nan_isolation(D, kw, rng, monkeypatch):
  """The backward's loads read past a sequence's end into the next tokens
  (Q / dO of the last partial query block, K / V of the last partial KV
  block): NaN there (tokens outside every sequence, and a whole sequence's
  q, k, v and dO, the one right after a sequence whose last blocks are
  partial) must not reach the other sequences' dq, dk, dv, which match the
  clean inputs' run; tokens outside every sequence get zero gradients."""
  _both_kernels(monkeypatch)
  lens = (7, 129, 50, 1000, 1, 77)
  cu = _offsets(lens, 4)
  T = int(cu[-1]) + 5
  mk = lambda *s: rng.standard_normal(s)
  q, k, v, do = mk(T, 4, D), mk(T, 2, D), mk(T, 2, D), mk(T, 4, D)
  bad = np.zeros(T, bool)
  bad[:cu[0]] = bad[cu[-1]:] = True
  bad[cu[2]:cu[3]] = True  # the 50-token doc after the 129-token one
  clean = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do)]
  for x in (q, k, v, do):
    x[bad] = np.nan
  q, k, v, do = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
  _assert_bwd_routed(q, k, v, cu, cu, kw)

  def grads(q, k, v, do):
    (o, lse), vjp = jax.vjp(lambda q, k, v: _run(q, k, v, cu, cu, kw), q, k, v)
    return [np.asarray(g, np.float32) for g in vjp((do, jnp.zeros_like(lse)))]

  got, want = grads(q, k, v, do), grads(*clean)
  keep = ~bad
  outside = np.zeros(T, bool)
  outside[:cu[0]] = outside[cu[-1]:] = True
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert np.isfinite(g[keep]).all(), name
    # dQ's fp32 additions run in a timing-dependent order: equal up to the
    # 16-bit rounding of nearly equal sums.
    scale = float(np.abs(w[keep]).max()) + 1e-6
    np.testing.assert_allclose(g[keep], w[keep], rtol=0, atol=2e-2 * scale,
                               err_msg=name)
    assert (g[outside] == 0).all(), name
