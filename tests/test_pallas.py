"""The Pallas backend: the shared suite plus Pallas-specific checks.

On CPU the kernels run in interpret mode (slow), so the suite runs a subset
here at small sizes with 32-row tiles (several blocks per sequence, so the
block skipping and the masked-edge / unmasked-interior split all run). On a
GPU (Triton) every suite case runs in bf16 and a subset in fp16/fp32, with
lengths above two 128-row tiles.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash
import reference
from attention_suite import (PALLAS_CPU, PALLAS_GPU, AttentionSuite,
                             BackendSuite, select_cases)
from jax_flash._src.backends import registry as backends
from jax_flash._src.core import masking
from jax_flash._src.backends.pallas import backend as pallas_backend
from jax_flash._src.backends.pallas import common
from jax_flash._src.backends.pallas import config as pallas_config
from jax_flash._src.core.spec import AttentionSpec
from reference import assert_close_to_reference

ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.slow
class TestPallasSuite(BackendSuite):
  implementation = "pallas"
  support = PALLAS_GPU if ON_GPU else PALLAS_CPU
  if ON_GPU:
    # Every case in bf16; head dims small/mid/large = 32/96/256.
    dtypes = ("bfloat16",)
    head_dims = (32, 64, 96, 128, 256)
    long_seq = 300  # > two 128-row tiles
  else:
    # Interpret mode compiles slowly (~3 s a test), so a subset; the tests
    # below add every head dim and each mask feature at odd sizes.
    dtypes = ("bfloat16",)
    head_dims = (32,)
    long_seq = 100  # > three 32-row tiles
    cases = select_cases(
        "odd_mqa_t_gt_s", "decode_causal_window", "causal_long_gqa",
        "window_both_long", "segments_causal_gqa_long",
        "segments_pair_empty_rows", "batch_dims_causal",
        "value_dim_larger_sinks_segments")


if ON_GPU:

  class TestPallasSuiteOtherDtypes(AttentionSuite):
    """float16 and float32 (smaller tiles: they must fit shared memory)."""
    implementation = "pallas"
    support = PALLAS_GPU
    dtypes = ("float16", "float32")
    head_dims = (64, 128, 256)
    long_seq = 300
    cases = select_cases("odd_gqa_t_lt_s", "causal_t_gt_s_empty_rows",
                         "window_both_long", "segments_pair_empty_rows",
                         "softcap_causal_gqa", "decode_mqa")


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _inputs(rng, B, T, S, H, Hk, D, dtype):
  shape_q, shape_kv = (B, T, H, D), (B, S, Hk, D)
  return tuple(jnp.asarray(rng.standard_normal(s, np.float32), dtype)
               for s in (shape_q, shape_kv, shape_kv))


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _check_fwd_bwd(rng, q, k, v, *, segment_ids=None, **kw):
  """o, lse, dq, dk, dv of the Pallas backend against the float64 reference,
  with the same-dtype dense XLA attention as the error baseline."""
  seg_kw = {} if segment_ids is None else {"segment_ids": segment_ids}
  ref_kw = dict(kw)
  if segment_ids is not None:
    ref_kw["segment_ids"] = tuple(np.asarray(s) for s in segment_ids)
  do = jnp.asarray(rng.standard_normal(q.shape, np.float32), q.dtype)

  def run(q, k, v):
    f = lambda q, k, v: jax_flash.attention(
        q, k, v, return_lse=True, implementation="pallas", **seg_kw, **kw)
    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse) + vjp((do, jnp.zeros_like(lse)))

  def dense(q, k, v):
    f = functools.partial(reference.dense_attention_jax, **ref_kw)
    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse) + vjp((do, jnp.zeros_like(lse)))

  got = jax.jit(run)(q, k, v)
  base = jax.jit(dense)(q, k, v)
  q64, k64, v64 = _f64(q), _f64(k), _f64(v)
  ref = reference.attention(q64, k64, v64, **ref_kw)
  ref += reference.attention_vjp(q64, k64, v64, _f64(do), **ref_kw)
  for name, g, r, b in zip(("o", "lse", "dq", "dk", "dv"), got, ref, base):
    assert g.shape == r.shape, (name, g.shape, r.shape)
    assert_close_to_reference(name, _f64(g), r, _f64(b))
  return got, ref


# ---------------------------------------------------------------------------
# Kernel-level checks
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
def test_head_dims_odd_sizes_gqa(D, rng):
  """Every head dim (96 is zero-padded to 128), T=37/S=53, GQA, fwd + bwd."""
  q, k, v = _inputs(rng, 1, 37, 53, 4, 2, D, jnp.float32)
  _check_fwd_bwd(rng, q, k, v)


@pytest.mark.parametrize("kw", [
    dict(causal=True, window=(20, -1)),
    dict(window=(9, 4), softcap=3.0, scale=0.4),
], ids=["causal_window", "window_softcap_scale"])
@pytest.mark.slow
def test_mask_features(kw, rng):
  """Window/causal/softcap with T > S (bottom-right alignment, empty rows)
  and MQA."""
  q, k, v = _inputs(rng, 2, 53, 37, 4, 1, 64, jnp.float32)
  _check_fwd_bwd(rng, q, k, v, **kw)


def test_fully_masked_rows(rng):
  """Query ids absent from kv: o == 0, lse == -inf, zero finite grads."""
  q, k, v = _inputs(rng, 1, 40, 45, 2, 2, 32, jnp.float32)
  q_ids = np.zeros((1, 40), np.int32)
  q_ids[:, 5:17] = 7  # never in kv
  kv_ids = np.zeros((1, 45), np.int32)
  kv_ids[:, 30:] = 1
  (o, lse, dq, dk, dv), _ = _check_fwd_bwd(
      rng, q, k, v, segment_ids=(jnp.asarray(q_ids), jnp.asarray(kv_ids)))
  assert np.all(np.asarray(o)[:, 5:17] == 0)
  assert np.all(np.asarray(lse)[:, :, 5:17] == -np.inf)
  assert np.all(np.asarray(dq)[:, 5:17] == 0)
  for g in (dq, dk, dv):
    assert np.isfinite(np.asarray(g)).all()


@pytest.mark.slow
def test_poisoned_outputs_are_all_written(rng, monkeypatch):
  """With NaN-filled, aliased output buffers, every element is overwritten."""
  monkeypatch.setenv(common.POISON_ENV, "1")
  jax.clear_caches()  # the variable is read at trace time
  try:
    q, k, v = _inputs(rng, 1, 37, 53, 4, 2, 96, jnp.bfloat16)
    got, _ = _check_fwd_bwd(rng, q, k, v, causal=True)
    for g in got:
      assert not np.isnan(np.asarray(g, np.float32)).any()
  finally:
    jax.clear_caches()


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="float64 runs in interpret mode only")
def test_check_grads_float64(rng, x64):
  q, k, v = _inputs(rng, 1, 9, 13, 2, 1, 32, jnp.float64)

  def f(q, k, v):
    o, lse = jax_flash.attention(q, k, v, return_lse=True, window=(4, 2),
                                 softcap=2.0, implementation="pallas")
    return o, jnp.where(jnp.isfinite(lse), lse, 0.0)

  check_grads(f, (q, k, v), order=1, modes=("rev",), atol=1e-6, rtol=1e-6,
              eps=1e-5)


def test_block_ranges_against_visibility():
  """The skipped blocks hold no visible pair; the unmasked ones only visible
  pairs (brute force over many shapes, windows and block sizes)."""
  for T, S, (wl, wr), bq, bk in itertools.product(
      (1, 7, 16, 37), (5, 16, 53), ((-1, -1), (-1, 0), (3, 0), (0, 5),
                                    (6, 2), (-1, 9)), (4, 8), (4, 16)):
    spec = AttentionSpec(scale=1.0, window_left=wl, window_right=wr,
                         q_len=T, kv_len=S)
    nq, nk = -(-T // bq), -(-S // bk)
    qi = np.arange(nq * bq)[:, None]
    kj = np.arange(nk * bk)[None, :]
    vis = np.asarray(masking.visible(spec, qi, kj))
    for i in range(nq):
      first, last = (int(x) for x in masking.kv_block_range(spec, i * bq, bq,
                                                            bk, nk))
      lo, hi = (int(x) for x in masking.kv_block_full_range(spec, i * bq, bq,
                                                            bk))
      for j in range(nk):
        tile = vis[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        if not first <= j < last:
          assert not tile.any(), (T, S, wl, wr, bq, bk, i, j)
        if lo <= j < hi:
          assert tile.all(), (T, S, wl, wr, bq, bk, i, j, lo, hi)
    for j in range(nk):
      first, last = (int(x) for x in masking.q_block_range(spec, j * bk, bk,
                                                           bq, nq))
      lo, hi = (int(x) for x in masking.q_block_full_range(spec, j * bk, bk,
                                                           bq))
      for i in range(nq):
        tile = vis[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        if not first <= i < last:
          assert not tile.any(), (T, S, wl, wr, bq, bk, i, j)
        if lo <= i < hi:
          assert tile.all(), (T, S, wl, wr, bq, bk, i, j, lo, hi)


# ---------------------------------------------------------------------------
# What the backend declines, and the Triton path (lowered on CPU)
# ---------------------------------------------------------------------------


def _spec(**kw):
  base = dict(scale=1.0, q_len=8, kv_len=8, head_dim=64, dtype="bfloat16")
  return AttentionSpec(**(base | kw))


@pytest.mark.parametrize("kw,platform,words", [
    (dict(head_dim=16), "cpu", "head_dim"),
    (dict(head_dim=257), "gpu", "head_dim"),
    (dict(dtype="float64"), "gpu", "float64"),
    (dict(), "tpu", "platform"),
])
def test_check_declines_with_clear_message(kw, platform, words):
  with pytest.raises(backends.Unsupported, match=words):
    pallas_backend.PallasBackend().check(_spec(**kw), platform)


def test_small_head_dim_falls_back_or_explains(rng):
  q, k, v = _inputs(rng, 1, 8, 8, 2, 2, 16, jnp.float32)
  with pytest.raises(jax_flash.Unsupported, match="head_dim 32...256"):
    jax_flash.attention(q, k, v, implementation="pallas")


def _abstract_gpu_mesh():
  from jax._src import mesh as mesh_lib
  device = mesh_lib.AbstractDevice("NVIDIA H200", 1, "cuda")
  return mesh_lib.AbstractMesh((1,), ("x",), (mesh_lib.AxisType.Explicit,),
                               abstract_device=device)


@pytest.mark.skipif(ON_GPU, reason="the GPU run compiles the real thing")
@pytest.mark.parametrize("kw", [
    dict(B=2, T=512, S=512, H=4, Hk=4, D=128),
    dict(B=2, T=300, S=300, H=4, Hk=4, D=128, causal=True,
         dtype=jnp.float32),
    dict(B=1, T=37, S=53, H=4, Hk=2, D=96, window=(5, 3), softcap=3.0,
         seg=True, dtype=jnp.float16),
    dict(B=1, T=1, S=300, H=4, Hk=1, D=256, causal=True, dtype=jnp.float32),
], ids=["mha", "causal_fp32", "gqa_window_seg_fp16",
        "decode_mqa_causal_d256"])
def test_lowers_to_triton_for_h200(kw):
  """Lower fwd + bwd through Pallas' Triton backend for an abstract H200.

  No GPU is needed to build the Triton IR, so this catches constructs the
  Triton lowering rejects before the first GPU run.
  """
  try:
    mesh = _abstract_gpu_mesh()
  except (ImportError, AttributeError, TypeError) as e:
    pytest.skip(f"no deviceless GPU lowering in this jax: {e}")
  from jax_flash._src.backends.pallas import backward, forward
  dtype = kw.get("dtype", jnp.bfloat16)
  B, T, S, H, Hk, D = (kw[x] for x in ("B", "T", "S", "H", "Hk", "D"))
  window = kw.get("window", (-1, -1))
  spec = AttentionSpec(
      scale=D**-0.5, causal=kw.get("causal", False), window_left=window[0],
      window_right=0 if kw.get("causal") else window[1],
      softcap=kw.get("softcap"), has_segment_ids=kw.get("seg", False),
      batch=B, q_len=T, kv_len=S, num_heads=H, num_kv_heads=Hk, head_dim=D,
      dtype=jnp.dtype(dtype).name)
  cfg = pallas_config.config_for("gpu", common.padded_head_dim(D),
                                 jnp.dtype(dtype).itemsize)
  sds = lambda *s, dt=dtype: jax.ShapeDtypeStruct(s, dt)
  q, kv, rows = sds(B, T, H, D), sds(B, S, Hk, D), sds(B, H, T, dt=jnp.float32)
  segs = ([sds(B, T, dt=jnp.int32), sds(B, S, dt=jnp.int32)]
          if spec.has_segment_ids else [])

  def fwd(q, k, v, *segs):
    return forward.forward(spec, q, k, v, *(segs or (None, None)),
                           cfg=cfg.forward, interpret=False)

  def bwd(q, k, v, o, lse, do, delta, *segs):
    return backward.backward(spec, q, k, v, o, lse, do, delta,
                             *(segs or (None, None)), dq_cfg=cfg.backward_dq,
                             dkdv_cfg=cfg.backward_dkdv, interpret=False)

  with jax.sharding.use_abstract_mesh(mesh):
    texts = [
        jax.jit(fwd).trace(q, kv, kv, *segs).lower(
            lowering_platforms=("cuda",)).as_text(),
        jax.jit(bwd).trace(q, kv, kv, q, rows, q, rows, *segs).lower(
            lowering_platforms=("cuda",)).as_text(),
    ]
  assert sum(t.count("__gpu$xla.gpu.triton") for t in texts) == 3
