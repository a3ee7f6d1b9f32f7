"""Packed sequences: `varlen_attention`, segment-id block skipping (tile spans).

Every result is checked against the float64 reference of the same packing
(reference.varlen_mask: each sequence bottom-right aligned to its own keys)
with the project's criterion (<= 2x the same-dtype dense XLA error). GPU cases
run on the H200 through tools/gpu/gpu_check.sh (outputs NaN-poisoned).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import reference
from jax_flash._src.backends import ffi
from jax_flash._src.core import masking
from jax_flash._src.core import tile_spans
from jax_flash._src.core.spec import AttentionSpec
from reference import assert_close_to_reference

ON_GPU = jax.default_backend() == "gpu"
CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not ffi.available(), reason="CUDA extension not built")])
PALLAS_GPU = pytest.param("pallas", marks=pytest.mark.gpu, id="pallas-gpu")

# (query lengths, key lengths) per sequence: length-1 and empty sequences,
# queries longer than keys (their first rows see nothing when causal), a
# sequence without keys, and sequences crossing 64- and 128-row tiles.
MIXED = ((1, 0, 37, 130, 5, 7, 64, 200), (3, 4, 37, 129, 70, 0, 64, 200))
SELF = ((100, 1, 250, 77), (100, 1, 250, 77))
TAIL = 3  # tokens past the last sequence (outside every sequence)

MASKS = [dict(), dict(causal=True), dict(window=(16, 8)),
         dict(causal=True, window=(40, -1)), dict(causal=True, softcap=5.0)]


def _offsets(lens):
  return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _inputs(rng, lens, H, Hk, D, dtype):
  cu_q, cu_k = _offsets(lens[0]), _offsets(lens[1])
  Tq, Tk = int(cu_q[-1]) + TAIL, int(cu_k[-1]) + TAIL
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return (mk(Tq, H, D), mk(Tk, Hk, D), mk(Tk, Hk, D), mk(Tq, H, D), cu_q,
          cu_k)


def _check(impl, rng, lens, H, Hk, D, dtype, kw, grads=True):
  q, k, v, do, cu_q, cu_k = _inputs(rng, lens, H, Hk, D, dtype)
  band = {n: kw[n] for n in ("causal", "window") if n in kw}
  extra = {n: kw[n] for n in ("softcap",) if n in kw}
  vis = reference.varlen_mask(cu_q, cu_k, q.shape[0], k.shape[0], **band)
  lmax = lambda c: int(np.max(np.diff(c)))

  def run(q, k, v):
    return jax_flash.varlen_attention(
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k),
        max_seqlen_q=lmax(cu_q), max_seqlen_k=lmax(cu_k), return_lse=True,
        implementation=impl, **kw)

  (o, lse), vjp = jax.vjp(run, q, k, v)
  b = lambda x: x[None]
  ref_o, ref_lse = reference.attention(b(q), b(k), b(v), visibility=vis,
                                       **extra)
  base = lambda q, k, v: reference.dense_attention_jax(
      b(q), b(k), b(v), visibility=vis, **extra)
  (base_o, base_lse), base_vjp = jax.vjp(base, q, k, v)
  assert_close_to_reference("o", o, ref_o[0], base_o[0])
  assert_close_to_reference("lse", lse, ref_lse[0], base_lse[0])
  if not grads:
    return
  zero_lse = jnp.zeros_like(lse)
  got = vjp((do, zero_lse))
  ref = reference.attention_vjp(b(q), b(k), b(v), b(do), visibility=vis,
                                **extra)
  want = base_vjp((b(do), jnp.zeros_like(base_lse)))
  for name, g, r, w in zip(("dq", "dk", "dv"), got, ref, want):
    assert_close_to_reference(name, g, r[0], w)


@pytest.mark.parametrize("kw", MASKS, ids=str)
@pytest.mark.parametrize("lens", [MIXED, SELF], ids=["mixed", "self"])
def test_varlen_xla(lens, kw, rng, x64):
  _check("xla", rng, lens, 4, 2, 32, jnp.float32, kw)


@pytest.mark.parametrize("kw", [MASKS[1], MASKS[3]], ids=str)
def test_varlen_pallas_interpret(kw, rng, x64):
  if ON_GPU:
    pytest.skip("interpret-mode check (CPU)")
  _check("pallas", rng, MIXED, 2, 1, 32, jnp.float32, kw)


@pytest.mark.parametrize("kw", MASKS, ids=str)
@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("lens", [MIXED, SELF], ids=["mixed", "self"])
@pytest.mark.parametrize("impl", [CUDA])
def test_varlen_gpu(impl, lens, D, kw, rng):
  _check(impl, rng, lens, 4, 2, D, jnp.bfloat16, kw)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("impl", [CUDA, PALLAS_GPU])
def test_varlen_gpu_dtypes_gqa(impl, dtype, rng):
  _check(impl, rng, MIXED, 8, 1, 128, dtype, dict(causal=True))


@pytest.mark.gpu
@pytest.mark.skipif(not ffi.available(), reason="CUDA extension not built")
@pytest.mark.parametrize("D", [64, 128])
def test_varlen_gpu_deterministic(D, rng):
  """Deterministic gradients are bitwise repeatable and correct."""
  q, k, v, do, cu_q, cu_k = _inputs(rng, MIXED, 4, 2, D, jnp.bfloat16)
  f = lambda q, k, v: jax_flash.varlen_attention(
      q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), max_seqlen_q=200,
      max_seqlen_k=200, causal=True, implementation="cuda",
      deterministic=True)
  g1 = jax.vjp(f, q, k, v)[1](do)
  g2 = jax.vjp(f, q, k, v)[1](do)
  for a, b in zip(g1, g2):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  vis = reference.varlen_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal=True)
  ref = reference.attention_vjp(q[None], k[None], v[None], do[None],
                                visibility=vis)
  _, base_vjp = jax.vjp(lambda q, k, v: reference.dense_attention_jax(
      q[None], k[None], v[None], visibility=vis)[0][0], q, k, v)
  for name, g, r, w in zip(("dq", "dk", "dv"), g1, ref, base_vjp(do)):
    assert_close_to_reference(name, g, r[0], w)


# ---------------------------------------------------------------------------
# Segment ids in any arrangement: the spans skip work where they can and the
# element mask keeps every layout exact.
# ---------------------------------------------------------------------------


def _layout(name, rng, T):
  if name == "packed":  # documents crossing tile boundaries
    cuts = np.sort(rng.choice(np.arange(1, T), 6, replace=False))
    return np.searchsorted(cuts, np.arange(T), side="right")
  if name == "padded":  # documents 1..n, then padding id 0 (MaxText style)
    ids = np.searchsorted([90, 200], np.arange(T), side="right") + 1
    ids[T - 37:] = 0
    return ids
  if name == "interleaved":  # an id in several runs
    return (np.arange(T) // 23) % 3
  raise ValueError(name)


@pytest.mark.parametrize("layout", ["packed", "padded", "interleaved"])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True),
                                dict(window=(50, 10))], ids=str)
@pytest.mark.parametrize("impl", ["xla", CUDA, PALLAS_GPU])
def test_segment_layouts(impl, layout, kw, rng):
  if impl == "xla" and ON_GPU:
    pytest.skip("CPU check")
  T, H, D = 301, 2, 64
  dtype = jnp.float32 if impl == "xla" else jnp.bfloat16
  seg = _layout(layout, rng, T)[None].astype(np.int32)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  q, k, v, do = mk(1, T, H, D), mk(1, T, H, D), mk(1, T, H, D), mk(1, T, H, D)
  f = lambda q, k, v: jax_flash.attention(
      q, k, v, segment_ids=jnp.asarray(seg), implementation=impl, **kw)
  o, vjp = jax.vjp(f, q, k, v)
  ids = (seg, seg)
  ref_o, _ = reference.attention(q, k, v, segment_ids=ids, **kw)
  base = lambda q, k, v: reference.dense_attention_jax(
      q, k, v, segment_ids=ids, **kw)[0]
  base_o, base_vjp = jax.vjp(base, q, k, v)
  assert_close_to_reference("o", o, ref_o, base_o)
  ref_g = reference.attention_vjp(q, k, v, do, segment_ids=ids, **kw)
  for name, g, r, w in zip(("dq", "dk", "dv"), vjp(do), ref_g, base_vjp(do)):
    assert_close_to_reference(name, g, r, w)


@pytest.mark.parametrize("layout", ["packed", "padded", "interleaved"])
@pytest.mark.parametrize("band", [(-1, -1), (-1, 0), (30, 5), (0, 40)])
@pytest.mark.parametrize("shifted", [False, True])
def test_tile_spans_bound_visibility(layout, band, shifted, rng):
  """Soundness: no visible pair outside [lo, hi); every (real row, key) of
  [full_lo, full_hi) visible. Tightness for packed ids: lo/hi are the hull
  of the visible keys (rows may see nothing under a left-bounded band)."""
  T, S, rows = 261, 300, 64
  q_seg = _layout(layout, rng, T)[None].astype(np.int32)
  kv_seg = _layout(layout, rng, S)[None].astype(np.int32)
  if layout == "packed":  # the same documents on both sides
    kv_seg = np.searchsorted(np.flatnonzero(np.diff(q_seg[0])) + 1,
                             np.arange(S) * T // S, side="right")[None]
    kv_seg = kv_seg.astype(np.int32)
  spec = AttentionSpec(scale=1.0, window_left=band[0], window_right=band[1],
                       has_segment_ids=True, has_shifts=shifted, q_len=T,
                       kv_len=S)
  q_shift = kv_shift = None
  if shifted:  # one shift per id, as varlen_attention makes them
    per_id = rng.integers(-40, 40, size=8).astype(np.int32)
    q_shift, kv_shift = per_id[q_seg % 8], per_id[kv_seg % 8]
  vis = np.asarray(masking.visible(
      spec, np.arange(T)[:, None], np.arange(S)[None, :], q_seg[0][:, None],
      kv_seg[0][None, :], None if q_shift is None else q_shift[0][:, None]))
  qs = np.asarray(tile_spans.q_spans(spec, jnp.asarray(q_seg),
                                     jnp.asarray(kv_seg), q_shift, rows))[0]
  ks = np.asarray(tile_spans.kv_spans(spec, jnp.asarray(q_seg),
                                      jnp.asarray(kv_seg), kv_shift, rows))[0]
  for spans, v in ((qs, vis), (ks, vis.T)):
    for g, (lo, hi, flo, fhi) in enumerate(spans):
      tile = v[g * rows:(g + 1) * rows]
      cols = np.flatnonzero(tile.any(0))
      assert lo <= hi and flo <= fhi and (flo == fhi or lo <= flo <= fhi <= hi)
      if cols.size:
        assert lo <= cols.min() and cols.max() < hi, (g, lo, hi, cols)
        if layout == "packed" and not shifted and band[0] == -1:
          assert (lo, hi) == (cols.min(), cols.max() + 1)
      assert tile[:, flo:fhi].all(), (g, flo, fhi)


@pytest.mark.gpu
@pytest.mark.skipif(not ffi.available(), reason="CUDA extension not built")
@pytest.mark.parametrize("layout", ["packed", "padded", "interleaved"])
@pytest.mark.parametrize("band", [(-1, -1), (-1, 0), (30, 5)])
@pytest.mark.parametrize("shifted", [False, True])
def test_cuda_prepass(layout, band, shifted, rng):
  """The CUDA tile-span pre-pass: tile_spans.py's spans, and where it says
  exact, each token's interval is the run of its id (first to last index on
  the other side) cut to the token's band."""
  from jax_flash._src.backends import cuda as cuda_backend
  B, T, S = 2, 261, 300
  q_seg = np.stack([_layout(layout, rng, T) for _ in range(B)]).astype(np.int32)
  kv_seg = np.stack([_layout(layout, rng, S) for _ in range(B)]).astype(np.int32)
  spec = AttentionSpec(scale=1.0, window_left=band[0], window_right=band[1],
                       has_segment_ids=True, has_shifts=shifted, batch=B,
                       q_len=T, kv_len=S)
  shifts = None
  if shifted:
    per_id = rng.integers(-40, 40, size=8).astype(np.int32)
    shifts = (jnp.asarray(per_id[q_seg % 8]), jnp.asarray(per_id[kv_seg % 8]))
  packing = np.asarray(cuda_backend._segments(
      spec, jnp.asarray(q_seg), jnp.asarray(kv_seg), shifts)[2])
  gq, gk = -(-T // 64), -(-S // 64)
  q_span = packing[:B * gq * 8].reshape(B, gq, 8)
  kv_span = packing[B * gq * 8:B * (gq + gk) * 8].reshape(B, gk, 8)
  runs = packing[B * (gq + gk) * 8:]
  q_run = runs[:B * T * 2].reshape(B, T, 2)
  kv_run = runs[B * T * 2:B * (T + S) * 2].reshape(B, S, 2)
  want_q = tile_spans.q_spans(spec, jnp.asarray(q_seg), jnp.asarray(kv_seg),
                              None if shifts is None else shifts[0])
  want_k = tile_spans.kv_spans(spec, jnp.asarray(q_seg), jnp.asarray(kv_seg),
                               None if shifts is None else shifts[1])
  np.testing.assert_array_equal(q_span[..., :4], np.asarray(want_q))
  np.testing.assert_array_equal(kv_span[..., :4], np.asarray(want_k))
  off = S - T
  sh = (np.zeros_like(q_seg), np.zeros_like(kv_seg)) if shifts is None else (
      np.asarray(shifts[0]), np.asarray(shifts[1]))
  sides = ((q_span, q_run, q_seg, kv_seg, np.arange(T) + off + sh[0], band),
           (kv_span, kv_run, kv_seg, q_seg, np.arange(S) - off - sh[1],
            band[::-1]))
  for span, run, own, other, pos, (b_lo, b_hi) in sides:
    for b in range(B):
      for g in range(span.shape[1]):
        ids = own[b, 64 * g:64 * g + 64]
        def one_run(v):
          w = np.flatnonzero(other[b] == v)
          return w.size == 0 or w[-1] - w[0] + 1 == w.size
        contiguous = all(one_run(v) for v in ids)
        if int(ids.max()) - int(ids.min()) < 64:
          assert span[b, g, 4] == int(contiguous), (b, g)
        if span[b, g, 4]:
          for t, v in enumerate(ids):
            where = np.flatnonzero(other[b] == v)
            lo, hi = (where[0], where[-1] + 1) if where.size else (0, 0)
            p = int(pos[b, 64 * g + t])
            if b_lo >= 0:
              lo = max(lo, p - b_lo)
            if b_hi >= 0:
              hi = min(hi, p + b_hi + 1)
            lo = min(max(lo, 0), other.shape[1])
            hi = min(max(hi, lo), other.shape[1])
            assert tuple(run[b, 64 * g + t]) == (lo, hi), (b, g, t)
  if shifted:
    np.testing.assert_array_equal(runs[B * (T + S) * 2:],
                                  np.concatenate([np.asarray(s).ravel()
                                                  for s in shifts]))
  assert packing.size == cuda_backend.packing_ints(B, T, S, shifted)


def test_varlen_matches_attention_segment_ids(rng, x64):
  """Equal query and key lengths: varlen is segment-id attention."""
  lens = (40, 1, 70, 19)
  cu = _offsets(lens)
  T = int(cu[-1])
  q, k, v = (jnp.asarray(rng.standard_normal((T, 2, 16))) for _ in range(3))
  seg = np.repeat(np.arange(len(lens)), lens)[None]
  o = jax_flash.varlen_attention(q, k, v, jnp.asarray(cu), jnp.asarray(cu),
                                 max_seqlen_q=70, max_seqlen_k=70,
                                 causal=True)
  o2 = jax_flash.attention(q[None], k[None], v[None], causal=True,
                           segment_ids=jnp.asarray(seg))[0]
  np.testing.assert_allclose(np.asarray(o), np.asarray(o2), atol=1e-12)


def test_varlen_jit_vmap(rng, x64):
  """Traced offsets under jit; vmap over packed batches; grad."""
  lens_q, lens_k = (5, 60, 1), (9, 60, 30)
  cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s))
  q, k, v = mk(2, 70, 2, 16), mk(2, 99, 2, 16), mk(2, 99, 2, 16)
  f = lambda q, k, v, a, b: jax_flash.varlen_attention(
      q, k, v, a, b, max_seqlen_q=60, max_seqlen_k=60, causal=True)
  batched = jax.jit(jax.vmap(f))(q, k, v, jnp.stack([jnp.asarray(cu_q)] * 2),
                                 jnp.stack([jnp.asarray(cu_k)] * 2))
  for i in range(2):
    one = f(q[i], k[i], v[i], jnp.asarray(cu_q), jnp.asarray(cu_k))
    np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(one),
                               atol=1e-12)
  g = jax.jit(jax.grad(lambda q: f(q, k[0], v[0], jnp.asarray(cu_q),
                                   jnp.asarray(cu_k)).sum()))(q[0])
  assert np.isfinite(np.asarray(g)).all() and np.asarray(g).any()


@pytest.mark.parametrize("bad, message", [
    (dict(cu_seqlens_q=np.array([0, 5, 3], np.int32)), "non-decreasing"),
    (dict(cu_seqlens_q=np.array([0, 5, 40], np.int32)), "exceeds"),
    (dict(cu_seqlens_q=np.array([[0, 5]], np.int32)), "1-D"),
    (dict(cu_seqlens_q=np.array([0.0, 5.0])), "integer"),
    (dict(cu_seqlens_k=np.array([0, 4], np.int32)), "same length"),
    (dict(max_seqlen_q=4), "max_seqlen_q"),
    (dict(max_seqlen_k=None), "max_seqlen_k"),
    (dict(q=np.zeros((1, 20, 2, 8), np.float32)), "total_tokens"),
])
def test_varlen_errors(bad, message):
  args = dict(q=np.ones((20, 2, 8), np.float32), k=np.ones((9, 2, 8),
                                                            np.float32),
              v=np.ones((9, 2, 8), np.float32),
              cu_seqlens_q=np.array([0, 5, 20], np.int32),
              cu_seqlens_k=np.array([0, 4, 9], np.int32), max_seqlen_q=15,
              max_seqlen_k=5)
  args.update(bad)
  args = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x
          for n, x in args.items()}
  with pytest.raises(ValueError, match=message):
    jax_flash.varlen_attention(**args)


def test_varlen_no_sequences(rng):
  """One offset (zero sequences): every row sees nothing."""
  q = jnp.asarray(rng.standard_normal((7, 2, 8)), jnp.float32)
  o, lse = jax_flash.varlen_attention(
      q, q, q, jnp.array([0], jnp.int32), jnp.array([0], jnp.int32),
      max_seqlen_q=0, max_seqlen_k=0, causal=True, return_lse=True)
  assert not np.asarray(o).any() and np.isneginf(np.asarray(lse)).all()


def test_packing_span_rows_match_kernels():
  """The tile-span granularity is the kernels' (packing_layout.h)."""
  import pathlib
  header = (pathlib.Path(__file__).resolve().parents[1] / "cuda/include/"
            "jax_flash/packing_layout.h").read_text()
  assert f"constexpr int kSpanRows = {tile_spans.ROWS};" in header


@pytest.mark.parametrize("spec", [("t", None, None), (None, "t", None)],
                         ids=["tokens", "heads"])
def test_varlen_sharded_inputs(spec, rng, x64):
  """Tokens sharded over a mesh axis are gathered (the packing spans the
  whole token axis); heads shard as in jax_flash.attention. Same values as
  one device."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices")
  mesh = Mesh(np.asarray(jax.devices()[:4]), ("t",))
  lens = (40, 1, 70, 17)
  cu = jnp.asarray(_offsets(lens))
  T = int(sum(lens))
  q, k, v = (jnp.asarray(rng.standard_normal((T, 4, 16))) for _ in range(3))
  f = jax.jit(lambda q, k, v: jax_flash.varlen_attention(
      q, k, v, cu, cu, max_seqlen_q=70, max_seqlen_k=70, causal=True))
  want = f(q, k, v)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  got = f(put(q), put(k), put(v))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-12)
