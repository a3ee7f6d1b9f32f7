"""AttentionSpec.q_offset: attention with any alignment of queries to keys.

Ring attention computes blocks whose global positions differ by a known
offset; these tests pin down the pieces it relies on, against the float64
reference's mask with the same offset (tests/reference.py): the element
mask and the block ranges of masking.py, its whole-block answers (empty /
simplified spec / bottom-right view), the xla and pallas backends (forward
and gradients), and the prefix-slicing wrapper that serves such blocks with
kernels that only know the bottom-right alignment (the cuda backend's path,
checked here with the xla backend standing in for the kernels).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import reference
from jax_flash._src.core import bottom_right
from jax_flash._src.backends import ffi
from jax_flash._src.core import masking
from jax_flash._src.backends import xla
from jax_flash._src.core.spec import UNBOUNDED, AttentionSpec
from jax_flash._src.autodiff.differentiable import attention_fn

WINDOWS = ((-1, -1), (0, 0), (2, -1), (-1, 3), (1, 2), (4, 0), (0, 5))


@pytest.fixture(autouse=True)
def _ieee_float32():
  with jax.default_matmul_precision("highest"):
    yield


def _spec(T, S, window, offset, **kw):
  return AttentionSpec(**(dict(scale=1.0) | kw), q_len=T, kv_len=S,
                       window_left=window[0], window_right=window[1],
                       q_offset=offset)


def _ref_mask(spec):
  return reference.mask(spec.q_len, spec.kv_len,
                        window=(spec.window_left, spec.window_right),
                        offset=spec.q_offset)[0]


def test_visible_and_whole_block_answers():
  """Brute force over small blocks: masking.visible, is_empty, simplify and
  bottom_right_view agree with the reference mask for every offset."""
  for T, S, window, off in itertools.product((1, 3, 6), (1, 4, 6), WINDOWS,
                                             range(-9, 10)):
    spec = _spec(T, S, window, off)
    vis = _ref_mask(spec)
    got = masking.visible(spec, np.arange(T)[:, None], np.arange(S)[None, :])
    np.testing.assert_array_equal(np.asarray(got), vis)
    case = (T, S, window, off)
    assert masking.is_empty(spec) == (not vis.any()), case

    simple = masking.simplify(spec)
    if simple is None:
      assert not vis.any(), case
    else:
      np.testing.assert_array_equal(_ref_mask(simple), vis, err_msg=str(case))
      if not simple.has_window:
        assert simple.q_offset is None, case  # fully visible: canonical

    view = masking.bottom_right_view(spec)
    if view is None:
      assert not vis.any(), case
      continue
    assert view.q_offset is None and view.bottom_right, case
    assert 1 <= view.q_len <= T and 1 <= view.kv_len <= S, case
    assert view.window_left >= -1 and view.window_right >= -1, case
    assert (view.window_left == UNBOUNDED) == (window[0] == UNBOUNDED), case
    assert (view.window_right == UNBOUNDED) == (window[1] == UNBOUNDED), case
    padded = np.zeros((T, S), bool)
    padded[:view.q_len, :view.kv_len] = _ref_mask(view)
    np.testing.assert_array_equal(padded, vis, err_msg=str(case))


def test_block_ranges_with_offset():
  """Skipped blocks hold no visible pair, unmasked blocks only visible ones,
  for offsets on either side of the bottom-right one."""
  for T, S, window, off, bq, bk in itertools.product(
      (7, 16), (5, 16), ((-1, 0), (3, 0), (6, 2), (0, 5)), (-13, -4, 0, 9),
      (4, 8), (4,)):
    spec = _spec(T, S, window, off)
    nq, nk = -(-T // bq), -(-S // bk)
    vis = np.asarray(masking.visible(spec, np.arange(nq * bq)[:, None],
                                     np.arange(nk * bk)[None, :]))
    for i in range(nq):
      first, last = (int(x) for x in masking.kv_block_range(
          spec, i * bq, bq, bk, nk))
      lo, hi = (int(x) for x in masking.kv_block_full_range(spec, i * bq, bq,
                                                            bk))
      for j in range(nk):
        tile = vis[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        assert first <= j < last or not tile.any(), (spec, i, j)
        assert not lo <= j < hi or tile.all(), (spec, i, j)
    for j in range(nk):
      first, last = (int(x) for x in masking.q_block_range(
          spec, j * bk, bk, bq, nq))
      lo, hi = (int(x) for x in masking.q_block_full_range(spec, j * bk, bk,
                                                           bq))
      for i in range(nq):
        tile = vis[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        assert first <= i < last or not tile.any(), (spec, i, j)
        assert not lo <= i < hi or tile.all(), (spec, i, j)


def _inputs(rng, B, T, S, H, Hk, D, segments):
  mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32))
  q, k, v = mk(B, T, H, D), mk(B, S, Hk, D), mk(B, S, Hk, D)
  segs = None
  if segments:
    q_seg = rng.integers(0, 2, (B, T))
    q_seg[:, 1] = 5  # never among the keys: a row that sees nothing
    segs = (jnp.asarray(q_seg, jnp.int32),
            jnp.asarray(rng.integers(0, 2, (B, S)), jnp.int32))
  return q, k, v, segs


def _loss(fn, segs, w):
  def loss(q, k, v):
    o, lse = fn(q, k, v, *(segs or ()))
    return jnp.sum(o * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse,
                                                    0.0))
  return loss


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("window,offset,segments", [
    ((6, 2), -7, False),   # keys mostly after the queries
    ((5, -1), 9, True),    # rows past the keys see nothing
    ((-1, 0), 30, False),  # everything visible (offset past the end)
    ((3, 4), 2, True),
])
@pytest.mark.slow
def test_backends_with_offset(backend, window, offset, segments, rng):
  """Forward (o, lse) and gradients of a q_offset spec vs float64."""
  if backend not in jax_flash.available_implementations():
    pytest.skip(f"{backend} not registered")
  B, T, S, H, Hk, D = 1, 13, 21, 2, 1, 32
  q, k, v, segs = _inputs(rng, B, T, S, H, Hk, D, segments)
  spec = _spec(T, S, window, offset, has_segment_ids=segments, batch=B,
               num_heads=H, num_kv_heads=Hk, head_dim=D, scale=D**-0.5)
  fn = attention_fn(backend, spec)
  w = jnp.cos(jnp.arange(B * T * H * D, dtype=jnp.float32)).reshape(q.shape)
  got_o, got_lse = jax.jit(fn)(q, k, v, *(segs or ()))
  grads = jax.jit(jax.grad(_loss(fn, segs, w), argnums=(0, 1, 2)))(q, k, v)

  kw = dict(window=window, offset=offset, segment_ids=segs)
  ref_o, ref_lse = reference.attention(q, k, v, **kw)
  dense = functools.partial(reference.dense_attention_jax, **kw)
  base_o, base_lse = dense(q, k, v)
  base_g = jax.grad(_loss(lambda q, k, v, *_: dense(q, k, v), segs, w),
                    argnums=(0, 1, 2))(q, k, v)
  reference.assert_close_to_reference("o", got_o, ref_o, base_o)
  reference.assert_close_to_reference("lse", got_lse, ref_lse, base_lse)
  dlse = np.where(np.isfinite(ref_lse), 0.1, 0.0)
  ref_g = reference.attention_vjp(q, k, v, np.asarray(w), dlse=dlse, **kw)
  for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref_g, base_g):
    reference.assert_close_to_reference(name, g, r, b)


@pytest.mark.parametrize("window,offset", [
    ((6, 2), -7), ((5, -1), 9), ((-1, 3), 12), ((2, 2), -25), ((0, 0), 4),
])
@pytest.mark.slow
def test_bottom_right_wrapper_matches_direct(window, offset, rng):
  """bottom_right.forward/backward (slice to prefixes, run a bottom-right
  spec, pad) give exactly what the offset spec gives directly."""
  B, T, S, H, Hk, D = 2, 11, 9, 2, 2, 8
  q, k, v, segs = _inputs(rng, B, T, S, H, Hk, D, True)
  spec = _spec(T, S, window, offset, has_segment_ids=True, batch=B,
               num_heads=H, num_kv_heads=Hk, head_dim=D)

  def kernel_fwd(s, *a):  # a bottom-right-only stand-in for the CUDA kernels
    assert s.bottom_right
    return xla.forward(s, *a)

  def kernel_bwd(s, *a):
    assert s.bottom_right
    return xla.backward(s, *a)

  want = xla.forward(spec, q, k, v, *segs)
  got = bottom_right.forward(kernel_fwd, spec, q, k, v, *segs)
  for x, y in zip(got, want):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6,
                               atol=1e-6)
  o, lse = want
  do = jnp.asarray(rng.standard_normal(o.shape, np.float32))
  delta = jnp.sum(do * o, axis=-1).transpose(0, 2, 1)
  want = xla.backward(spec, q, k, v, o, lse, do, delta, *segs)
  got = bottom_right.backward(kernel_bwd, spec, q, k, v, o, lse, do, delta,
                              *segs)
  # Gradients are sums of P * (dP - delta), differences of O(1) float32 terms
  # whose rounding depends on the block partition (the wrapper slices to
  # prefixes): the error is a few ulps of those terms (~1e-6), even where the
  # exact gradient is 0.
  for x, y in zip(got, want):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5,
                               atol=5e-6)


def test_cuda_attributes_refuse_other_alignments():
  """The FFI attributes only describe bottom-right masks: another alignment
  raises instead of being passed on silently."""
  ffi.mask_attrs(_spec(4, 6, (2, 0), 2))  # == S - T: fine
  with pytest.raises(ValueError, match="bottom-right"):
    ffi.mask_attrs(_spec(4, 6, (2, 0), 3))
