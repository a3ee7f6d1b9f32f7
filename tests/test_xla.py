"""The pure-JAX blockwise backend: the shared suite, gradient checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash
import reference
from attention_suite import XLA, AttentionSuite, BackendSuite, Case, select_cases
from jax_flash._src.backends import xla as xla_backend


@pytest.mark.slow
class TestXlaSuite(BackendSuite):
  implementation = "xla"
  support = XLA
  # The XLA backend's blocks are 512 long: "longer than one block" is 600.
  long_seq = 600


class TestXlaSuiteFloat16(AttentionSuite):
  """float16 (CUDA's other dtype) on a few cases, and the default dispatch."""
  implementation = None
  dtypes = ("float16",)
  head_dims = (64,)
  long_seq = 600
  cases = select_cases("causal_t_gt_s_empty_rows", "window_both_long",
                       "segments_pair_empty_rows",
                       "sinks_causal_gqa_empty_rows",
                       "value_dim_larger_sinks_segments")


@pytest.mark.slow
class TestXlaSmallBlocks(AttentionSuite):
  """Many blocks per sequence (block 16), so every masking path of the
  blockwise loops (block skipping, partial tail blocks) runs at small sizes."""
  implementation = "xla"
  dtypes = ("float32",)
  head_dims = (32,)
  long_seq = 100
  cases = select_cases(
      "odd_gqa_t_lt_s", "odd_mqa_t_gt_s", "decode_causal_window",
      "causal_t_gt_s_empty_rows", "causal_long_gqa", "window_right_empty_rows",
      "window_both_long", "window_causal_long", "window_causal_clipped",
      "segments_causal_gqa_long", "segments_pair_empty_rows")

  @pytest.fixture(autouse=True)
  def _small_blocks(self, monkeypatch):
    monkeypatch.setattr(xla_backend, "BLOCK", 16)
    # attention_fn caches traced closures per (backend, spec); BLOCK is read
    # at trace time, so jit caches must not hand back a 512-block trace.
    jax.clear_caches()
    yield
    jax.clear_caches()


# ---------------------------------------------------------------------------
# Finite-difference gradient checks (float64: tight; float32: loose).
# ---------------------------------------------------------------------------

GRAD_CASES = (
    Case("plain", T=7, S=9, H=2, Hk=2),
    Case("causal", T=9, S=6, H=2, Hk=2, causal=True),
    Case("window", T=8, S=8, H=2, Hk=2, window=(2, 1)),
    Case("gqa", T=6, S=7, H=4, Hk=2, causal=True),
    Case("segments", T=8, S=8, H=2, Hk=1, segments="packed"),
    Case("softcap", T=5, S=7, H=2, Hk=2, softcap=2.0, scale=0.7),
)


def _grad_problem(case, dtype, rng, D=8):
  T, S, H, Hk = case.T, case.S or case.T, case.H, case.Hk or case.H
  q = jnp.asarray(rng.standard_normal((2, T, H, D)), dtype)
  k = jnp.asarray(rng.standard_normal((2, S, Hk, D)), dtype)
  v = jnp.asarray(rng.standard_normal((2, S, Hk, D)), dtype)
  kw = dict(causal=case.causal, window=case.window, softcap=case.softcap,
            scale=case.scale)
  if case.segments:
    kw["segment_ids"] = jnp.asarray(np.stack([np.arange(T) // 3] * 2),
                                    jnp.int32)
  return (q, k, v), kw


def _with_lse(impl, kw):
  """o and lse both feed the checked function (exercises the dLSE path)."""
  def f(q, k, v):
    o, lse = jax_flash.attention(q, k, v, return_lse=True,
                                 implementation=impl, **kw)
    return o, jnp.where(jnp.isfinite(lse), lse, 0.0)
  return f


@pytest.mark.slow
@pytest.mark.parametrize("case", GRAD_CASES, ids=str)
def test_check_grads_float64(case, rng, x64):
  args, kw = _grad_problem(case, jnp.float64, rng)
  f = _with_lse("xla", kw)
  o, lse = f(*args)
  assert o.dtype == jnp.float64
  # The float64 path must match the float64 reference closely too.
  ref_kw = dict(kw)
  if "segment_ids" in kw:
    ids = np.asarray(kw["segment_ids"])
    ref_kw["segment_ids"] = (ids, ids)
  ref_o, ref_lse = reference.attention(*map(np.asarray, args), **ref_kw)
  np.testing.assert_allclose(np.asarray(o), ref_o, atol=1e-12)
  np.testing.assert_allclose(np.asarray(lse), np.where(np.isfinite(ref_lse),
                                                       ref_lse, 0), atol=1e-12)
  # Analytic gradients (o and lse cotangents) against the float64 reference:
  # every step of the float64 path must be float64 (delta too).
  do = jnp.asarray(rng.standard_normal(o.shape))
  dlse = jnp.asarray(rng.standard_normal(lse.shape))
  _, vjp = jax.vjp(f, *args)
  ref_g = reference.attention_vjp(*map(np.asarray, args), np.asarray(do),
                                  dlse=np.asarray(dlse), **ref_kw)
  for g, r in zip(vjp((do, dlse)), ref_g):
    assert g.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(g), r, atol=1e-12)
  check_grads(f, args, order=1, modes=("rev",), atol=1e-6, rtol=1e-6,
              eps=1e-5)


@pytest.mark.parametrize("case", GRAD_CASES, ids=str)
def test_check_grads_float32(case, rng):
  args, kw = _grad_problem(case, jnp.float32, rng)
  check_grads(_with_lse("xla", kw), args, order=1, modes=("rev",), atol=5e-2,
              rtol=5e-2, eps=1e-2)
