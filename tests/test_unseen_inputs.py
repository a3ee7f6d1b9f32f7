"""Inputs that no query may see may hold anything, NaN and Inf included: a
preallocated or paged cache holds whatever was there before, and padding is
often left uninitialised. On every backend such inputs must never reach an
output or a gradient.

Each case fills the unseen slots with NaN, +Inf and -Inf and checks that
outputs and gradients (w.r.t. q, k, v or the caches, random cotangent) are
finite and equal those of the same call with ordinary random values there,
the unseen slots' gradients being 0; rows that see no key give zeros.
Unseen: keys past `kv_seq_lengths` or a cache's `cache_seqlens`, unread
pages of a paged cache, keys in a segment no query has, varlen padding and
sequences without queries, keys before every query's window; on the query
side, rows that see no key (a segment without keys, varlen padding). Paths:
`attention` (with dropout and softcap too), `varlen_attention`,
`attention_with_kvcache` (contiguous, paged, FP8 cache), `fp8_attention`
(whose quantisation zeroes unseen tokens first, so its block scales match
too) and `ring_attention`, on xla, pallas (interpret mode on CPU; most
cases marked slow) and cuda (marked gpu).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_flash
from jax_flash._src.core import masking, seen
from jax_flash._src.core.spec import UNBOUNDED, AttentionSpec

H, HK, D = 4, 2, 32  # GQA; D = 32: the smallest head dim pallas takes
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


def _dtype(impl):
  # The CUDA kernels take 16-bit inputs only.
  return jnp.bfloat16 if impl == "cuda" else jnp.float32


def _tol(dtype):
  return (dict(atol=2e-2, rtol=2e-2) if dtype == jnp.bfloat16 else
          dict(atol=1e-5, rtol=1e-5))


def _normal(rng, shape, dtype):
  return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


def _poison(x, bad):
  """x with NaN, +Inf, -Inf in turn at the slots bad marks (bad: a bool
  mask over x's leading dims)."""
  bad = np.asarray(bad)
  turn = np.arange(bad.size).reshape(bad.shape) % 3
  fill = np.choose(turn, [np.nan, np.inf, -np.inf]).astype(np.float32)
  expand = (slice(None),) * bad.ndim + (None,) * (x.ndim - bad.ndim)
  return jnp.where(bad[expand], jnp.asarray(fill, x.dtype)[expand], x)


@dataclasses.dataclass
class Case:
  f: Callable  # f(*args) -> o
  args: tuple
  bad: tuple  # per arg: bool mask over its leading dims, or None
  empty_rows: np.ndarray | None = None  # bool over o's leading dims


def _results(f, grads):
  """jit of args -> (o,) or (o, *gradients) for the cotangent ct."""
  if not grads:
    return jax.jit(lambda ct, *args: (f(*args),))

  def run(ct, *args):
    o, vjp = jax.vjp(f, *args)
    return (o,) + tuple(vjp(ct.astype(o.dtype)))
  return jax.jit(run)


def _check(case: Case, grads: bool):
  """Outputs (and gradients) with poisoned unseen slots: finite, equal to the
  finite inputs' ones, 0 at the unseen slots; empty rows give zeros."""
  poisoned = tuple(x if m is None else _poison(x, m)
                   for x, m in zip(case.args, case.bad))
  run = _results(case.f, grads)
  o = jax.eval_shape(case.f, *case.args)
  ct = _normal(np.random.default_rng(0), o.shape, o.dtype)
  clean, got = run(ct, *case.args), run(ct, *poisoned)
  names = ("o",) + tuple(f"d(arg {i})" for i in range(len(case.args)))
  masks = (None,) + case.bad
  tol = _tol(clean[0].dtype)
  for name, want, have, bad in zip(names, clean, got, masks):
    want = np.asarray(want, np.float32)
    have = np.asarray(have, np.float32)
    if bad is not None:
      expand = (slice(None),) * bad.ndim + (None,) * (want.ndim - bad.ndim)
      want = np.where(np.asarray(bad)[expand], 0.0, want)
    assert np.isfinite(have).all(), name
    np.testing.assert_allclose(have, want, err_msg=name, **tol)
  if case.empty_rows is not None:
    o = np.asarray(got[0], np.float32)
    assert np.all(o[np.asarray(case.empty_rows)] == 0.0)


# ---------------------------------------------------------------------------
# Cases: each builds (f, args, unseen slots) for one backend.
# ---------------------------------------------------------------------------


def _kv_lengths(rng, impl, **kw):
  """Keys past kv_seq_lengths; with a window the lengths also rotate the
  keys (core/kv_lengths.py)."""
  dt = _dtype(impl)
  B, T, S = 2, 13, 45
  q, k, v = (_normal(rng, s, dt) for s in ((B, T, H, D), (B, S, HK, D),
                                           (B, S, HK, D)))
  lengths = np.array([29, 17])
  bad = np.arange(S)[None, :] >= lengths[:, None]
  f = lambda q, k, v: jax_flash.attention(
      q, k, v, kv_seq_lengths=jnp.asarray(lengths), implementation=impl, **kw)
  return Case(f, (q, k, v), (None, bad, bad))


def _segments(rng, impl, **kw):
  """Keys of ids no query has (-1 at the end, 7 at the front of row 1);
  queries of id 2, which no key has, see nothing (zeros) and hold NaN too."""
  dt = _dtype(impl)
  B, T, S = 2, 23, 37
  q, k, v = (_normal(rng, s, dt) for s in ((B, T, H, D), (B, S, HK, D),
                                           (B, S, HK, D)))
  q_seg = np.repeat([[0] * 9 + [1] * 10 + [2] * 4], B, 0)
  kv_seg = np.repeat([[0] * 12 + [1] * 17 + [-1] * 8], B, 0)
  kv_seg[1, :3] = 7
  f = lambda q, k, v: jax_flash.attention(
      q, k, v, segment_ids=(jnp.asarray(q_seg, jnp.int32),
                            jnp.asarray(kv_seg, jnp.int32)),
      implementation=impl, **kw)
  keyless = q_seg == 2
  bad_k = ~np.isin(kv_seg, q_seg)
  return Case(f, (q, k, v), (keyless, bad_k, bad_k), empty_rows=keyless)


def _window(rng, impl):
  """Keys before the first query's window (bottom-right, T < S)."""
  dt = _dtype(impl)
  B, T, S, left = 1, 19, 70, 8
  q, k, v = (_normal(rng, s, dt) for s in ((B, T, H, D), (B, S, HK, D),
                                           (B, S, HK, D)))
  bad = np.broadcast_to(np.arange(S)[None, :] < S - T - left, (B, S))
  f = lambda q, k, v: jax_flash.attention(q, k, v, window=(left, 0),
                                          implementation=impl)
  return Case(f, (q, k, v), (None, bad, bad))


def _varlen(rng, impl, **kw):
  """Varlen padding (tokens outside every sequence, on both sides) and the
  keys of a sequence without queries."""
  dt = _dtype(impl)
  cu_q, cu_k = np.array([0, 7, 7, 20, 29]), np.array([0, 15, 22, 31, 50])
  Tq, Tk = 33, 57
  q, k, v = (_normal(rng, s, dt) for s in ((Tq, H, D), (Tk, HK, D),
                                           (Tk, HK, D)))
  f = lambda q, k, v: jax_flash.varlen_attention(
      q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), max_seqlen_q=13,
      max_seqlen_k=19, implementation=impl, **kw)
  bad_q = np.arange(Tq) >= cu_q[-1]
  pos = np.arange(Tk)
  bad_k = (pos >= cu_k[-1]) | ((pos >= cu_k[1]) & (pos < cu_k[2]))
  return Case(f, (q, k, v), (bad_q, bad_k, bad_k), empty_rows=bad_q)


def _dropout(rng, impl):
  return _segments(rng, impl, causal=True, dropout_rate=0.25,
                   dropout_rng=jax.random.key(3))


def _kvcache(rng, impl):
  """A contiguous cache: slots past cache_seqlens (+ the new tokens)."""
  dt = _dtype(impl)
  B, T, S = 3, 2, 40
  q = _normal(rng, (B, T, H, D), dt)
  kc, vc = (_normal(rng, (B, S, HK, D), dt) for _ in range(2))
  kn, vn = (_normal(rng, (B, T, HK, D), dt) for _ in range(2))
  seqlens = np.array([3, S - T, 21])
  bad = np.arange(S)[None, :] >= (seqlens + T)[:, None]
  f = lambda q, kc, vc: jax_flash.attention_with_kvcache(
      q, kc, vc, jnp.asarray(seqlens), k_new=kn, v_new=vn,
      implementation=impl)[0]
  return Case(f, (q, kc, vc), (None, bad, bad))


def _paged(rng, impl):
  """A paged cache: pages no sequence uses, slots past each sequence's end,
  page_table entries past the used pages (any value, here 0 and 99)."""
  dt = _dtype(impl)
  B, T, page, num_pages = 2, 3, 16, 9
  q = _normal(rng, (B, T, H, D), dt)
  kp, vp = (_normal(rng, (num_pages, page, HK, D), dt) for _ in range(2))
  table = np.array([[3, 1, 7, 99], [0, 5, 2, 0]])
  seqlens = np.array([20, 41])
  read = np.zeros((num_pages, page), bool)
  for b in range(B):
    for p in range(seqlens[b]):
      read[table[b, p // page], p % page] = True
  f = lambda q, kp, vp: jax_flash.attention_with_kvcache(
      q, kp, vp, jnp.asarray(seqlens), page_table=jnp.asarray(table),
      implementation=impl)
  return Case(f, (q, kp, vp), (None, ~read, ~read))


CASES = {
    "kv_seq_lengths": _kv_lengths,
    "kv_seq_lengths_window_softcap": lambda rng, impl: _kv_lengths(
        rng, impl, window=(6, 2), softcap=4.0),
    "segment_ids": _segments,
    "segment_ids_causal_softcap": lambda rng, impl: _segments(
        rng, impl, causal=True, softcap=3.0),
    "window": _window,
    "varlen_causal": lambda rng, impl: _varlen(rng, impl, causal=True),
    "varlen_window_softcap": lambda rng, impl: _varlen(
        rng, impl, window=(4, 1), softcap=3.0),
    "dropout": _dropout,
    "kvcache": _kvcache,
    "paged_kvcache": _paged,
}
# The fast tier: gradients (their check covers the outputs too) of every
# case on xla and of one on pallas (interpret mode is slow on CPU).
PALLAS_FAST = {"segment_ids_causal_softcap"}


def _grid():
  for name in CASES:
    for impl in ("xla", "pallas", "cuda"):
      for grads in (False, True):
        fast = grads and (impl == "xla" or name in PALLAS_FAST)
        marks = (pytest.mark.gpu if impl == "cuda" else
                 () if fast else pytest.mark.slow)
        mode = "grads" if grads else "forward"
        yield pytest.param(name, impl, grads, marks=marks,
                           id=f"{name}-{impl}-{mode}")


@pytest.mark.parametrize("name,impl,grads", list(_grid()))
def test_unseen_inputs(name, impl, grads, rng):
  _check(CASES[name](rng, impl), grads)


@pytest.mark.parametrize("name", ["kv_seq_lengths_window_softcap",
                                  "segment_ids_causal_softcap",
                                  "varlen_window_softcap"])
def test_unseen_inputs_forward_mode(name, rng):
  """jax.jvp (and so Hessians, which go through the same tangent) with
  poisoned unseen slots: the output tangent is finite and equals the one
  with finite values there (the tangents are finite everywhere)."""
  case = CASES[name](rng, "xla")
  poisoned = tuple(x if m is None else _poison(x, m)
                   for x, m in zip(case.args, case.bad))
  tangents = tuple(_normal(np.random.default_rng(1), x.shape, x.dtype)
                   for x in case.args)
  jvp = jax.jit(lambda *a: jax.jvp(case.f, a, tangents))
  (o, t), (o_p, t_p) = jvp(*case.args), jvp(*poisoned)
  tol = _tol(o.dtype)
  for want, have, what in ((o, o_p, "o"), (t, t_p, "tangent")):
    have = np.asarray(have, np.float32)
    assert np.isfinite(have).all(), what
    np.testing.assert_allclose(have, np.asarray(want, np.float32),
                               err_msg=what, **tol)


# ---------------------------------------------------------------------------
# FP8: quantisation zeroes unseen tokens, so the block scales match too.
# ---------------------------------------------------------------------------


def _fp8_segments(rng):
  """Keys past a per-row length (as segment ids), in the same 128-key block
  and the same V channels as visible ones; a query segment without keys."""
  B, T, S, D8 = 2, 70, 150, 64
  q, k, v = (_normal(rng, s, jnp.bfloat16) for s in (
      (B, T, H, D8), (B, S, HK, D8), (B, S, HK, D8)))
  q_seg = np.repeat([[0] * 30 + [1] * 33 + [2] * 7], B, 0)
  kv_seg = np.repeat([[0] * 60 + [1] * 70 + [-1] * 20], B, 0)
  kv_seg[1, 100:] = -1
  segs = (jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32))
  keyless, bad_k = q_seg == 2, kv_seg == -1
  return (q, k, v), segs, (keyless, bad_k, bad_k), keyless


@pytest.mark.parametrize("impl", ["xla", CUDA])
@pytest.mark.parametrize("kw", [{}, dict(causal=True, softcap=5.0)],
                         ids=["plain", "causal_softcap"])
def test_fp8_segments(impl, kw, rng):
  """Outputs and the straight-through gradients (exact attention's)."""
  args, segs, bad, keyless = _fp8_segments(rng)
  f = lambda q, k, v: jax_flash.fp8_attention(
      q, k, v, segment_ids=segs, implementation=impl, **kw)
  _check(Case(f, args, bad, empty_rows=keyless), grads=True)


@pytest.mark.parametrize("impl", ["xla", CUDA])
def test_fp8_window(impl, rng):
  """Keys before every query's window, in blocks with visible keys."""
  B, T, S, left = 1, 40, 200, 50
  q, k, v = (_normal(rng, s, jnp.bfloat16) for s in (
      (B, T, H, 64), (B, S, HK, 64), (B, S, HK, 64)))
  bad = np.broadcast_to(np.arange(S)[None, :] < S - T - left, (B, S))
  f = lambda q, k, v: jax_flash.fp8_attention(
      q, k, v, window=(left, 0), implementation=impl)
  _check(Case(f, (q, k, v), (None, bad, bad)), grads=True)


@pytest.mark.parametrize("impl", ["xla", CUDA])
def test_fp8_kv_cache(impl, rng):
  """An FP8 cache (one scale per slot): slots past cache_seqlens."""
  B, T, S = 2, 1, 40
  q = _normal(rng, (B, T, H, 64), jnp.bfloat16)
  kc, vc = (_normal(rng, (B, S, HK, 64), jnp.bfloat16) for _ in range(2))
  seqlens = np.array([17, 33])
  bad = np.arange(S)[None, :] >= seqlens[:, None]
  f = lambda q, kc, vc: jax_flash.attention_with_kvcache(
      q, jax_flash.quantize_kv_cache(kc), jax_flash.quantize_kv_cache(vc),
      jnp.asarray(seqlens), implementation=impl)
  _check(Case(f, (q, kc, vc), (None, bad, bad)), grads=False)


# ---------------------------------------------------------------------------
# Ring attention over host devices (conftest: 8 CPU devices).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl,causal", [
    ("xla", False),
    pytest.param("xla", True, marks=pytest.mark.slow),
    pytest.param("pallas", False, marks=pytest.mark.slow),
    pytest.param("pallas", True, marks=pytest.mark.slow),
])
def test_ring(impl, causal, rng):
  """Padding ids no query has, spread over several devices' chunks, and a
  query segment without keys."""
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices")
  mesh = Mesh(np.array(jax.devices()[:4]), ("s",))
  B, T = 2, 32
  q, k, v = (_normal(rng, s, jnp.float32) for s in ((B, T, H, D),
                                                    (B, T, HK, D),
                                                    (B, T, HK, D)))
  q_seg = np.repeat([[0] * 14 + [1] * 15 + [2] * 3], B, 0)
  kv_seg = np.repeat([[0] * 14 + [1] * 9 + [-1] * 9], B, 0)
  kv_seg[1, :5] = -1
  segs = (jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32))
  f = lambda q, k, v: jax_flash.ring_attention(
      q, k, v, mesh=mesh, seq_axis="s", segment_ids=segs, causal=causal,
      implementation=impl)
  keyless, bad_k = q_seg == 2, kv_seg == -1
  _check(Case(f, (q, k, v), (keyless, bad_k, bad_k), empty_rows=keyless),
         grads=True)


# ---------------------------------------------------------------------------
# core/seen.py (what the FP8 quantisation zeroes) against the dense mask.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("T,S", [(23, 31), (37, 14), (1, 9), (26, 26)])
def test_seen_matches_dense_mask(T, S, rng):
  """keys_seen / rows_seeing / all_seen equal the any() of masking.visible
  over offsets, windows and random or packed ids."""
  q_pos, k_pos = np.arange(T)[:, None], np.arange(S)[None, :]
  for _ in range(12):
    side = lambda: int(rng.choice([UNBOUNDED, 0, 1, 3, 9]))
    q_offset = None if rng.random() < 0.5 else int(rng.integers(-12, 12))
    segs = rng.random() < 0.7
    spec = AttentionSpec(scale=1.0, window_left=side(),
                         window_right=side(), has_segment_ids=segs,
                         q_len=T, kv_len=S, q_offset=q_offset)
    q_seg = kv_seg = None
    if segs:
      q_seg, kv_seg = rng.integers(-1, 3, (2, T)), rng.integers(-2, 3, (2, S))
      if rng.random() < 0.5:  # packed: runs of ids
        q_seg, kv_seg = np.sort(q_seg, 1), np.sort(kv_seg, 1)
    mask = masking.visible(spec, q_pos, k_pos,
                           None if q_seg is None else q_seg[:, :, None],
                           None if kv_seg is None else kv_seg[:, None, :])
    mask = np.broadcast_to(mask, (2 if segs else 1, T, S))
    as_jnp = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    np.testing.assert_array_equal(
        seen.keys_seen(spec, as_jnp(q_seg), as_jnp(kv_seg)), mask.any(1),
        err_msg=str(spec))
    np.testing.assert_array_equal(
        seen.rows_seeing(spec, as_jnp(q_seg), as_jnp(kv_seg)), mask.any(2),
        err_msg=str(spec))
    if not segs:
      assert seen.all_seen(spec) == bool(mask.any(1).all() and
                                         mask.any(2).all()), spec


def test_seen_with_shifts(rng):
  """Packed sequences of unequal query and key lengths (varlen's diagonal
  shifts): keys_seen / rows_seeing against the dense mask."""
  from jax_flash._src.api import varlen
  T, S, n = 39, 44, 4  # up to 4 sequences of up to 9 tokens, then padding
  for _ in range(10):
    cu_q = np.concatenate([[0], np.cumsum(rng.integers(0, 10, n))])
    cu_k = np.concatenate([[0], np.cumsum(rng.integers(0, 10, n))])
    q_seg, kv_seg, q_shift, kv_shift = varlen.packing_arrays(
        jnp.asarray(cu_q), jnp.asarray(cu_k), T, S, True)
    spec = AttentionSpec(scale=1.0, causal=True, window_right=0,
                         window_left=int(rng.choice([UNBOUNDED, 2])),
                         has_segment_ids=True, has_shifts=True, q_len=T,
                         kv_len=S)
    mask = np.asarray(masking.visible(
        spec, jnp.arange(T)[:, None], jnp.arange(S)[None, :],
        q_seg[:, :, None], kv_seg[:, None, :], q_shift[:, :, None]))
    shifts = (q_shift, kv_shift)
    np.testing.assert_array_equal(
        seen.keys_seen(spec, q_seg, kv_seg, shifts), mask.any(1))
    np.testing.assert_array_equal(
        seen.rows_seeing(spec, q_seg, kv_seg, shifts), mask.any(2))


def _zeroed_rows_keys(spec, q_seg, kv_seg):
  """(rows, keys) that seen.zero_unseen keeps, read off ones it zeroes."""
  T, S = spec.q_len, spec.kv_len
  q, k = jnp.ones((q_seg.shape[0], T, 1, 1)), jnp.ones((kv_seg.shape[0], S, 1, 1))
  zq, zk, _ = seen.zero_unseen(spec, q, k, None, q_seg, kv_seg)
  return np.asarray(zq[:, :, 0, 0] > 0), np.asarray(zk[:, :, 0, 0] > 0)


def test_aligned_segments_match_the_dense_mask(rng):
  """spec.segments_aligned (one id array for q and kv, or varlen offsets
  given once): zero_unseen's elementwise test keeps exactly the rows and
  keys the dense mask sees, on bands that hold the diagonal, for random and
  packed ids and varlen layouts with tokens outside every sequence."""
  from jax_flash._src.api import varlen
  T = 41
  pos = jnp.arange(T)
  for trial in range(16):
    side = lambda: int(rng.choice([UNBOUNDED, 0, 2, 7]))
    spec = AttentionSpec(scale=1.0, window_left=side(), window_right=side(),
                         has_segment_ids=True, segments_aligned=True,
                         q_len=T, kv_len=T)
    if trial % 2:  # varlen: offsets once, padding after the last sequence
      cu = np.concatenate([[0], np.cumsum(rng.integers(0, 9, 4))])
      q_seg, kv_seg = varlen.packing_arrays(jnp.asarray(cu), jnp.asarray(cu),
                                            T, T, False)
    else:
      ids = rng.integers(-1, 4, (2, T))
      if rng.random() < 0.5:
        ids = np.sort(ids, 1)
      q_seg = kv_seg = jnp.asarray(ids, jnp.int32)
    assert seen._sees_itself(spec)
    mask = np.asarray(masking.visible(spec, pos[:, None], pos[None, :],
                                      q_seg[:, :, None], kv_seg[:, None, :]))
    rows, keys = _zeroed_rows_keys(spec, q_seg, kv_seg)
    np.testing.assert_array_equal(rows, mask.any(2), err_msg=str(spec))
    np.testing.assert_array_equal(keys, mask.any(1), err_msg=str(spec))


@pytest.mark.parametrize("kw", [
    dict(q_offset=3),                              # a shifted diagonal
    dict(window_left=5, window_right=0, q_offset=-2),  # a band left of it
    dict(kv_len=44),                               # T != S
    dict(has_shifts=True)])                        # per-token shifts
def test_aligned_segments_need_the_diagonal(kw):
  """The elementwise test is taken only where every token sees itself;
  otherwise the general search."""
  base = dict(scale=1.0, has_segment_ids=True, segments_aligned=True,
              q_len=41, kv_len=41)
  spec = AttentionSpec(**{**base, **kw})
  assert not seen._sees_itself(spec)
  assert seen._sees_itself(AttentionSpec(**base))
  assert not seen._sees_itself(AttentionSpec(**{**base,
                                                "segments_aligned": False}))


def test_api_marks_aligned_segments(monkeypatch, rng):
  """attention() with one segment-id array and varlen_attention() with one
  offsets array mark the spec aligned (varlen: without shifts); two arrays
  do not."""
  from jax_flash._src.backends import registry
  specs = []
  real = registry.choose_per_platform
  monkeypatch.setattr(registry, "choose_per_platform",
                      lambda spec, *a: (specs.append(spec), real(spec, *a))[1])
  q = jnp.asarray(rng.standard_normal((1, 24, 2, 16)), jnp.float32)
  ids = jnp.asarray(np.repeat([0, 1, 2], 8)[None], jnp.int32)
  jax_flash.attention(q, q, q, causal=True, segment_ids=ids,
                      implementation="xla")
  jax_flash.attention(q, q, q, causal=True, segment_ids=(ids, ids + 0),
                      implementation="xla")
  cu = jnp.asarray([0, 5, 20], jnp.int32)
  jax_flash.varlen_attention(q[0], q[0], q[0], cu, cu, max_seqlen_q=15,
                             max_seqlen_k=15, causal=True,
                             implementation="xla")
  jax_flash.varlen_attention(q[0], q[0], q[0], cu, cu + 0, max_seqlen_q=15,
                             max_seqlen_k=15, causal=True,
                             implementation="xla")
  assert [s.segments_aligned for s in specs] == [True, False, True, False]
  assert [s.has_shifts for s in specs[2:]] == [False, True]
