"""Bad arguments raise at trace time with a message naming the argument.

Every error case runs three ways: eagerly on concrete arrays, inside
`jax.jit` (tracers), and through `jax.eval_shape` on `jax.ShapeDtypeStruct`s
(nothing is computed) — the checks must not depend on concrete values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash

B, T, S, H, HK, D = 2, 8, 12, 4, 2, 16
MODES = ("eager", "jit", "eval_shape")


def _shapes(q=(B, T, H, D), k=(B, S, HK, D), v=None, dtype=jnp.float32,
            kdtype=None):
  v = k if v is None else v
  kdtype = dtype if kdtype is None else kdtype
  return ((q, dtype), (k, kdtype), (v, kdtype))


def _call(mode, specs, segs=None, **kw):
  """Call attention on arrays/tracers/ShapeDtypeStructs built from specs."""
  kw.setdefault("implementation", "xla")
  segs_arr = segs
  if mode == "eval_shape":
    args = [jax.ShapeDtypeStruct(s, d) for s, d in specs]
    f = lambda q, k, v, segs: jax_flash.attention(q, k, v, segment_ids=segs,
                                                  **kw)
    if segs is not None:
      segs_arr = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                              segs)
    return jax.eval_shape(f, *args, segs_arr)
  args = [jnp.ones(s, d) for s, d in specs]
  f = lambda q, k, v, segs: jax_flash.attention(q, k, v, segment_ids=segs,
                                                **kw)
  if mode == "jit":
    f = jax.jit(f)
  return f(*args, segs)


# (id, specs, kwargs, exception, message regex)
SHAPE_ERRORS = [
    ("q_rank2", _shapes(q=(T, D)), {}, ValueError,
     r"query must have rank >= 3"),
    ("k_rank2", _shapes(k=(S, D)), {}, ValueError, r"key must have rank >= 3"),
    ("rank_mismatch", _shapes(k=(S, HK, D), v=(S, HK, D)), {}, ValueError,
     r"same rank"),
    ("batch_mismatch", _shapes(k=(B + 1, S, HK, D)), {}, ValueError,
     r"batch dims"),
    ("kv_seq_mismatch", _shapes(v=(B, S + 1, HK, D)), {}, ValueError,
     r"key and value must have the same shape"),
    ("kv_heads_mismatch", _shapes(v=(B, S, HK * 2, D)), {}, ValueError,
     r"key and value must have the same shape"),
    ("head_dim_mismatch", _shapes(k=(B, S, HK, D * 2)), {}, ValueError,
     r"head_dim of query \(16\) and key/value \(32\)"),
    ("heads_not_multiple", _shapes(q=(B, T, 3, D)), {}, ValueError,
     r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
    ("head_dim_0", _shapes(q=(B, T, H, 0), k=(B, S, HK, 0)), {}, ValueError,
     r"head_dim 0 is out of range"),
    ("head_dim_300", _shapes(q=(B, T, H, 300), k=(B, S, HK, 300)), {},
     ValueError, r"head_dim 300 is out of range"),
    ("q_seq_0", _shapes(q=(B, 0, H, D)), {}, ValueError,
     r"sequence lengths must be >= 1"),
    ("kv_seq_0", _shapes(k=(B, 0, HK, D)), {}, ValueError,
     r"sequence lengths must be >= 1"),
    ("dtype_int32", _shapes(dtype=jnp.int32), {}, ValueError,
     r"query has dtype int32; supported dtypes"),
    ("dtype_complex", _shapes(dtype=jnp.complex64), {}, ValueError,
     r"query has dtype complex64; supported dtypes"),
    ("dtype_mixed", _shapes(kdtype=jnp.bfloat16), {}, ValueError,
     r"same dtype"),
    ("window_neg2", _shapes(), dict(window=(-2, 0)), ValueError, r"window"),
    ("window_len1", _shapes(), dict(window=(1,)), ValueError, r"window"),
    ("window_str", _shapes(), dict(window="a"), ValueError, r"window"),
    ("window_float", _shapes(), dict(window=(1.5, 2)), ValueError, r"window"),
    ("window_bool", _shapes(), dict(window=(True, 1)), ValueError, r"window"),
    ("window_none_item", _shapes(), dict(window=(None, 1)), ValueError,
     r"window"),
    ("softcap_0", _shapes(), dict(softcap=0), ValueError, r"softcap"),
    ("softcap_neg", _shapes(), dict(softcap=-1.0), ValueError, r"softcap"),
    ("softcap_inf", _shapes(), dict(softcap=float("inf")), ValueError,
     r"softcap"),
    ("softcap_str", _shapes(), dict(softcap="2"), ValueError, r"softcap"),
    ("scale_nan", _shapes(), dict(scale=float("nan")), ValueError, r"scale"),
    ("scale_str", _shapes(), dict(scale="1"), ValueError, r"scale"),
    ("impl_unknown", _shapes(), dict(implementation="triton"), ValueError,
     r"implementation='triton' is not known; supported: .*'xla'"),
    ("impl_not_str", _shapes(), dict(implementation=3), ValueError,
     r"implementation must be a string or None"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("specs,kw,exc,msg",
                         [c[1:] for c in SHAPE_ERRORS],
                         ids=[c[0] for c in SHAPE_ERRORS])
def test_bad_arguments_raise(specs, kw, exc, msg, mode):
  with pytest.raises(exc, match=msg):
    _call(mode, specs, **kw)


def _ids(shape, dtype=jnp.int32):
  return jnp.zeros(shape, dtype)


SEGMENT_ERRORS = [
    ("single_array_t_ne_s", _ids((B, T)), r"single segment_ids array needs "
     r"T == S \(got T=8, S=12\)"),
    ("three_items", (_ids((B, T)), _ids((B, S)), _ids((B, S))),
     r"segment_ids must be \(q_segment_ids, kv_segment_ids\)"),
    ("q_wrong_len", (_ids((B, T + 1)), _ids((B, S))),
     r"q_segment_ids must have shape \(2, 8\)"),
    ("kv_wrong_len", (_ids((B, T)), _ids((B, S - 1))),
     r"kv_segment_ids must have shape \(2, 12\)"),
    ("kv_wrong_batch", (_ids((B, T)), _ids((B + 1, S))),
     r"kv_segment_ids must have shape \(2, 12\)"),
    ("q_missing_batch", (_ids((T,)), _ids((B, S))),
     r"q_segment_ids must have shape \(2, 8\)"),
    ("q_float", (_ids((B, T), jnp.float32), _ids((B, S))),
     r"q_segment_ids must be an integer array"),
    ("kv_bool", (_ids((B, T)), _ids((B, S), jnp.bool_)),
     r"kv_segment_ids must be an integer array"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("segs,msg", [c[1:] for c in SEGMENT_ERRORS],
                         ids=[c[0] for c in SEGMENT_ERRORS])
def test_bad_segment_ids_raise(segs, msg, mode):
  with pytest.raises(ValueError, match=msg):
    _call(mode, _shapes(), segs=segs)


def test_segment_ids_not_array():
  with pytest.raises(ValueError, match=r"q_segment_ids must be an integer"):
    _call("eager", _shapes(), segs=([0] * T, _ids((B, S))))


def test_query_not_array():
  k = jnp.ones((B, S, HK, D))
  with pytest.raises(ValueError, match=r"query must be an array, got list"):
    jax_flash.attention([[[1.0]]], k, k)


@pytest.mark.parametrize("name", ["scale", "softcap"])
def test_traced_scale_or_softcap_raises(name):
  q = jnp.ones((B, T, H, D))
  k = jnp.ones((B, S, HK, D))

  @jax.jit
  def f(x):
    return jax_flash.attention(q, k, k, **{name: x})

  with pytest.raises(ValueError, match=rf"{name} must be .*(static|float)"):
    f(1.0)


@pytest.mark.parametrize("mode", MODES)
def test_cuda_unavailable(mode):
  """implementation="cuda" without the CUDA backend: a ValueError listing the
  registered implementations; with it registered but no GPU, Unsupported."""
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present; test_cuda.py covers the CUDA backend")
  if "cuda" not in jax_flash._src.backends.registry.names():  # registered, runnable or not
    msg = r"implementation='cuda' is not known; supported: .*'xla'.* or None"
    with pytest.raises(ValueError, match=msg):
      _call(mode, _shapes(), implementation="cuda")
  else:
    with pytest.raises(NotImplementedError, match=r"cuda"):
      _call(mode, _shapes(), implementation="cuda")


# ---------------------------------------------------------------------------
# Valid requests never fail with implementation=None (CPU default dispatch).
# ---------------------------------------------------------------------------

VALID = [
    ("plain", _shapes(), {}, None),
    ("gqa_causal", _shapes(), dict(causal=True), None),
    ("mqa_window", _shapes(k=(B, S, 1, D)), dict(window=(3, -1)), None),
    ("window_list", _shapes(), dict(window=[-1, 2]), None),
    ("window_np_ints", _shapes(), dict(window=(np.int64(3), np.int32(0))),
     None),
    ("softcap_int", _shapes(), dict(softcap=30), None),
    ("scale_np", _shapes(), dict(scale=np.float32(0.1)), None),
    ("scale_int", _shapes(), dict(scale=1), None),
    ("segments_pair", _shapes(), {}, (_ids((B, T)), _ids((B, S)))),
    ("segments_single", _shapes(k=(B, T, HK, D)), {}, _ids((B, T))),
    ("segments_small_ints", _shapes(), {}, (_ids((B, T), jnp.int16),
                                       _ids((B, S), jnp.uint8))),
    ("rank3", _shapes(q=(T, H, D), k=(S, HK, D)), dict(causal=True), None),
    ("rank5", _shapes(q=(2, 3, T, H, D), k=(2, 3, S, HK, D)), {}, None),
    ("decode", _shapes(q=(B, 1, H, D)), dict(causal=True), None),
    ("head_dim_1", _shapes(q=(B, T, H, 1), k=(B, S, HK, 1)), {}, None),
    ("head_dim_256", _shapes(q=(B, T, H, 256), k=(B, S, HK, 256)), {}, None),
    ("bf16", _shapes(dtype=jnp.bfloat16), dict(return_lse=True), None),
    ("fp16", _shapes(dtype=jnp.float16), dict(deterministic=True), None),
    ("everything", _shapes(), dict(causal=True, window=(4, 4), softcap=5.0,
                                   scale=0.3, return_lse=True),
     (_ids((B, T)), _ids((B, S)))),
]


@pytest.mark.parametrize("specs,kw,segs", [c[1:] for c in VALID],
                         ids=[c[0] for c in VALID])
def test_default_dispatch_accepts_valid_input(specs, kw, segs):
  out = _call("eval_shape", specs, segs=segs, implementation=None, **kw)
  (q_shape, q_dtype), (k_shape, _), _ = specs
  o = out[0] if kw.get("return_lse") else out
  assert o.shape == q_shape and o.dtype == q_dtype
  if kw.get("return_lse"):
    assert out[1].shape == q_shape[:-3] + (q_shape[-2], q_shape[-3])
    assert out[1].dtype == jnp.float32


def test_default_dispatch_runs_on_cpu(rng):
  q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, S, HK, D)), jnp.float32)
  o = jax_flash.attention(q, k, k, causal=True)
  assert o.shape == q.shape and bool(jnp.isfinite(o).all())
  o2 = jax.jit(functools.partial(jax_flash.attention, causal=True,
                                 implementation="xla"))(q, k, k)
  np.testing.assert_allclose(np.asarray(o), np.asarray(o2), atol=1e-6)


def _qkv_concrete():
  return (jnp.zeros((B, T, H, D), jnp.float32),
          jnp.zeros((B, S, HK, D), jnp.float32),
          jnp.zeros((B, S, HK, D), jnp.float32))


@pytest.mark.parametrize("name", ["causal", "return_lse", "deterministic",
                                  "dropout_broadcast"])
@pytest.mark.parametrize("value, shown", [("yes", r"'yes' \(str\)"),
                                          (1.0, r"1\.0 \(float\)"),
                                          (1, r"1 \(int\)")])
def test_static_bool_options_need_a_bool(name, value, shown):
  with pytest.raises(TypeError, match=rf"{name} must be a Python bool, got "
                     rf"{shown}"):
    jax_flash.attention(*_qkv_concrete(), **{name: value})


def test_numpy_bool_is_accepted():
  o = jax_flash.attention(*_qkv_concrete(), causal=np.bool_(True))
  assert o.shape == (B, T, H, D)


def test_traced_causal_names_the_argument():
  q, k, v = _qkv_concrete()
  with pytest.raises(TypeError, match=r"causal must be a static Python bool, "
                     r"got a traced value; mark it static \(jax\.jit "
                     r"static_argnames\)"):
    jax.jit(lambda c: jax_flash.attention(q, k, v, causal=c))(True)


def test_other_entry_points_check_bools():
  q, k, v = _qkv_concrete()
  with pytest.raises(TypeError, match=r"causal must be a Python bool, got "
                     r"'yes' \(str\)"):
    jax_flash.fp8_attention(q, k, v, causal="yes")
  with pytest.raises(TypeError, match=r"return_lse must be a Python bool"):
    jax_flash.varlen_attention(
        q[0], k[0], v[0], jnp.array([0, T]), jnp.array([0, S]),
        max_seqlen_q=T, max_seqlen_k=S, return_lse="no")
  with pytest.raises(TypeError, match=r"is_causal must be a Python bool, got "
                     r"'yes' \(str\)"):
    jax_flash.dot_product_attention(q, k, v, is_causal="yes")
  with pytest.raises(TypeError, match=r"is_causal must be a static Python "
                     r"bool, got a traced value"):
    jax.jit(lambda c: jax_flash.dot_product_attention(q, k, v,
                                                      is_causal=c))(True)


def test_fp8_out_dtype_named():
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv_concrete())
  with pytest.raises(ValueError, match=r"out_dtype=float32 is not supported; "
                     r"use bfloat16 or float16"):
    jax_flash.fp8_attention(q, k, v, out_dtype=jnp.float32)


def test_concrete_kv_seq_lengths_out_of_range():
  with pytest.raises(ValueError, match=r"kv_seq_lengths out of range: "
                     rf"kv_seq_lengths\[1\]=40; valid values are 0\.\.{S} "
                     rf"\(key/value have {S} positions\)"):
    jax_flash.attention(*_qkv_concrete(), kv_seq_lengths=jnp.array([3, 40]))
  with pytest.raises(ValueError, match=r"kv_seq_lengths\[0\]=-1"):
    jax_flash.attention(*_qkv_concrete(), kv_seq_lengths=jnp.array([-1, 4]))
  # Traced lengths are clipped to [0, S], not checked.
  q, k, v = _qkv_concrete()
  o = jax.jit(lambda n: jax_flash.attention(q, k, v, kv_seq_lengths=n))(
      jnp.array([3, 40]))
  assert o.shape == q.shape



def test_dot_product_attention_lengths_past_the_end_match_jax_nn():
  # The drop-in clips lengths past the end as jax.nn does (no error).
  q, k, v = _qkv_concrete()
  got = jax_flash.dot_product_attention(
      q, k, v, key_value_seq_lengths=jnp.array([3, 40], jnp.int32))
  want = jax.nn.dot_product_attention(
      q, k, v, key_value_seq_lengths=jnp.array([3, 40], jnp.int32))
  np.testing.assert_allclose(got, want, atol=1e-6)


def test_make_attention_fn_checks_bools():
  pytest.importorskip("flax")
  import jax_flash.flax as jff
  with pytest.raises(TypeError, match=r"causal must be a Python bool, got "
                     r"'yes' \(str\)"):
    jff.make_attention_fn(causal="yes")


def test_head_dim_refusal_has_no_export_hint():
  # A head_dim no platform serves: the message says so, with no hint about
  # exporting for a GPU (a GPU would refuse it too).
  if jax.default_backend() == "gpu":
    pytest.skip("the export hint is for hosts without a GPU")
  q = jnp.ones((1, 8, 2, 16), jnp.float32)
  with pytest.raises(jax_flash.Unsupported) as info:
    jax_flash.attention(q, q, q, implementation="pallas")
  msg = str(info.value)
  assert "implementation='pallas' supports head_dim" in msg, msg
  assert "export" not in msg, msg


def test_platform_refusal_keeps_export_hint():
  if jax.default_backend() == "gpu":
    pytest.skip("the export hint is for hosts without a GPU")
  q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
  with pytest.raises(jax_flash.Unsupported) as info:
    jax_flash.attention(q, q, q, implementation="cuda")
  msg = str(info.value)
  assert "needs an NVIDIA GPU" in msg and "To export for a GPU" in msg, msg
