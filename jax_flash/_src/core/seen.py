"""Which keys some query sees, and which query rows see some key: per token,
over a whole call.

The blockwise backends decide visibility tile by tile (masking.py). A pass
that transforms whole tensors first (FP8 quantisation: one scale per block of
keys, per channel over the sequence) needs it per token over the whole call,
so that inputs no query may see (they may hold anything, NaN included) enter
none of its results.

Row i sees key j when their ids are equal and j lies in the row's band
[d_i - left, d_i + right], d_i = i + kv_offset (+ the row's shift), as
`masking.visible` says; equivalently i lies in [j - kv_offset - right,
j - kv_offset + left] (- the key's shift: a row and a key of one sequence
share their shift). Each side is then the question "does the other side hold
my id at an index inside my interval", answered for every token at once by
one sort of both sides by (id, index): O((T + S) log(T + S)) per batch row,
exact for any arrangement of ids, no T x S matrix.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_flash._src.core import masking
from jax_flash._src.core.spec import UNBOUNDED, AttentionSpec


def all_seen(spec: AttentionSpec) -> bool:
  """Whether, by position alone, every key is seen by some row and every row
  sees some key (trace time; segment ids may still hide tokens)."""
  if spec.has_shifts or spec.q_len == 0 or spec.kv_len == 0:
    return False
  left, right = masking.window_bounds(spec)
  off, T, S = spec.kv_offset, spec.q_len, spec.kv_len
  # Rows' bands move right by one per row: their union is one interval, and
  # a row's band is never empty by itself.
  keys = off - left <= 0 and T - 1 + off + right >= S - 1
  rows = off + right >= 0 and T - 1 + off - left <= S - 1
  return keys and rows


def _interval(n: int, lo_side: int, hi_side: int, center):
  """[center - lo_side, center + hi_side] (UNBOUNDED sides: the whole
  [0, n)) as int32 arrays shaped like center."""
  lo = (jnp.zeros_like(center) if lo_side == UNBOUNDED else
        center - lo_side)
  hi = (jnp.full_like(center, n - 1) if hi_side == UNBOUNDED else
        center + hi_side)
  return lo, hi


def _meets(ids, lo, hi, other_ids):
  """[B, N] bool: whether other_ids [B, M] holds ids[b, t] at an index in
  [lo[b, t], hi[b, t]] (any int32 values; an empty interval meets nothing).

  Both sides sorted together by (id, index), asking tokens (index = their
  lo) before the others at equal keys: an asking token's first other token
  after it in that order is the smallest index >= lo holding its id, if it
  holds the id at all."""
  B, N = ids.shape
  M = other_ids.shape[1]
  if M == 0 or N == 0:
    return jnp.zeros((B, N), bool)
  L = N + M
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  ids_all = jnp.concatenate([i32(ids), i32(other_ids)], 1)
  index = jnp.concatenate(
      [i32(lo), jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B, M))], 1)
  is_other = jnp.concatenate([jnp.zeros((B, N), jnp.int32),
                              jnp.ones((B, M), jnp.int32)], 1)
  hi_all = jnp.concatenate([i32(hi), jnp.zeros((B, M), jnp.int32)], 1)
  origin = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
  ids_all, index, is_other, hi_all, origin = lax.sort(
      (ids_all, index, is_other, hi_all, origin), dimension=1, num_keys=3)
  slot = jnp.arange(L, dtype=jnp.int32)[None, :]
  nxt = lax.cummin(jnp.where(is_other == 1, slot, L), axis=1, reverse=True)
  cand = jnp.minimum(nxt, L - 1)
  hit = ((is_other == 0) & (nxt < L) &
         (jnp.take_along_axis(ids_all, cand, 1) == ids_all) &
         (jnp.take_along_axis(index, cand, 1) <= hi_all))
  # Back to the tokens' own order (origin's inverse permutation).
  _, hit = lax.sort((origin, hit.astype(jnp.int32)), dimension=1, num_keys=1)
  return hit[:, :N] > 0


def keys_seen(spec: AttentionSpec, q_seg=None, kv_seg=None, shifts=None):
  """[B, S] bool (or [1, S] without segment ids): whether some query row
  sees key j. q_seg [B, T], kv_seg [B, S] int32 with spec.has_segment_ids;
  shifts (q_shift, kv_shift) with spec.has_shifts."""
  T, S = spec.q_len, spec.kv_len
  j = jnp.arange(S, dtype=jnp.int32)[None, :] - spec.kv_offset
  if shifts is not None:
    j = j - shifts[1]
  lo, hi = _interval(T, spec.window_right, spec.window_left, j)
  if kv_seg is None:
    return (jnp.maximum(lo, 0) <= jnp.minimum(hi, T - 1)) & (T > 0)
  lo, hi = (jnp.broadcast_to(x, kv_seg.shape) for x in (lo, hi))
  return _meets(kv_seg, lo, hi, q_seg)


def rows_seeing(spec: AttentionSpec, q_seg=None, kv_seg=None, shifts=None):
  """[B, T] bool (or [1, T]): whether query row i sees some key; arguments
  as `keys_seen`."""
  T, S = spec.q_len, spec.kv_len
  d = jnp.arange(T, dtype=jnp.int32)[None, :] + spec.kv_offset
  if shifts is not None:
    d = d + shifts[0]
  lo, hi = _interval(S, spec.window_left, spec.window_right, d)
  if q_seg is None:
    return (jnp.maximum(lo, 0) <= jnp.minimum(hi, S - 1)) & (S > 0)
  lo, hi = (jnp.broadcast_to(x, q_seg.shape) for x in (lo, hi))
  return _meets(q_seg, lo, hi, kv_seg)


def _sees_itself(spec: AttentionSpec) -> bool:
  """Whether token t, as a row, sees itself as a key whenever its q and kv
  ids agree, and sees nothing (and is seen by nothing) otherwise: aligned
  segment ids (spec.segments_aligned) on a band that holds the diagonal.
  Then the visibility is an elementwise test, not `_meets`' sorts."""
  if not (spec.segments_aligned and spec.has_segment_ids) or spec.has_shifts:
    return False
  left, right = masking.window_bounds(spec)
  return (spec.q_len == spec.kv_len and spec.kv_offset == 0 and left >= 0
          and right >= 0)


def zero_unseen(spec: AttentionSpec, q, k, v, q_seg=None, kv_seg=None,
                shifts=None):
  """(q, k, v) [B, T|S, H, D] with the keys/values that no query row sees and
  the query rows that see no key set to 0, so that whatever they hold (stale
  cache slots, uninitialised padding, NaN) enters no product of a pass over
  whole tensors or whole tiles. An argument given as None is returned as
  None. Returns the inputs themselves when every token is seen by position
  and there are no segment ids (the pass is then skipped)."""
  if all_seen(spec) and not spec.has_segment_ids:
    return q, k, v
  if not spec.has_segment_ids:
    q_seg = kv_seg = None
  if _sees_itself(spec):
    rows = keys = q_seg == kv_seg
  else:  # each side's test only where that side is asked for
    rows = None if q is None else rows_seeing(spec, q_seg, kv_seg, shifts)
    keys = (None if k is None and v is None else
            keys_seen(spec, q_seg, kv_seg, shifts))
  zero = lambda x, ok: None if x is None else jnp.where(
      ok[:, :, None, None], x, jnp.zeros((), x.dtype))
  return zero(q, rows), zero(k, keys), zero(v, keys)
