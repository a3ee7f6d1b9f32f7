"""Serve any query/key alignment with a kernel that only knows bottom-right.

The CUDA kernels take the public API's alignment (query row i sits at key
position i + S - T) and windows >= 0. Ring attention asks for blocks whose
alignment is some other offset (`AttentionSpec.q_offset`). Such a block is
the same attention as a bottom-right one on a prefix of the queries and a
prefix of the keys (`masking.bottom_right_view`), so the kernel runs on the
prefixes and the rest is filled with what it would have been: rows that see
no key (o = 0, lse = -inf, dq = 0) and keys no row sees (dk = dv = 0).
Slicing costs a copy of the prefixes, no extra attention FLOPs.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_flash._src.core import masking

NEG_INF = float("-inf")


def _prefix(x, n: int, axis: int = 1):
  """The first n entries of x along `axis` (None stays None)."""
  if x is None or x.shape[axis] == n:
    return x
  return x[(slice(None),) * axis + (slice(0, n),)]


def _pad_to(x, n: int, axis: int = 1, value=0.0):
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def forward(kernel, spec, q, k, v, q_seg, kv_seg, shifts=None):
  """`kernel(spec, q, k, v, q_seg, kv_seg, shifts) -> (o, lse)` for any
  alignment (shifts: only with the bottom-right one)."""
  if spec.bottom_right:
    return kernel(spec, q, k, v, q_seg, kv_seg, shifts)
  assert shifts is None, "diagonal shifts come only with the API's alignment"
  B, T, H, _ = q.shape
  view = masking.bottom_right_view(spec)
  if view is None:  # nothing visible (callers normally skip such blocks)
    return (jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype),
            jnp.full((B, H, T), NEG_INF, jnp.float32))
  Tp, Sp = view.q_len, view.kv_len
  o, lse = kernel(view, _prefix(q, Tp), _prefix(k, Sp), _prefix(v, Sp),
                  _prefix(q_seg, Tp), _prefix(kv_seg, Sp))
  return _pad_to(o, T), _pad_to(lse, T, axis=2, value=NEG_INF)


def backward(kernel, spec, q, k, v, o, lse, do, delta, q_seg, kv_seg,
             shifts=None):
  """`kernel(spec, q, k, v, o, lse, do, delta, q_seg, kv_seg, shifts) ->
  (dq, dk, dv)` for any alignment (shifts as in `forward`)."""
  if spec.bottom_right:
    return kernel(spec, q, k, v, o, lse, do, delta, q_seg, kv_seg, shifts)
  assert shifts is None, "diagonal shifts come only with the API's alignment"
  T, S = q.shape[1], k.shape[1]
  view = masking.bottom_right_view(spec)
  if view is None:
    return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
  Tp, Sp = view.q_len, view.kv_len
  rows = lambda x, axis=1: _prefix(x, Tp, axis)
  dq, dk, dv = kernel(view, rows(q), _prefix(k, Sp), _prefix(v, Sp), rows(o),
                      rows(lse, 2), rows(do), rows(delta, 2), rows(q_seg),
                      _prefix(kv_seg, Sp))
  return _pad_to(dq, T), _pad_to(dk, S), _pad_to(dv, S)
