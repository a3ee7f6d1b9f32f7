"""`jax_flash.attention`: argument checks, canonicalisation, backend choice.

Everything here runs at trace time on shapes and Python values, so a bad call
raises a Python exception naming the argument before anything is compiled.
The `check_*` helpers are shared with `ring_attention` (ring.py).
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._src import backends, sharding
from jax_flash._src.spec import UNBOUNDED, AttentionSpec
from jax_flash._src.vjp import attention_fn

SUPPORTED_DTYPES = ("bfloat16", "float16", "float32", "float64")
MAX_HEAD_DIM = 256


def attention(query, key, value, *, causal: bool = False,
              scale: float | None = None,
              window: tuple[int, int] | None = None,
              softcap: float | None = None, segment_ids=None,
              return_lse: bool = False, implementation: str | None = None,
              deterministic: bool = False):
  """Exact attention softmax(scale * q k^T + mask) v, computed blockwise.

  Args:
    query: [..., T, H, D] (leading dims are batch dims; at least one of T,H,D).
    key, value: [..., S, H_kv, D] with the same leading dims; H % H_kv == 0
      (GQA/MQA).
    causal: mask keys after the query. With T != S queries are aligned to the
      end of the keys (bottom-right, as FlashAttention >= 2.1): query i may see
      keys j <= i + S - T. This is what decoding against a KV cache needs.
    scale: multiplier of q·k; default 1/sqrt(D).
    window: (left, right) sliding window around the aligned diagonal; -1 means
      unbounded on that side. Query i sees keys in
      [i + S - T - left, i + S - T + right]. Combined with `causal` (right=0).
    softcap: if set, scores become softcap * tanh(scores / softcap).
    segment_ids: (q_ids [..., T], kv_ids [..., S]) integer arrays, or one
      array [..., T] when T == S; attention only within equal ids (packing).
    return_lse: also return the natural-log logsumexp [..., H, T] (float32,
      float64 for float64 inputs; -inf for rows that see no key).
    implementation: "cuda", "pallas", "xla", or None for the best available.
    deterministic: ask the backward for a fixed accumulation order (bitwise
      reproducible gradients) where the backend has a choice.

  Returns:
    out [..., T, H, D] in query.dtype, or (out, lse) if return_lse. Rows that
    see no key give zeros.
  """
  q, k, v = query, key, value
  check_arrays(q, k, v)
  batch_shape = q.shape[:-3]
  T, H, D = q.shape[-3:]
  S, H_kv = k.shape[-3], k.shape[-2]
  spec = AttentionSpec(
      scale=check_scale(scale, D),
      causal=bool(causal),
      **window_fields(window, causal),
      softcap=check_softcap(softcap),
      has_segment_ids=segment_ids is not None,
      # math.prod, not np.prod: batch dims may be symbolic (jax.export).
      batch=math.prod(batch_shape),
      q_len=T, kv_len=S, num_heads=H, num_kv_heads=H_kv, head_dim=D,
      dtype=jnp.dtype(q.dtype).name,
      deterministic=bool(deterministic))
  segs = check_segment_ids(segment_ids, batch_shape, T, S)
  if implementation is not None and not isinstance(implementation, str):
    raise ValueError(f"implementation must be a string or None, got "
                     f"{implementation!r}")
  # One backend, or one per lowering platform (jax.export from a CPU host).
  branches = backends.choose_per_platform(spec, implementation, _platform(q))

  B = spec.batch
  fold = lambda x: x.reshape((B,) + x.shape[len(batch_shape):])
  args = [fold(q), fold(k), fold(v)]
  args += [s.reshape(B, -1).astype(jnp.int32) for s in segs]
  o, lse = backends.run(branches, lambda b: lambda *a: sharding.call(
      lambda s: attention_fn(b.name, s), spec, *a), *args)
  o = o.reshape(batch_shape + o.shape[1:])
  if not return_lse:
    return o
  return o, lse.reshape(batch_shape + lse.shape[1:])


def _platform(x) -> str:
  """Platform the computation will run on (the default backend under jit)."""
  try:
    devices = x.devices()  # concrete arrays
    return next(iter(devices)).platform
  except Exception:  # tracers and ShapeDtypeStructs
    return backends.default_platform()


def check_arrays(q, k, v):
  for name, x in (("query", q), ("key", k), ("value", v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim < 3:
      raise ValueError(
          f"{name} must have rank >= 3 ([..., seq, heads, head_dim], usually "
          f"[batch, seq, heads, head_dim]); got shape {x.shape}")
    dt = jnp.dtype(x.dtype).name
    if dt not in SUPPORTED_DTYPES:
      raise ValueError(f"{name} has dtype {dt}; supported dtypes: "
                       f"{', '.join(SUPPORTED_DTYPES)}")
  if not (q.ndim == k.ndim == v.ndim):
    raise ValueError(f"query, key and value must have the same rank; got "
                     f"{q.shape}, {k.shape}, {v.shape}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"query, key and value must have the same dtype; got "
                     f"{q.dtype}, {k.dtype}, {v.dtype}")
  if k.shape != v.shape:
    raise ValueError(f"key and value must have the same shape; got key "
                     f"{k.shape} and value {v.shape}")
  if q.shape[:-3] != k.shape[:-3]:
    raise ValueError(f"batch dims of query {q.shape[:-3]} and key/value "
                     f"{k.shape[:-3]} differ")
  D, Dk = q.shape[-1], k.shape[-1]
  if D != Dk:
    raise ValueError(f"head_dim of query ({D}) and key/value ({Dk}) differ")
  if not 1 <= D <= MAX_HEAD_DIM:
    raise ValueError(f"head_dim {D} is out of range; supported: 1..."
                     f"{MAX_HEAD_DIM}")
  H, H_kv = q.shape[-2], k.shape[-2]
  if H_kv == 0 or H % H_kv:
    raise ValueError(f"query heads ({H}) must be a multiple of key/value "
                     f"heads ({H_kv}) (GQA/MQA)")
  if q.shape[-3] == 0 or k.shape[-3] == 0:
    raise ValueError(f"sequence lengths must be >= 1; got query seq "
                     f"{q.shape[-3]}, key seq {k.shape[-3]}")


def check_scale(scale, D) -> float:
  if scale is None:
    return 1.0 / math.sqrt(D)
  if isinstance(scale, jax.core.Tracer) or not isinstance(
      scale, numbers.Real) or not math.isfinite(float(scale)):
    raise ValueError(f"scale must be a finite Python float (a static value), "
                     f"got {scale!r}")
  return float(scale)


def check_softcap(softcap):
  if softcap is None:
    return None
  if isinstance(softcap, jax.core.Tracer) or not isinstance(
      softcap, numbers.Real) or not (float(softcap) > 0 and
                                     math.isfinite(float(softcap))):
    raise ValueError(f"softcap must be None or a positive finite float, got "
                     f"{softcap!r}")
  return float(softcap)


def window_fields(window, causal) -> dict:
  """window_left/right of AttentionSpec, with causal folded into the right."""
  left = right = UNBOUNDED
  if window is not None:
    ok = (isinstance(window, (tuple, list)) and len(window) == 2 and
          all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
              for w in window))
    if not ok or any(int(w) < -1 for w in window):
      raise ValueError(
          f"window must be None or a pair (left, right) of ints >= -1 (-1 = "
          f"unbounded), got {window!r}")
    left, right = int(window[0]), int(window[1])
  if causal:
    right = 0 if right == UNBOUNDED else min(right, 0)
  return dict(window_left=left, window_right=right)


def check_segment_ids(segment_ids, batch_shape, T, S):
  if segment_ids is None:
    return ()
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError("segment_ids must be (q_segment_ids, kv_segment_ids) "
                       f"or one array when T == S; got {len(segment_ids)} "
                       "items")
    q_ids, kv_ids = segment_ids
  else:
    if T != S:
      raise ValueError(
          f"a single segment_ids array needs T == S (got T={T}, S={S}); pass "
          "(q_segment_ids, kv_segment_ids)")
    q_ids = kv_ids = segment_ids
  for name, ids, n in (("q_segment_ids", q_ids, T), ("kv_segment_ids", kv_ids,
                                                      S)):
    if not hasattr(ids, "shape") or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array, got "
                       f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if tuple(ids.shape) != tuple(batch_shape) + (n,):
      raise ValueError(f"{name} must have shape {tuple(batch_shape) + (n,)} "
                       f"(batch dims + seq), got {tuple(ids.shape)}")
  return (q_ids, kv_ids)
