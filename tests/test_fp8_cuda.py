"""The CUDA FP8 kernels called directly (below the fp8_attention API): the
quantisation pre-pass against quantize.py, and the sm90 FP8 forward against
float64 attention of the dequantised inputs (the same e4m3 values the kernel
reads) at odd sizes with every option. GPU only (sm90 build); run with
JAX_FLASH_POISON_OUTPUTS=1 (tools/gpu/fp8_check.sh) so that unwritten
outputs show up as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash._src.backends import ffi
from jax_flash._src.backends.registry import Unsupported
from jax_flash._src.fp8 import cuda, quantize, scheme
from jax_flash._src.core.spec import AttentionSpec

ON_GPU = jax.default_backend() == "gpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU"),
    pytest.mark.skipif(not ffi.available(), reason="CUDA extension not built"),
]


def _spec(B, T, S, H, Hk, D, **kw):
  return AttentionSpec(scale=kw.pop("scale", 1.0 / np.sqrt(D)), batch=B,
                       q_len=T, kv_len=S, num_heads=H, num_kv_heads=Hk,
                       head_dim=D, dtype="bfloat16", **kw)


@pytest.fixture(autouse=True)
def _needs_kernel():
  try:
    cuda.check(_spec(1, 1, 1, 1, 1, 128), jax.default_backend())
  except Unsupported as e:
    pytest.skip(str(e))


def _inputs(rng, B, T, S, H, Hk, D, dtype=jnp.bfloat16, outliers=False):
  def mk(*shape):
    x = rng.standard_normal(shape)
    if outliers:
      x = np.where(rng.random(shape) < 1e-3, 10 * rng.standard_normal(shape), x)
    return jnp.asarray(x, dtype)
  return mk(B, T, H, D), mk(B, S, Hk, D), mk(B, S, Hk, D)


# (B, T, S, H, Hk): one chunk of V's keys; 32 chunks (the most) of 532 keys
# and 67 tiles of 256 (cuda/fp8/quantize.h).
@pytest.mark.parametrize("shape", [(2, 131, 203, 3, 1), (1, 70, 17000, 2, 2)],
                         ids=["short", "long"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("seed", [None, 3])
def test_prepass_matches_quantize_py(D, seed, shape, rng):
  B, T, S, H, Hk = shape
  q, k, v = _inputs(rng, B, T, S, H, Hk, D, outliers=True)
  got = jax.jit(lambda q, k, v: cuda.quantize(q, k, v, seed=seed))(q, k, v)
  # quantize.py on the CPU, whose float32 division is correctly rounded like
  # the pre-pass's (quantize._scales: XLA's GPU division is not).
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    want = quantize.quantize_qkv(*jax.device_put((q, k, v), cpu), seed=seed)
  for name, g, w in zip(("q8", "qd", "k8", "kd", "v8", "vd"), got, want):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    g, w = np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
    assert np.all(np.isfinite(g)), name
    if name in ("qd", "kd", "vd"):
      np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=name)
    elif seed is None or name == "v8":  # no rotation: the same float ops
      np.testing.assert_array_equal(g, w, err_msg=name)
    else:  # the rotation's sums round differently: rare one-step flips
      differ = g != w
      assert differ.mean() <= 2e-3, (name, differ.mean())
      step = np.abs(w) * 2.0**-3 + 2.0**-9
      assert np.all(np.abs(g - w)[differ] <= 1.01 * step[differ]), name


# Bit for bit with the rotation too: against the numpy emulation of the
# pre-pass's own sums (tests/fp8_prepass_oracle.py: the butterflies in stride
# order, checked against quantize.py on the CPU in test_fp8_prepass_layout.py).
@pytest.mark.parametrize("shape", [(2, 131, 203, 3, 1), (1, 70, 17000, 2, 2)],
                         ids=["short", "long"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_prepass_rotation_bitwise(D, dtype, shape, rng):
  import fp8_prepass_oracle as oracle
  B, T, S, H, Hk = shape
  q, k, v = _inputs(rng, B, T, S, H, Hk, D, dtype=dtype, outliers=True)
  got = jax.jit(lambda q, k, v: cuda.quantize(q, k, v, seed=7))(q, k, v)
  want = oracle.quantize_qk(q, k, 7)
  for name, g, w in zip(("q8", "qd", "k8", "kd"), got[:4], want):
    g, w = np.ascontiguousarray(g), np.ascontiguousarray(w)
    assert g.shape == w.shape and g.dtype == w.dtype, name
    np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8),
                                  err_msg=name)


def _dequantised_reference(spec, q8, qd, k8, kd, v8, vd, q_seg=None, kv_seg=None):
  """float64 softmax attention of the dequantised inputs (dense)."""
  f = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  q, k, v = f(q8), f(k8), f(v8)
  B, T, H, D = q.shape
  S, Hk = k.shape[1], k.shape[2]
  q = q * np.repeat(f(qd), scheme.Q_BLOCK, axis=2)[:, :, :T].transpose(0, 2, 1)[..., None]
  k = k * np.repeat(f(kd), scheme.k_block(D), axis=2)[:, :, :S].transpose(0, 2, 1)[..., None]
  v = v * f(vd)[:, None]
  g = H // Hk
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, k) * spec.scale
  if spec.softcap:
    s = spec.softcap * np.tanh(s / spec.softcap)
  i = np.arange(T)[:, None] + (S - T)
  j = np.arange(S)[None, :]
  vis = np.ones((T, S), bool)
  if spec.window_left >= 0:
    vis &= j >= i - spec.window_left
  if spec.window_right >= 0:
    vis &= j <= i + spec.window_right
  vis = np.broadcast_to(vis, (B, 1, T, S))
  if q_seg is not None:
    vis = vis & (np.asarray(q_seg)[:, None, :, None] == np.asarray(kv_seg)[:, None, None, :])
  s = np.where(vis, s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.exp(s - m)
  l = p.sum(-1, keepdims=True)
  o = np.einsum("bhts,bshd->bthd", p / np.where(l > 0, l, 1), v)
  lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1)) + m[..., 0], -np.inf)
  return o, lse


CASES = {
    "full": {},
    "causal": dict(window_right=0, causal=True),
    "window": dict(window_left=37, window_right=5),
    "softcap": dict(softcap=15.0),
    "segments": {},
}


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("T,S", [(200, 333), (131, 131), (1, 257), (300, 77)])
def test_forward_matches_dequantised_float64(D, case, T, S, rng):
  B, H, Hk = 2, 4, 2
  kw = dict(CASES[case])
  q, k, v = _inputs(rng, B, T, S, H, Hk, D)
  segs = (None, None)
  if case == "segments":
    kw["has_segment_ids"] = True
    segs = (jnp.asarray(rng.integers(0, 3, (B, T)), jnp.int32),
            jnp.asarray(rng.integers(0, 3, (B, S)), jnp.int32))
  spec = _spec(B, T, S, H, Hk, D, **kw)
  q8, qd, k8, kd, v8, vd = quantize.quantize_qkv(q, k, v, seed=1)
  for out_dtype in (jnp.bfloat16, jnp.float16):
    o, lse = jax.jit(lambda *a: cuda.forward(spec, *a, out_dtype))(
        q8, qd, k8, kd, v8, vd, *segs)
    assert o.dtype == out_dtype and o.shape == q.shape
    ref_o, ref_lse = _dequantised_reference(spec, q8, qd, k8, kd, v8, vd, *segs)
    o = np.asarray(o.astype(jnp.float32), np.float64)
    lse = np.asarray(lse, np.float64)
    assert not np.any(np.isnan(o)) and not np.any(np.isnan(lse))
    empty = ~np.isfinite(ref_lse)  # rows that see no key
    assert np.array_equal(~np.isfinite(lse), empty)
    assert np.all(o.transpose(0, 2, 1, 3)[empty] == 0)
    # P is e4m3 (3 mantissa bits): ~2^-5 relative rounding per term, mostly
    # averaging out over the keys; layout mistakes give O(1) errors.
    err = np.sqrt(np.mean((o - ref_o) ** 2)) / np.sqrt(np.mean(ref_o**2))
    assert err < 3e-2, err
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], atol=2e-3, rtol=1e-3)


def test_empty_batch():
  spec = _spec(0, 5, 7, 2, 2, 128)
  z = lambda *s: jnp.zeros(s, jnp.float8_e4m3fn)
  f32 = lambda *s: jnp.ones(s, jnp.float32)
  o, lse = cuda.forward(spec, z(0, 5, 2, 128), f32(0, 2, 1), z(0, 7, 2, 128),
                        f32(0, 2, 1), z(0, 7, 2, 128), f32(0, 2, 128), None,
                        None, jnp.bfloat16)
  assert o.shape == (0, 5, 2, 128) and lse.shape == (0, 2, 5)
