"""Argument checks shared by `jax_flash.attention` and `ring_attention`.

Everything here runs at trace time on shapes and Python values, so a bad call
raises a Python exception naming the argument before anything is compiled.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._src.core.spec import UNBOUNDED

SUPPORTED_DTYPES = ("bfloat16", "float16", "float32", "float64")
MAX_HEAD_DIM = 256
DROPOUT_STEPS = 256  # dropout rates are realised in steps of 1/256


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
  if k.shape[:-1] != v.shape[:-1]:
    raise ValueError(f"key and value must have the same shape but for the "
                     f"head dim (value's may differ); got key {k.shape} and "
                     f"value {v.shape}")
  if q.shape[:-3] != k.shape[:-3]:
    raise ValueError(f"batch dims of query {q.shape[:-3]} and key/value "
                     f"{k.shape[:-3]} differ")
  D, Dk = q.shape[-1], k.shape[-1]
  if D != Dk:
    raise ValueError(f"head_dim of query ({D}) and key/value ({Dk}) differ")
  if not 1 <= D <= MAX_HEAD_DIM:
    raise ValueError(f"head_dim {D} is out of range; supported: 1..."
                     f"{MAX_HEAD_DIM}")
  Dv = v.shape[-1]
  if not 1 <= Dv <= MAX_HEAD_DIM:
    raise ValueError(f"value head_dim {Dv} is out of range; supported: 1..."
                     f"{MAX_HEAD_DIM}")
  H, H_kv = q.shape[-2], k.shape[-2]
  if (H % H_kv if H_kv else H):  # H = 0 (empty) is a multiple of any H_kv
    raise ValueError(f"query heads ({H}) must be a multiple of key/value "
                     f"heads ({H_kv}) (GQA/MQA)")
  if q.shape[-3] == 0 or k.shape[-3] == 0:
    raise ValueError(f"sequence lengths must be >= 1; got query seq "
                     f"{q.shape[-3]}, key seq {k.shape[-3]}")


def check_sinks(sinks, num_heads: int, dtype):
  """The learnable sink logits [H] in the accumulation dtype (float32,
  float64 for float64 inputs), or None. A float array, one logit per query
  head; traced values are fine (they are differentiable)."""
  if sinks is None:
    return None
  if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
    raise ValueError(f"sinks must be a float array [H] (one logit per query "
                     f"head), got {type(sinks).__name__}")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise ValueError(f"sinks must have a floating dtype, got {sinks.dtype}")
  if tuple(sinks.shape) != (num_heads,):
    raise ValueError(f"sinks must have shape [H] = ({num_heads},) (one logit "
                     f"per query head), got {tuple(sinks.shape)}")
  acc = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
  return sinks.astype(acc)


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


def check_dropout(dropout_rate, dropout_rng) -> float:
  """The static dropout rate (0.0 = none); a rate > 0 needs a key."""
  if isinstance(dropout_rate, jax.core.Tracer) or isinstance(
      dropout_rate, bool) or not isinstance(dropout_rate, numbers.Real):
    raise ValueError(f"dropout_rate must be a Python float in [0, 1) (a "
                     f"static value), got {dropout_rate!r}")
  rate = float(dropout_rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
  if rate > 0.0 and dropout_rng is None:
    raise ValueError(f"dropout_rate={rate} needs dropout_rng (a jax.random "
                     f"key); pass dropout_rate=0.0 for no dropout")
  if rate == 0.0 and dropout_rng is not None:
    raise ValueError("dropout_rng was given with dropout_rate=0.0, which "
                     "applies no dropout; pass a dropout_rate > 0 or drop "
                     "dropout_rng")
  # core/dropout.threshold: round(rate * 256), so rates up to 1/512 are 0.
  if rate > 0.0 and round(rate * DROPOUT_STEPS) == 0:
    raise ValueError(
        f"dropout_rate={rate} would apply no dropout: rates round to the "
        f"nearest 1/{DROPOUT_STEPS} and the smallest nonzero rate is "
        f"1/{DROPOUT_STEPS} = {1 / DROPOUT_STEPS}; pass 0.0 or a rate above "
        f"1/{2 * DROPOUT_STEPS}")
  return rate


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


def static_bool(x, name) -> bool:
  """A static boolean option: a Python or numpy bool (an int or a string is
  a likely slip, a tracer cannot choose a kernel)."""
  if isinstance(x, jax.core.Tracer):
    raise TypeError(f"{name} must be a static Python bool, got a traced "
                    f"value; mark it static (jax.jit static_argnames)")
  if not isinstance(x, (bool, np.bool_)):
    raise TypeError(f"{name} must be a Python bool, got {x!r} "
                    f"({type(x).__name__})")
  return bool(x)


def concrete(x):
  """x as a numpy int64 array when its values are known at trace time, else
  None (a tracer: the values are checked only where they are known)."""
  if isinstance(x, jax.core.Tracer):
    return None
  try:
    return np.asarray(x).astype(np.int64)
  except Exception:  # values not available (e.g. an abstract array)
    return None


def check_index_range(name, x, lo, hi, what):
  """Concrete integer values of `x` must lie in [lo, hi]; `what` says what
  the bound is. Traced values pass unchecked."""
  c = concrete(x)
  if c is None or c.size == 0:
    return
  bad = (c < lo) | (c > hi)
  if bad.any():
    idx = [tuple(int(i) for i in ix) for ix in np.argwhere(bad)[:4]]
    vals = [int(c[ix]) for ix in idx]
    where = ", ".join(f"{name}{list(ix)}={v}" for ix, v in zip(idx, vals))
    raise ValueError(f"{name} out of range: {where}; valid values are "
                     f"{lo}..{hi} ({what})")
