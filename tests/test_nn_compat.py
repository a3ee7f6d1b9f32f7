"""jax_flash.dot_product_attention against jax.nn.dot_product_attention.

Truth is a float64 transcription of jax.nn's definition (`reference` below:
large-negative masking, top-left causal/window alignment, padded query rows
zeroed), differentiated by jax.grad. float64 runs must match it to ~1e-10;
float32/bfloat16 runs must be within 2x of jax.nn's own same-dtype error
(outputs and gradients, also w.r.t. bias). Requests the blockwise backends
serve run on xla and pallas (interpret mode on CPU); bias/mask requests run
the dense path. Refusals and attention()'s jax.nn-keyword errors too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import reference as numpy_reference
from jax_flash._src.compat import nn_dense

F32_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------
# float64 reference: jax.nn's definition, written out densely.
# ---------------------------------------------------------------------------


def reference(q, k, v, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None,
              local_window_size=None):
  """(out [B,T,N,H], lse [B,T,N]) in float64 for 4-d float64 inputs."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  scale = 1 / np.sqrt(H) if scale is None else scale
  kr, vr = (jnp.repeat(x, N // K, axis=2) for x in (k, v))
  s = jnp.einsum("btnh,bsnh->bnts", q, kr,
                 precision=jax.lax.Precision.HIGHEST) * scale
  if bias is not None:
    s = s + jnp.broadcast_to(bias, s.shape)
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  ok = jnp.ones((B, N, T, S), bool)
  if is_causal:
    ok &= j <= i
  if local_window_size is not None:
    w = local_window_size
    left, right = (w, w) if isinstance(w, int) else w
    ok &= (j >= i - left) & (j <= i + right)
  if mask is not None:
    ok &= mask
  if query_seq_lengths is not None:
    ok &= (i < query_seq_lengths[:, None, None])[:, None]
  if key_value_seq_lengths is not None:
    ok &= (j < key_value_seq_lengths[:, None, None])[:, None]
  s = jnp.where(ok, s, -0.7 * F32_MAX)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bnts,bsnh->btnh", p, vr, precision=jax.lax.Precision.HIGHEST)
  if query_seq_lengths is not None:
    o = o * (np.arange(T)[None] < query_seq_lengths[:, None])[..., None, None]
  return o, jnp.swapaxes(jax.nn.logsumexp(s, axis=-1), 1, 2)


def _expand(x, ndim=4):
  return None if x is None else jnp.reshape(x, (1,) * (ndim - x.ndim) +
                                            x.shape)


def reference_any_rank(q, k, v, bias=None, mask=None, **kw):
  """`reference` for 3-d or 4-d inputs (jax.nn's leading-1 rule)."""
  shape = q.shape
  o, lse = reference(*(_expand(x) for x in (q, k, v, bias, mask)), **kw)
  return o.reshape(shape), lse.reshape(shape[:-1])


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
  id: str
  T: int = 13
  S: int = 21
  N: int = 4
  K: int = 2
  H: int = 32
  B: int = 2
  rank3: bool = False
  bias: tuple | None = None  # bias shape
  mask: tuple | None = None  # mask shape
  q_len: tuple | None = None
  kv_len: tuple | None = None
  kw: tuple = ()  # other keyword arguments, as items

  def kwargs(self):
    kw = dict(self.kw)
    if self.q_len is not None:
      kw["query_seq_lengths"] = jnp.asarray(self.q_len, jnp.int32)
    if self.kv_len is not None:
      kw["key_value_seq_lengths"] = jnp.asarray(self.kv_len, jnp.int32)
    return kw


# Served by the blockwise backends (no dense bias/mask).
BLOCKWISE = [
    Case("plain"),
    Case("causal_T<S", kw=(("is_causal", True),)),
    Case("causal_T>S", T=23, S=10, kw=(("is_causal", True),)),
    Case("window_int", kw=(("local_window_size", 3),)),
    Case("window_T>S_empty_rows", T=30, S=9,
         kw=(("local_window_size", (2, 1)),)),
    Case("window_causal", T=20, S=17,
         kw=(("local_window_size", (4, 2)), ("is_causal", True))),
    Case("kv_len", kv_len=(7, 21)),
    Case("kv_len_zero_and_past_end", kv_len=(0, 40)),
    Case("q_len_causal", q_len=(5, 13), kw=(("is_causal", True),)),
    Case("lengths_window", q_len=(13, 2), kv_len=(9, 4),
         kw=(("local_window_size", (1, 0)),)),
    Case("mqa_scale", K=1, kw=(("scale", 0.37),)),
    Case("rank3_causal", rank3=True, T=9, S=14, kw=(("is_causal", True),)),
]
# Served by the dense path.
DENSE = [
    Case("bias_full", bias=(2, 4, 13, 21)),
    Case("bias_head_broadcast", bias=(1, 4, 13, 21), kw=(("is_causal", True),)),
    Case("bias_2d", bias=(13, 21)),
    Case("bias_key_only", bias=(2, 1, 1, 21), kv_len=(11, 3)),
    Case("mask_batch", mask=(2, 1, 13, 21)),
    Case("mask_2d_causal_T>S", T=25, S=11, mask=(25, 11),
         kw=(("is_causal", True),)),
    Case("mask_heads_rows", mask=(1, 4, 13, 1), q_len=(4, 13)),
    Case("bias_mask_window", bias=(1, 1, 13, 21), mask=(2, 4, 13, 21),
         kw=(("local_window_size", (5, 3)),)),
    Case("window_negative_side", kw=(("local_window_size", (-2, 6)),)),
    Case("rank3_bias_mask", rank3=True, bias=(4, 13, 21), mask=(13, 21)),
]


def _inputs(case, rng, dtype):
  B = () if case.rank3 else (case.B,)
  shapes = [B + (case.T, case.N, case.H), B + (case.S, case.K, case.H),
            B + (case.S, case.K, case.H)]
  qkv = [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]
  bias = mask = None
  if case.bias is not None:
    bias = jnp.asarray(rng.standard_normal(case.bias), dtype)
  if case.mask is not None:
    mask = jnp.asarray(rng.random(case.mask) < 0.7)
    if case.mask[-2] == 1:  # keep some rows fully masked in other shapes
      mask = mask.at[..., 0, 0].set(False)
  return qkv, bias, mask


def _grads(fn, q, k, v, bias, cot):
  """(out, residual, dq, dk, dv[, dbias]) of sum(out * cot), one jit.

  fn(q, k, v, bias) -> (out, residual)."""
  args = (q, k, v) + (() if bias is None else (bias,))

  @jax.jit
  def run(cot, *args):
    f = (lambda q, k, v: fn(q, k, v, None)) if bias is None else fn
    out, vjp, res = jax.vjp(f, *args, has_aux=True)
    return (out, res) + vjp(cot.astype(out.dtype))

  return run(cot, *args)


def _errors(got, ref):
  return [float(jnp.max(jnp.abs(g.astype(jnp.float64) - r)))
          for g, r in zip(got, ref)]


def _check(case, dtype, implementation, rng):
  (q, k, v), bias, mask = _inputs(case, rng, dtype)
  kw = case.kwargs()
  cot = jnp.asarray(rng.standard_normal(q.shape))
  up = lambda x: None if x is None else x.astype(jnp.float64)

  ref_fn = lambda q, k, v, b: reference_any_rank(q, k, v, b, mask, **kw)
  ref = _grads(ref_fn, up(q), up(k), up(v), up(bias), cot)
  ours_fn = lambda q, k, v, b: jax_flash.dot_product_attention(
      q, k, v, b, mask, implementation=implementation, return_residual=True,
      **kw)
  ours = _grads(ours_fn, q, k, v, bias, cot)
  names = ["out", "residual", "dq", "dk", "dv", "dbias"]

  # The residual (not differentiated), also where rows see no key.
  res, ref_res = ours[1], ref[1]
  assert res.dtype == k.dtype and res.shape == q.shape[:-1]
  rel = jnp.abs(res.astype(jnp.float64) - ref_res) / (1 + jnp.abs(ref_res))
  tol = {jnp.float64: 1e-10, jnp.float32: 1e-5}.get(dtype, 1e-2)
  assert float(jnp.max(rel)) <= tol

  skip_res = lambda xs: xs[:1] + xs[2:]
  ours, ref, names = skip_res(ours), skip_res(ref), skip_res(names)
  if dtype == jnp.float64:
    for name, e, r in zip(names, _errors(ours, ref), ref):
      assert e <= 1e-10 * (1 + float(jnp.max(jnp.abs(r)))), (name, e)
  else:
    nn_fn = lambda q, k, v, b: jax.nn.dot_product_attention(
        q, k, v, b, mask, return_residual=True, **kw)
    theirs = skip_res(_grads(nn_fn, q, k, v, bias, cot))
    floor = 1e-6 if dtype == jnp.float32 else 1e-3
    for name, e, e_nn in zip(names, _errors(ours, ref), _errors(theirs, ref)):
      assert e <= 2 * e_nn + floor, (name, e, e_nn)


F64, F32, BF16 = jnp.float64, jnp.float32, jnp.bfloat16
_BY_ID = {c.id: c for c in BLOCKWISE + DENSE}
# The quick subset (-m "not slow"): one run per kind of request.
QUICK = {
    ("causal_T>S", F32, "xla"), ("window_T>S_empty_rows", F32, "xla"),
    ("lengths_window", F32, "xla"), ("rank3_causal", F32, "xla"),
    ("lengths_window", F32, "pallas"), ("kv_len_zero_and_past_end", F64,
                                         "xla"),
    ("mqa_scale", BF16, "xla"),
    ("bias_mask_window", F32, None), ("mask_2d_causal_T>S", F64, None),
    ("bias_key_only", BF16, None), ("rank3_bias_mask", F32, None),
}


def _params(cases, dtypes, implementations):
  out = []
  for c in cases:
    for dt in dtypes:
      for impl in implementations:
        quick = (c.id, dt, impl) in QUICK
        out.append(pytest.param(
            c.id, dt, impl, id=f"{c.id}-{jnp.dtype(dt).name}-{impl}",
            marks=() if quick else pytest.mark.slow))
  return out


@pytest.mark.parametrize(
    "case,dtype,implementation",
    _params(BLOCKWISE, (F32, F64, BF16), ("xla",)) +
    _params(BLOCKWISE, (F32,), ("pallas",)) +
    # Pallas in float64/bfloat16: the masking-heavy cases (the kernels'
    # own dtype coverage is test_pallas.py's).
    _params(BLOCKWISE[4:7] + BLOCKWISE[9:10], (F64, BF16), ("pallas",)) +
    _params(DENSE, (F32, F64, BF16), (None,)))
def test_matches_jax_nn(case, dtype, implementation, rng, x64):
  _check(_BY_ID[case], dtype, implementation, rng)


def test_dense_chunks_rows(rng, x64, monkeypatch):
  """Query-row chunking (lax.map + checkpoint) gives jax.nn's values,
  gradients w.r.t. a row-dependent bias included."""
  monkeypatch.setattr(nn_dense, "CHUNK_ELEMENTS", 2 * 4 * 21 * 8)  # 8 rows
  case = Case("chunk_rows", T=29, bias=(1, 4, 29, 21), mask=(2, 1, 29, 21),
              q_len=(29, 17), kw=(("is_causal", True),))
  _check(case, F64, "xla", rng)


@pytest.mark.slow
def test_dense_chunks_rows_broadcast_bias(rng, x64, monkeypatch):
  monkeypatch.setattr(nn_dense, "CHUNK_ELEMENTS", 2 * 4 * 21 * 8)
  _check(Case("chunk_keys_only", T=29, bias=(2, 1, 1, 21), kv_len=(5, 21)),
         F64, "xla", rng)


def test_blockwise_requests_skip_dense_path(rng, x64, monkeypatch):
  """Requests without bias/mask are served by the backends, never densely."""
  def fail(*a, **k):
    raise AssertionError("dense path used")
  monkeypatch.setattr(nn_dense, "attention", fail)
  for case in BLOCKWISE:
    (q, k, v), _, _ = _inputs(case, rng, jnp.float32)
    jax.eval_shape(lambda q, k, v: jax_flash.dot_product_attention(
        q, k, v, **case.kwargs()), q, k, v)


def test_array_likes_jit_vmap(rng, x64):
  """Python lists (as jax.nn takes them), under jit and vmap."""
  (q, k, v), _, _ = _inputs(Case("lists", rank3=True, T=5, S=7), rng,
                            jnp.float32)
  ours = jax_flash.dot_product_attention(q.tolist(), k.tolist(), v.tolist(),
                                         is_causal=True)
  theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(ours, theirs, atol=2e-6)
  f = jax.jit(jax.vmap(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, local_window_size=(1, 2), implementation="xla")))
  g = jax.vmap(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, local_window_size=(1, 2)))
  qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
  np.testing.assert_allclose(f(qs, ks, vs), g(qs, ks, vs), atol=2e-6)


def test_traced_scale_and_empty_batch(rng, x64):
  (q, k, v), _, _ = _inputs(Case("s", T=5, S=6), rng, jnp.float32)
  f = jax.jit(lambda s: jax_flash.dot_product_attention(q, k, v, scale=s))
  np.testing.assert_allclose(
      f(0.5), jax.nn.dot_product_attention(q, k, v, scale=0.5), atol=2e-6)
  empty = jax_flash.dot_product_attention(q[:0], k[:0], v[:0], is_causal=True)
  assert empty.shape == (0,) + q.shape[1:]


# ---------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["pallas", "cuda", "cudnn"])
def test_fused_backends_refuse_bias_and_mask(implementation):
  q = jnp.ones((1, 5, 2, 32))
  bias = jnp.zeros((1, 1, 5, 5))
  with pytest.raises(jax_flash.Unsupported,
                     match=rf"implementation='{implementation}'"):
    jax_flash.dot_product_attention(q, q, q, bias,
                                    implementation=implementation)
  with pytest.raises(jax_flash.Unsupported,
                     match=rf"implementation='{implementation}'"):
    jax_flash.dot_product_attention(q, q, q, mask=bias == 0,
                                    implementation=implementation)


def test_cuda_refused_off_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("the platform is a GPU")
  q = jnp.ones((1, 5, 2, 32), jnp.bfloat16)
  with pytest.raises(jax_flash.Unsupported,
                     match="implementation='cuda' needs an NVIDIA GPU"):
    jax_flash.dot_product_attention(q, q, q, implementation="cuda")
  # jax.nn's name is the one the message starts from, with what it maps to
  # and the alternatives.
  with pytest.raises(jax_flash.Unsupported) as info:
    jax_flash.dot_product_attention(q, q, q, implementation="cudnn")
  msg = str(info.value)
  assert msg.startswith("implementation='cudnn' maps to jax_flash's CUDA "
                        "kernels"), msg
  assert "needs an NVIDIA GPU" in msg and "'xla'" in msg, msg
  assert "implementation=None" in msg, msg


@pytest.mark.parametrize("kwargs,match", [
    (dict(implementation="triton"), r"implementation='triton'.*'cudnn'"),
    (dict(mask=jnp.zeros((1, 1, 5, 5))), r"mask must be a boolean"),
    (dict(bias=jnp.zeros((1, 3, 5, 5))), r"bias must be broadcastable"),
    (dict(key_value_seq_lengths=jnp.ones((2,), jnp.int32)),
     r"key_value_seq_lengths must be .* shape \(B,\) = \(1,\)"),
    (dict(query_seq_lengths=jnp.ones((1,))), r"query_seq_lengths must be .*"
     "integer"),
    (dict(local_window_size=(1, 2, 3)), r"local_window_size must be"),
], ids=["implementation", "mask_dtype", "bias_shape", "kv_len_shape",
        "q_len_dtype", "window"])
def test_bad_arguments(kwargs, match):
  q = jnp.ones((1, 5, 2, 32))
  with pytest.raises(ValueError, match=match):
    jax_flash.dot_product_attention(q, q, q, **kwargs)


def test_rank5_refused():
  q = jnp.ones((1, 1, 5, 2, 32))
  with pytest.raises(ValueError, match=r"rank 3 or 4.*jax_flash.attention"):
    jax_flash.dot_product_attention(q, q, q)


# ---------------------------------------------------------------------------
# jax_flash.attention: jax.nn's names answered, kv_seq_lengths
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,value,match", [
    ("is_causal", True, r"use causal=True.*bottom-right.*dot_product_attenti"),
    ("local_window_size", 3, r"use window=\(left, right\)"),
    ("key_value_seq_lengths", [3], r"use kv_seq_lengths="),
    ("query_seq_lengths", [3], r"segment_ids="),
    ("mask", None, r"no dense mask.*dot_product_attention"),
    ("bias", None, r"no dense bias.*dot_product_attention"),
    ("return_residual", True, r"return_lse=True"),
])
def test_attention_names_jax_nn_keywords(name, value, match):
  q = jnp.ones((1, 5, 2, 16))
  with pytest.raises(TypeError, match=match):
    jax_flash.attention(q, q, q, **{name: value})


def test_attention_other_refusals():
  q = jnp.ones((1, 5, 2, 16))
  with pytest.raises(TypeError, match=r"positional.*bias, mask.*"
                     "dot_product_attention"):
    jax_flash.attention(q, q, q, None, None)
  with pytest.raises(ValueError, match=r"implementation='cuda'"):
    jax_flash.attention(q, q, q, implementation="cudnn")
  with pytest.raises(TypeError, match=r"unexpected keyword argument 'caussal'"):
    jax_flash.attention(q, q, q, caussal=True)
  with pytest.raises(ValueError, match=r"either kv_seq_lengths or segment_ids"):
    jax_flash.attention(q, q, q, kv_seq_lengths=jnp.array([3]),
                        segment_ids=jnp.zeros((1, 5), jnp.int32))
  with pytest.raises(ValueError, match=r"kv_seq_lengths must be an integer"):
    jax_flash.attention(q, q, q, kv_seq_lengths=jnp.array([3.0]))


_KV_QUICK = {("causal", 5, "xla"), ("window", 1, "xla")}


@pytest.mark.parametrize("band,T,implementation", [
    pytest.param(band, T, impl, id=f"{band}-T{T}-{impl}",
                 marks=() if (band, T, impl) in _KV_QUICK else pytest.mark.slow)
    for band in ("causal", "window", "full") for T in (1, 5)
    for impl in ("xla", "pallas")])
def test_attention_kv_seq_lengths(band, T, implementation, rng, x64):
  """A preallocated KV cache with L valid keys equals attending to k[:L]
  (queries = the last T of the L tokens), values and gradients."""
  kw = {"causal": dict(causal=True), "window": dict(window=(4, 1)),
        "full": {}}[band]
  B, S, H, K, D = 3, 37, 4, 2, 32
  L = [19, 37, 3]
  q = jnp.asarray(rng.standard_normal((B, T, H, D)))
  k, v = (jnp.asarray(rng.standard_normal((B, S, K, D))) for _ in range(2))
  cot = jnp.asarray(rng.standard_normal(q.shape))

  def cache(q, k, v):
    return jax_flash.attention(q, k, v, kv_seq_lengths=jnp.asarray(L),
                               implementation=implementation, **kw)

  out, vjp = jax.vjp(jax.jit(cache), q, k, v)
  dq, dk, dv = vjp(cot)
  for b, n in enumerate(L):
    one = lambda x: np.asarray(x[b:b + 1])
    args = (one(q), one(k)[:, :n], one(v)[:, :n])
    ref, _ = numpy_reference.attention(*args, **kw)
    rq, rk, rv = numpy_reference.attention_vjp(*args, one(cot), **kw)
    np.testing.assert_allclose(one(out), ref, atol=1e-12)
    np.testing.assert_allclose(one(dq), rq, atol=1e-12)
    np.testing.assert_allclose(one(dk)[:, :n], rk, atol=1e-12)
    np.testing.assert_allclose(one(dv)[:, :n], rv, atol=1e-12)
    assert not np.any(dk[b, n:]) and not np.any(dv[b, n:])
