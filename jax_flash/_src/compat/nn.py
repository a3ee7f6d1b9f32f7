"""`jax_flash.dot_product_attention`: jax.nn.dot_product_attention, flash-served.

Same signature and values as `jax.nn.dot_product_attention` (jax 0.11.2 and
0.12, whose signatures agree).
A request the blockwise machinery can express (causal and local windows,
top-left aligned as jax.nn aligns them; key/value padding from
`key_value_seq_lengths` as segment ids; query padding zeroed afterwards) runs
on a jax_flash backend; the rest (a dense `bias` or `mask` array, a traced
`scale`, ...) runs on nn_dense.py's query-chunked XLA computation.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._src.backends import registry as backends
from jax_flash._src.core import checks
from jax_flash._src.core import masking
from jax_flash._src.compat import nn_dense
from jax_flash._src.sharding import partition as sharding
from jax_flash._src.api.attention import _platform, per_batch_sinks
from jax_flash._src.backends.registry import Unsupported
from jax_flash._src.core.spec import UNBOUNDED, AttentionSpec
from jax_flash._src.autodiff.differentiable import attention_fn

# jax.nn's implementation names (and jax_flash's own) -> jax_flash backend.
# "cudnn" asks for jax.nn's fused GPU kernel; jax_flash's is "cuda".
IMPLEMENTATIONS = {None: None, "xla": "xla", "cudnn": "cuda", "cuda": "cuda",
                   "pallas": "pallas"}
# Backends that only run the blockwise form (no dense bias/mask fallback).
FUSED_ONLY = ("cuda", "pallas")
# What jax_flash's blockwise backends take (jax_flash.attention's limits).
BLOCKWISE_DTYPES = ("bfloat16", "float16", "float32", "float64")
BLOCKWISE_MAX_HEAD_DIM = 256


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          scale: float | None = None, is_causal: bool = False,
                          query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None,
                          implementation: str | None = None,
                          return_residual: bool = False, sinks=None):
  """Drop-in for `jax.nn.dot_product_attention`: same arguments, same values.

  softmax(scale * q k^T + bias, masked) v per head, with jax.nn's meaning of
  every argument:

  Args:
    query: [B, T, N, H] or [T, N, H]; array-likes are converted.
    key, value: [B, S, K, H] or [S, K, H]; N % K == 0 (GQA/MQA). value's
      head dim may differ from H (jax_flash's addition; the output has it).
    bias: optional additive logits bias, broadcastable to [B, N, T, S]
      (fewer dims get leading 1s, as in jax.nn). Differentiable.
    mask: optional boolean array broadcastable to [B, N, T, S]; True = attend.
    scale: logits multiplier; default 1/sqrt(H).
    is_causal: query i sees keys j <= i, aligned TOP-LEFT when T != S (as
      jax.nn; jax_flash.attention(causal=True) aligns bottom-right).
    query_seq_lengths: int [B]; query rows t >= length are padding and give
      zeros.
    key_value_seq_lengths: int [B]; keys s >= length are not attended.
    local_window_size: (left, right) or an int w for (w, w): query i sees
      keys j with i - left <= j <= i + right (top-left aligned).
    implementation: None (best available: on GPU the cuda, then pallas, then
      xla backend; elsewhere xla), "xla" (jax_flash's blockwise XLA backend),
      "cudnn" (jax.nn's fused-GPU name: jax_flash's "cuda" kernels), or
      jax_flash's names "cuda", "pallas". Explicit "cuda"/"cudnn"/"pallas"
      raise jax_flash.Unsupported for what those backends cannot serve (a
      dense bias or mask, among others) instead of falling back.
    return_residual: also return the logsumexp of the masked logits, [B, T, N]
      (or [T, N]) in key.dtype, not differentiated (as jax.nn).
    sinks: jax_flash's addition to jax.nn's arguments: learnable attention
      sinks [N], one logit per query head, in every row's softmax
      denominator with no value (as `jax_flash.attention`; the residual
      includes them). A row that sees no key then gives zeros.

  Which path serves a call: without `bias` and `mask` (and with a static
  scale, head_dim <= 256, windows whose band contains the diagonal) a
  jax_flash backend runs it blockwise in O(seq) memory; sequence lengths
  become segment ids (key padding) and a zeroing of the padded query rows.
  A dense `bias` or `mask` (or any other request outside that) runs jax.nn's
  math on query-row chunks in XLA (nn_dense.py): the logits of one chunk of
  rows at a time, rematerialised in the backward; only with
  implementation None or "xla".

  Values match jax.nn also where it is unusual: a row that sees no key
  averages `value` over all S keys (jax.nn masks with a large finite negative
  number, not -inf), and its residual is that large negative number. The
  sequence-length arrays may have any integer dtype (jax.nn requires int32).

  Returns:
    The output, shaped like query (and the residual if return_residual).
  """
  q = jnp.asarray(query)
  output_shape = q.shape[:-1] + np.shape(value)[-1:]  # value's head dim
  q, k, v = (_ensure_4d(x) for x in (q, key, value))
  bias = None if bias is None else _ensure_4d(bias)
  mask = None if mask is None else _ensure_4d(mask)
  _check_arrays(q, k, v, bias, mask)
  B, T, N, H = q.shape
  S = k.shape[1]
  # Lengths past the end are not refused: jax.nn clips them, and the
  # drop-in matches it (attention(kv_seq_lengths=) checks concrete ones).
  q_len = _lengths(query_seq_lengths, "query_seq_lengths", B)
  kv_len = _lengths(key_value_seq_lengths, "key_value_seq_lengths", B)
  window = _window(local_window_size)
  sinks = checks.check_sinks(sinks, N, q.dtype)
  is_causal = _static_bool(is_causal, "is_causal")
  return_residual = _static_bool(return_residual, "return_residual")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation={implementation!r} is not supported; jax.nn's names: "
        f"None, 'xla', 'cudnn' (= jax_flash's 'cuda'); jax_flash's: "
        f"{', '.join(repr(n) for n in backends.names())}")
  name = IMPLEMENTATIONS[implementation]
  scale = 1.0 / math.sqrt(H) if scale is None else scale

  reason = _not_blockwise(q, v, bias, mask, scale, window)
  backend = None
  if reason is None:
    spec = _spec(q, k, v, scale, is_causal, window, kv_len is not None,
                 sinks is not None)
    try:
      backend = backends.choose(spec, name, _platform(q))
    except Unsupported as e:
      if name in FUSED_ONLY:
        if name == implementation:
          raise
        # The message names the backend ('cuda'); say which name the user
        # passed and what it stands for.
        raise Unsupported(
            f"implementation={implementation!r} maps to jax_flash's CUDA "
            f"kernels (implementation={name!r}), which cannot serve this "
            f"request: {e}. implementation=None (best available) or 'xla' "
            f"run it on any platform") from None
      reason = str(e)
  if reason is not None and name in FUSED_ONLY:
    raise Unsupported(
        f"implementation={implementation!r} cannot serve {reason}; "
        f"implementation=None or 'xla' runs it on the dense XLA path")

  if backend is None or 0 in (B, T, S):  # (empty inputs: nothing to compute)
    out, lse = nn_dense.attention(
        q, k, v, bias, mask, scale=scale, is_causal=is_causal, window=window,
        q_len=q_len, kv_len=kv_len, return_residual=return_residual,
        sinks=sinks)
  else:
    out, lse = _blockwise(backend.name, spec, q, k, v, q_len, kv_len, window,
                          sinks)
  out = out.reshape(output_shape)
  if not return_residual:
    return out
  lse = jax.lax.stop_gradient(jnp.swapaxes(lse, 1, 2).astype(k.dtype))
  return out, lse.reshape(output_shape[:-1])


def _blockwise(backend_name, spec, q, k, v, q_len, kv_len, window, sinks):
  """jax.nn's values from a jax_flash backend; lse [B, N, T] in jax.nn's
  convention (large negative number for rows that see no key; with sinks
  such a row has the sink's)."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  segs = ()
  if kv_len is not None:  # padded keys get an id that no query has
    kv_seg = (jnp.arange(S)[None, :] >= kv_len[:, None]).astype(jnp.int32)
    segs = (jnp.zeros((B, T), jnp.int32), kv_seg)
  local = masking.simplify(spec)
  if local is None:  # no (query, key) pair is visible by position
    o = jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)
    lse = jnp.full((B, N, T), -jnp.inf, jnp.float32)
    if sinks is not None:
      lse = jnp.broadcast_to(sinks[None, :, None], (B, N, T))
  else:
    o, lse = sharding.call(lambda s: attention_fn(backend_name, s), local, q,
                           k, v, *per_batch_sinks(sinks, B), *segs)
  empty = jnp.isneginf(lse)  # [B, N, T]
  if kv_len is not None or _rows_may_be_empty(T, S, window):
    # jax.nn gives every key the same (large negative) logit in such a row.
    acc = nn_dense.logits_dtype(v.dtype)
    mean_v = jnp.mean(v.astype(acc), axis=1).astype(v.dtype)  # [B, K, H]
    mean_v = jnp.repeat(mean_v, N // K, axis=1)[:, None]
    o = jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], mean_v, o)
  if q_len is not None:
    q_ok = jnp.arange(T)[None, :] < q_len[:, None]  # [B, T]
    o = jnp.where(q_ok[:, :, None, None], o, jnp.zeros((), o.dtype))
    empty = empty | ~q_ok[:, None, :]
  neg = nn_dense.large_negative(nn_dense.logits_dtype(q.dtype))
  return o, jnp.where(empty, neg, lse)


def _rows_may_be_empty(T, S, window) -> bool:
  # Top-left: row i sees key min(i, S - 1) unless the left side cuts it off.
  return window is not None and T - 1 > S - 1 + window[0]


def _spec(q, k, v, scale, is_causal, window, has_segment_ids,
          has_sinks) -> AttentionSpec:
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  left = right = UNBOUNDED
  if window is not None:
    left, right = window
  if is_causal:
    right = 0 if right == UNBOUNDED else min(right, 0)
  # Sides no row reaches past are unbounded (keeps the ints small).
  left = UNBOUNDED if left >= T else left
  right = UNBOUNDED if right >= S else right
  bounded = (left, right) != (UNBOUNDED, UNBOUNDED)
  return AttentionSpec(
      scale=float(scale), causal=right == 0, window_left=left,
      window_right=right, has_segment_ids=has_segment_ids, batch=B, q_len=T,
      kv_len=S, num_heads=N, num_kv_heads=K, head_dim=H,
      value_head_dim=AttentionSpec.value_head_dim_of(H, v.shape[-1]),
      dtype=jnp.dtype(q.dtype).name, q_offset=0 if bounded else None,
      has_sinks=has_sinks)


def _not_blockwise(q, v, bias, mask, scale, window) -> str | None:
  """Why the blockwise backends cannot express the request (None if they can)."""
  if bias is not None:
    return "a dense bias array"
  if mask is not None:
    return "a dense boolean mask array"
  if isinstance(scale, jax.core.Tracer) or not _is_real(scale):
    return f"scale={scale!r} (the blockwise backends need a static float)"
  if not math.isfinite(float(scale)):
    return f"scale={scale!r}"
  dt = jnp.dtype(q.dtype).name
  if dt not in BLOCKWISE_DTYPES:
    return f"dtype {dt} (supported: {', '.join(BLOCKWISE_DTYPES)})"
  if q.shape[-1] > BLOCKWISE_MAX_HEAD_DIM:
    return f"head_dim {q.shape[-1]} (> {BLOCKWISE_MAX_HEAD_DIM})"
  if v.shape[-1] > BLOCKWISE_MAX_HEAD_DIM:
    return f"value head_dim {v.shape[-1]} (> {BLOCKWISE_MAX_HEAD_DIM})"
  if window is not None and min(window) < 0:
    return (f"local_window_size={window} (a negative side leaves the diagonal "
            "out of the band)")
  return None


def _is_real(x) -> bool:
  if isinstance(x, numbers.Real):
    return True
  return isinstance(x, (np.ndarray, jax.Array)) and x.shape == () and (
      jnp.issubdtype(x.dtype, jnp.floating) or
      jnp.issubdtype(x.dtype, jnp.integer))


def _ensure_4d(x):
  """jax.nn's rule: fewer than 4 dims get leading size-1 dims."""
  x = jnp.asarray(x)
  return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def _check_arrays(q, k, v, bias, mask):
  for name, x in (("query", q), ("key", k), ("value", v)):
    if x.ndim != 4:
      raise ValueError(
          f"{name} must have rank 3 or 4 ([T, N, H] or [B, T, N, H], as in "
          f"jax.nn.dot_product_attention); got shape {x.shape}. "
          "jax_flash.attention takes any number of leading batch dims")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating-point array; got dtype "
                       f"{x.dtype}")
  B, S, K, H = k.shape
  if v.shape[:-1] != k.shape[:-1] or v.dtype != k.dtype:
    raise ValueError(f"value must have key's shape (but for its head dim, "
                     f"which may differ) and dtype {k.shape} {k.dtype}; got "
                     f"{v.shape} {v.dtype}")
  if q.dtype != k.dtype:
    raise ValueError(f"query dtype should be {k.dtype} (key's), but got "
                     f"{q.dtype}")
  if q.shape[0] != B or q.shape[3] != H:
    raise ValueError(f"query shape should be [B={B}, T, N, H={H}] to match "
                     f"key {k.shape}; got {q.shape}")
  N, T = q.shape[2], q.shape[1]
  if K == 0 or N % K:
    raise ValueError(f"The number of query heads must be a multiple of "
                     f"key/value heads, but got {N} vs {K}")
  full = (B, N, T, S)
  for name, x in (("bias", bias), ("mask", mask)):
    if x is None:
      continue
    if x.ndim != 4 or any(d not in (1, f) for d, f in zip(x.shape, full)):
      raise ValueError(f"{name} must be broadcastable to [B, N, T, S] = "
                       f"{list(full)} (each dim 1 or full); got shape "
                       f"{x.shape}")
  if mask is not None and mask.dtype != np.dtype(bool):
    raise ValueError(f"mask must be a boolean array (True = attend; pass an "
                     f"additive mask as bias); got dtype {mask.dtype}")


def _lengths(x, name, B):
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.shape != (B,) or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array of shape (B,) = "
                     f"({B},); got shape {x.shape}, dtype {x.dtype}")
  return x.astype(jnp.int32)


def _window(w):
  if w is None:
    return None
  if isinstance(w, numbers.Integral):
    return (int(w), int(w))
  if (isinstance(w, (tuple, list)) and len(w) == 2 and
      all(isinstance(x, numbers.Integral) for x in w)):
    return (int(w[0]), int(w[1]))
  raise ValueError(f"local_window_size must be None, an int or a pair "
                   f"(left, right) of ints; got {w!r}")


def _static_bool(x, name) -> bool:
  return checks.static_bool(x, name)
