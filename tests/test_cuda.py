"""The CUDA (FFI) backend: the shared suite plus CUDA-specific checks.

GPU only: everything here is skipped on a machine without a CUDA GPU or
without the compiled extension. Run on the H200 through tools/gpu/gpu_check.sh,
which sets JAX_FLASH_POISON_OUTPUTS=1 so the FFI handlers fill every output
with NaN before each launch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import reference
from attention_suite import (CUDA_SM80, CUDA_SM90, AttentionSuite,
                             BackendSuite, select_cases)
from jax_flash._src.backends import registry as backends
from jax_flash._src.backends import cuda as cuda_backend
from jax_flash._src.backends import ffi
from reference import assert_close_to_reference

ON_GPU = jax.default_backend() == "gpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU"),
    pytest.mark.skipif(not ffi.available(),
                       reason=f"CUDA extension not built: "
                       f"{ffi.unavailable_reason()}"),
]


class TestCudaSuite(BackendSuite):
  implementation = "cuda"
  support = (CUDA_SM90 if ON_GPU and cuda_backend._compute_capability() ==
             (9, 0) else CUDA_SM80)
  dtypes = ("bfloat16", "float16")
  head_dims = (64, 96, 128, 256)
  long_seq = 300  # > two 128-row tiles


class TestCudaSm80SinksSuite(AttentionSuite):
  """The sinks cases on the portable sm80 kernels (JAX_FLASH_CUDA_FAMILY=sm80):
  on Hopper the default dispatch serves them from the sm90 forward, so this
  is where the sm80 forward's sink finalize runs on an H200."""
  implementation = "cuda"
  support = CUDA_SM80
  dtypes = ("bfloat16",)
  head_dims = (64,)
  long_seq = 300
  cases = select_cases("sinks_causal_gqa_empty_rows",
                       "sinks_segments_window_long") + tuple(
      dataclasses.replace(c, name=c.name + "_sinks", sinks=True)
      for c in select_cases("value_dim_mla_causal_gqa_empty_rows"))

  @pytest.fixture(autouse=True)
  def _sm80_family(self, monkeypatch):
    monkeypatch.setenv("JAX_FLASH_CUDA_FAMILY", "sm80")


@pytest.mark.parametrize("head_dim", [40, 80, 200])
def test_padded_head_dims(head_dim, rng):
  """Head dims between buckets are served by the next bucket."""
  B, T, S, H, Hk = 2, 37, 131, 4, 2
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q, k, v = mk(B, T, H, head_dim), mk(B, S, Hk, head_dim), mk(B, S, Hk,
                                                               head_dim)
  do = mk(B, T, H, head_dim)
  f = lambda impl: jax.vjp(
      lambda q, k, v: jax_flash.attention(q, k, v, causal=True,
                                          implementation=impl), q, k, v)
  o, vjp = f("cuda")
  grads = vjp(do)
  ref_o, _ = reference.attention(q, k, v, causal=True)
  ref_g = reference.attention_vjp(q, k, v, do, causal=True)
  base_o, base_vjp = jax.vjp(
      lambda q, k, v: reference.dense_attention_jax(q, k, v, causal=True)[0],
      q, k, v)
  assert_close_to_reference("o", o, ref_o, base_o)
  for name, g, r, b in zip("qkv", grads, ref_g, base_vjp(do)):
    assert_close_to_reference("d" + name, g, r, b)


def test_deterministic_mode_is_bitwise_reproducible(rng):
  B, T, S, H, Hk, D = 2, 300, 300, 4, 2, 128
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q, k, v, do = mk(B, T, H, D), mk(B, S, Hk, D), mk(B, S, Hk, D), mk(B, T, H, D)

  @jax.jit
  def grads(q, k, v, do):
    _, vjp = jax.vjp(lambda q, k, v: jax_flash.attention(
        q, k, v, causal=True, implementation="cuda", deterministic=True), q,
                     k, v)
    return vjp(do)

  first = [np.asarray(g) for g in grads(q, k, v, do)]
  for _ in range(3):
    again = grads(q, k, v, do)
    for a, b in zip(first, again):
      np.testing.assert_array_equal(a.view(np.uint16),
                                    np.asarray(b).view(np.uint16))


def test_default_dispatch_on_gpu():
  """cuda first on GPU (the extension is present here); requests it cannot
  serve fall through to Pallas."""
  from jax_flash._src.core.spec import AttentionSpec
  spec_args = dict(scale=0.1, batch=1, q_len=8, kv_len=8, num_heads=2,
                   num_kv_heads=2, head_dim=64, dtype="bfloat16")
  assert backends.choose(AttentionSpec(**spec_args), None, "gpu").name == "cuda"
  odd = AttentionSpec(**{**spec_args, "head_dim": 36})  # not a multiple of 8
  assert backends.choose(odd, None, "gpu").name == "pallas"
  f32 = AttentionSpec(**{**spec_args, "dtype": "float32"})
  assert backends.choose(f32, None, "gpu").name == "pallas"


def test_explicit_cuda_request_it_cannot_serve_raises(rng):
  q = jnp.asarray(rng.standard_normal((1, 8, 2, 64)), jnp.float32)
  with pytest.raises(NotImplementedError, match="dtype"):
    jax_flash.attention(q, q, q, implementation="cuda")


@pytest.mark.skipif(not ON_GPU or cuda_backend._compute_capability() != (9, 0),
                    reason="the sm90 kernels need an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim, v_head_dim",
                         [(64, 64), (128, 128), (256, 256), (192, 128)])
def test_sm90_forward_serves_hopper(monkeypatch, rng, head_dim, v_head_dim,
                                    causal):
  """On Hopper the forward runs the FA3-style sm90 kernel (also for
  DeepSeek MLA's head-dim pair 192 / 128): forced with
  JAX_FLASH_CUDA_FAMILY=sm90 the handler fails instead of falling back, so a
  passing call proves the sm90 kernel produced these values."""
  assert "sm90" in ffi.families(), "extension built without the sm90 family"
  monkeypatch.setenv("JAX_FLASH_CUDA_FAMILY", "sm90")
  B, T, S, H, H_kv = 2, 333 + head_dim, 517, 4, 2  # shapes unique to this test
  q = jnp.asarray(rng.standard_normal((B, T, H, head_dim)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((B, S, H_kv, head_dim)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((B, S, H_kv, v_head_dim)), jnp.bfloat16)
  o, lse = jax_flash.attention(q, k, v, causal=causal, return_lse=True,
                               implementation="cuda")
  assert o.shape == (B, T, H, v_head_dim)
  ref_o, ref_lse = reference.attention(q, k, v, causal=causal)
  base_o, base_lse = reference.dense_attention_jax(q, k, v, causal=causal)
  assert_close_to_reference("o", o, ref_o, base_o)
  assert_close_to_reference("lse", lse, ref_lse, base_lse)


@pytest.mark.skipif(not ON_GPU or cuda_backend._compute_capability() != (9, 0),
                    reason="the sm90 kernels need an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("mask", ["packed_causal_sinks", "window_softcap_fp16",
                                  "causal_t_gt_s_mqa"])
def test_sm90_forward_serves_the_mla_pair(monkeypatch, rng, mask):
  """DeepSeek MLA's head-dim pair (192, 128) in the sm90 forward with the
  masks of its other kernels: packed segment ids (the tile-span kernels) with
  causal and sinks, a window with softcap in fp16, causal T > S (rows that
  see no key) with one kv head. Forced to the sm90 family (no fallback);
  against the float64 reference."""
  monkeypatch.setenv("JAX_FLASH_CUDA_FAMILY", "sm90")
  D, Dv, H = 192, 128, 4
  dtype = jnp.float16 if "fp16" in mask else jnp.bfloat16
  B, T, S, H_kv = {"packed_causal_sinks": (2, 301, 301, 2),
                   "window_softcap_fp16": (2, 157, 389, 2),
                   "causal_t_gt_s_mqa": (1, 283, 130, 1)}[mask]
  mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  q, k, v = mk(B, T, H, D), mk(B, S, H_kv, D), mk(B, S, H_kv, Dv)
  kw = {}
  if mask == "packed_causal_sinks":
    ids = np.repeat(np.asarray([[0] * 90 + [1] * 150 + [2] * 61]), B, 0)
    ids[1, :40] = 0
    ids[1, 40:] = 1
    ids = jnp.asarray(ids, jnp.int32)
    kw = dict(causal=True, segment_ids=(ids, ids),
              sinks=jnp.asarray(rng.uniform(-1, 3, H), jnp.float32))
  elif mask == "window_softcap_fp16":
    kw = dict(window=(70, 9), softcap=5.0)
  else:
    kw = dict(causal=True)
  o, lse = jax_flash.attention(q, k, v, return_lse=True,
                               implementation="cuda", **kw)
  assert o.shape == (B, T, H, Dv)
  ref_o, ref_lse = reference.attention(q, k, v, **kw)
  base_o, base_lse = reference.dense_attention_jax(q, k, v, **kw)
  assert_close_to_reference("o", o, ref_o, base_o)
  assert_close_to_reference("lse", lse, ref_lse, base_lse)


@pytest.mark.skipif(not ON_GPU or cuda_backend._compute_capability() != (9, 0),
                    reason="the sm90 kernels need an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 200])
def test_sm90_backward_serves_hopper(monkeypatch, rng, head_dim, causal):
  """Forced to the sm90 family, the backward handler fails rather than fall
  back to sm80, so passing gradients come from the FA3-style sm90 backward."""
  monkeypatch.setenv("JAX_FLASH_CUDA_FAMILY", "sm90")
  B, T, S, H, H_kv = 2, 291 + head_dim, 403, 4, 2  # shapes unique to this test
  q = jnp.asarray(rng.standard_normal((B, T, H, head_dim)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((B, S, H_kv, head_dim)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((B, S, H_kv, head_dim)), jnp.bfloat16)
  do = jnp.asarray(rng.standard_normal((B, T, H, head_dim)), jnp.bfloat16)

  def grads(f):
    def loss(q, k, v):
      return jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  got = grads(lambda q, k, v: jax_flash.attention(q, k, v, causal=causal,
                                                  implementation="cuda"))
  base = grads(lambda q, k, v: reference.dense_attention_jax(q, k, v,
                                                             causal=causal)[0])
  ref = reference.attention_vjp(q, k, v, do, causal=causal)
  for name, g, r, b in zip(("dq", "dk", "dv"), got, ref, base):
    assert_close_to_reference(name, g, r, b)


def _mla_pair_case(rng, mask):
  """q, k, v, do and the attention keywords of one mask case of the head-dim
  pair (192, 128): odd lengths, GQA / MQA, shapes unique to these tests."""
  D, Dv, H = 192, 128, 4
  dtype = jnp.float16 if "fp16" in mask else jnp.bfloat16
  B, T, S, H_kv = {"plain_gqa": (2, 291, 403, 2),
                   "causal_gqa": (2, 389, 645, 2),
                   "causal_t_gt_s_mqa": (1, 283, 130, 1),
                   "window_softcap_fp16": (2, 157, 389, 2),
                   "packed_causal": (2, 301, 301, 2),
                   "segments_window": (1, 333, 333, 4)}[mask]
  mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  q, k, v, do = mk(B, T, H, D), mk(B, S, H_kv, D), mk(B, S, H_kv, Dv), mk(B, T, H, Dv)
  if mask in ("causal_gqa", "causal_t_gt_s_mqa"):
    kw = dict(causal=True)
  elif mask == "window_softcap_fp16":
    kw = dict(window=(70, 9), softcap=5.0)
  elif mask == "packed_causal":
    ids = np.repeat(np.asarray([[0] * 90 + [1] * 150 + [2] * 61]), B, 0)
    ids[1, :40] = 0
    ids[1, 40:] = 1
    ids = jnp.asarray(ids, jnp.int32)
    kw = dict(causal=True, segment_ids=(ids, ids))
  elif mask == "segments_window":
    ids = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.01, axis=1), jnp.int32)
    kw = dict(window=(100, 20), segment_ids=(ids, ids))
  else:
    kw = {}
  return q, k, v, do, kw


def _loss_grads(f, q, k, v, do):
  def loss(q, k, v):
    return jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.skipif(not ON_GPU or cuda_backend._compute_capability() != (9, 0),
                    reason="the sm90 kernels need an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("mask", ["plain_gqa", "causal_gqa", "causal_t_gt_s_mqa",
                                  "window_softcap_fp16", "packed_causal",
                                  "segments_window"])
def test_sm90_backward_mla_192v128(monkeypatch, rng, mask):
  """DeepSeek MLA's head-dim pair (192, 128) in the sm90 backward (64 x 96
  tiles, each warpgroup 48 keys, dK / dV transposed): forced to the sm90 family (the
  handler fails rather than fall back to sm80), gradients against the
  float64 reference next to the same-dtype XLA attention's, for plain, causal
  GQA, causal T > S with one kv head (rows that see no key), a window with
  softcap in fp16, packed segment ids with causal (the tile-span kernels) and
  segment ids with a window."""
  monkeypatch.setenv("JAX_FLASH_CUDA_FAMILY", "sm90")
  q, k, v, do, kw = _mla_pair_case(rng, mask)
  got = _loss_grads(lambda q, k, v: jax_flash.attention(
      q, k, v, implementation="cuda", **kw), q, k, v, do)
  assert got[2].shape == v.shape
  base = _loss_grads(lambda q, k, v: reference.dense_attention_jax(
      q, k, v, **kw)[0], q, k, v, do)
  ref = reference.attention_vjp(q, k, v, do, **kw)
  for name, g, r, b in zip(("dq", "dk", "dv"), got, ref, base):
    assert_close_to_reference(name, g, r, b)


def _bitwise_repeatable_grads(grads, *args, runs=5):
  """grads(*args) as numpy arrays, after checking that `runs` calls give
  bitwise identical (dq, dk, dv)."""
  first = [np.asarray(g) for g in grads(*args)]
  for _ in range(runs - 1):
    again = grads(*args)
    for name, a, b in zip(("dq", "dk", "dv"), first, again):
      np.testing.assert_array_equal(a.view(np.uint16),
                                    np.asarray(b).view(np.uint16),
                                    err_msg=f"{name} not bitwise reproducible")
  return first


@pytest.mark.skipif(not ON_GPU or cuda_backend._compute_capability() != (9, 0),
                    reason="the sm90 kernels need an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("mask", ["plain_gqa", "causal_gqa"])
def test_sm90_deterministic_backward_mla_192v128(monkeypatch, rng, mask):
  """deterministic=True for the head-dim pair (192, 128) on Hopper, forced to
  the sm90 family: bitwise identical gradients over repeated runs, close to
  the float64 reference."""
  monkeypatch.setenv("JAX_FLASH_CUDA_FAMILY", "sm90")
  q, k, v, do, kw = _mla_pair_case(rng, mask)

  @jax.jit
  def grads(q, k, v, do):
    _, vjp = jax.vjp(lambda q, k, v: jax_flash.attention(
        q, k, v, implementation="cuda", deterministic=True, **kw), q, k, v)
    return vjp(do)

  first = _bitwise_repeatable_grads(grads, q, k, v, do)
  base = _loss_grads(lambda q, k, v: reference.dense_attention_jax(
      q, k, v, **kw)[0], q, k, v, do)
  ref = reference.attention_vjp(q, k, v, do, **kw)
  for name, g, r, b in zip(("dq", "dk", "dv"), first, ref, base):
    assert_close_to_reference(name, jnp.asarray(g), r, b)


@pytest.mark.skipif(not ON_GPU or cuda_backend._compute_capability() != (9, 0),
                    reason="the sm90 kernels need an sm_90 GPU (H100/H200)")
def test_sm90_backward_mla_192v128_against_sm80(monkeypatch, rng):
  """The pair's sm90 and sm80 backward kernels agree (each forced; causal
  GQA): the sm80 gradients are the ones the pair had before."""
  q, k, v, do, kw = _mla_pair_case(rng, "causal_gqa")
  f = lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda", **kw)
  monkeypatch.setenv("JAX_FLASH_CUDA_FAMILY", "sm90")
  g90 = _loss_grads(f, q, k, v, do)
  monkeypatch.setenv("JAX_FLASH_CUDA_FAMILY", "sm80")
  g80 = _loss_grads(f, q, k, v, do)
  for name, a, b in zip(("dq", "dk", "dv"), g90, g80):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a)), name
    err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6)
    assert err < 4e-2, (name, err)  # both bf16 (selftest_sm90_bwd.cu's tolerance)


@pytest.mark.skipif(not ON_GPU or cuda_backend._compute_capability() != (9, 0),
                    reason="the sm90 kernels need an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_deterministic_backward(monkeypatch, rng, head_dim, causal):
  """deterministic=True on Hopper: forced to the sm90 family (the handler
  fails rather than fall back to sm80), the FA3-style backward adds dQ in a
  fixed order (semaphore workspace): gradients bitwise identical over repeated
  runs and close to the float64 reference. GQA 4:1, several KV and query
  blocks, odd lengths."""
  monkeypatch.setenv("JAX_FLASH_CUDA_FAMILY", "sm90")
  B, T, S, H, H_kv = 2, 389 + head_dim, 645, 8, 2  # shapes unique to this test
  q = jnp.asarray(rng.standard_normal((B, T, H, head_dim)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((B, S, H_kv, head_dim)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((B, S, H_kv, head_dim)), jnp.bfloat16)
  do = jnp.asarray(rng.standard_normal((B, T, H, head_dim)), jnp.bfloat16)

  @jax.jit
  def grads(q, k, v, do):
    _, vjp = jax.vjp(lambda q, k, v: jax_flash.attention(
        q, k, v, causal=causal, implementation="cuda", deterministic=True),
                     q, k, v)
    return vjp(do)

  first = _bitwise_repeatable_grads(grads, q, k, v, do)

  def loss_grads(f):
    def loss(q, k, v):
      return jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  base = loss_grads(lambda q, k, v: reference.dense_attention_jax(
      q, k, v, causal=causal)[0])
  ref = reference.attention_vjp(q, k, v, do, causal=causal)
  for name, g, r, b in zip(("dq", "dk", "dv"), first, ref, base):
    assert_close_to_reference(name, jnp.asarray(g), r, b)
