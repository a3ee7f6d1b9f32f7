"""Which (query, key) pairs may attend: written once, used by every JAX backend.

The functions work on jnp values, so the XLA backend and the Pallas kernels
(traced or interpreted) share them. Positions are absolute row/column indices
into the unpadded sequences; indices past the real length (padding) are masked.
The alignment of query rows to keys is `spec.kv_offset` (bottom-right unless
`spec.q_offset` says otherwise), so every function here serves blocks of a
longer sequence too. The last section answers whole-block questions on
Python ints at trace time (ring attention's step plan, the cuda backend).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_flash._src.core.spec import UNBOUNDED, AttentionSpec


def visible(spec: AttentionSpec, q_pos, k_pos, q_seg=None, k_seg=None,
            q_shift=None):
  """Boolean mask, broadcasting q_pos [..., bq, 1] against k_pos [..., 1, bk].

  q_shift (like q_seg, with spec.has_shifts): the rows' diagonal shifts.
  """
  ok = (q_pos < spec.q_len) & (k_pos < spec.kv_len)
  diag = q_pos + spec.kv_offset  # the key aligned with this query (bottom-right)
  if q_shift is not None:
    diag = diag + q_shift
  if spec.window_left != UNBOUNDED:
    ok = ok & (k_pos >= diag - spec.window_left)
  if spec.window_right != UNBOUNDED:
    ok = ok & (k_pos <= diag + spec.window_right)
  if q_seg is not None:
    ok = ok & (q_seg == k_seg)
  return ok


def kv_block_range(spec: AttentionSpec, q_start, block_q: int, block_k: int,
                   num_kv_blocks: int):
  """[first, last) KV block indices that can hold a visible key for the q block.

  Blocks outside the range are skipped entirely (causal/window sparsity). The
  result may still contain partially masked blocks; the mask handles those.
  Works on Python ints and traced int32 scalars alike. With diagonal shifts
  positions say nothing by themselves (the tile spans bound such calls).
  """
  first = 0
  last = num_kv_blocks
  if spec.has_shifts:
    return first, last
  q_last = jnp.minimum(q_start + block_q, spec.q_len) - 1
  if spec.window_right != UNBOUNDED:
    hi = q_last + spec.kv_offset + spec.window_right  # last visible key
    last = jnp.clip(hi // block_k + 1, 0, num_kv_blocks)
  if spec.window_left != UNBOUNDED:
    lo = q_start + spec.kv_offset - spec.window_left  # first visible key
    first = jnp.clip(lo // block_k, 0, num_kv_blocks)
  return first, jnp.maximum(last, first)


def q_block_range(spec: AttentionSpec, k_start, block_k: int, block_q: int,
                  num_q_blocks: int):
  """[first, last) query block indices that can see a key of this KV block."""
  first = 0
  last = num_q_blocks
  if spec.has_shifts:
    return first, last
  k_last = jnp.minimum(k_start + block_k, spec.kv_len) - 1
  if spec.window_right != UNBOUNDED:
    # query i sees key j only if i >= j - offset - right
    lo = k_start - spec.kv_offset - spec.window_right
    first = jnp.clip(lo // block_q, 0, num_q_blocks)
  if spec.window_left != UNBOUNDED:
    hi = k_last - spec.kv_offset + spec.window_left
    last = jnp.clip(hi // block_q + 1, 0, num_q_blocks)
  return first, jnp.maximum(last, first)


def _floor_div(a, b: int):
  return a // b  # floor division, also for negative a (Python and jnp agree)


def _ceil_div(a, b: int):
  return -((-a) // b)


def _i32(x):
  # Strongly typed: Pallas' Triton lowering mistypes a select between two
  # weakly typed integer literals (it gives them the predicate's i1 type).
  return jnp.asarray(x, jnp.int32)


def kv_block_full_range(spec: AttentionSpec, q_start, block_q: int,
                        block_k: int):
  """[lo, hi) KV blocks in which every key is visible from every query row.

  Kernels skip the mask (one select per score) on these interior blocks and
  apply it only on the edges. The range may be empty (hi <= lo) and may reach
  past `kv_block_range`; callers clip it into that range. Segment ids make
  visibility data-dependent, so with them no block is known to be full.
  """
  if spec.has_segment_ids:
    return 0, 0
  q_end = q_start + block_q
  lo = 0
  hi = spec.kv_len // block_k  # blocks without padded keys
  if spec.window_left != UNBOUNDED:
    # every key of the block >= the window start of the block's last row
    lo = _ceil_div(q_end - 1 + spec.kv_offset - spec.window_left, block_k)
  if spec.window_right != UNBOUNDED:
    # every key of the block <= the window end of the block's first row
    hi = jnp.minimum(hi, _floor_div(
        q_start + spec.kv_offset + spec.window_right + 1, block_k))
  # A q block holding padded rows (>= q_len) needs the mask everywhere.
  hi = jnp.where(q_end <= spec.q_len, _i32(hi), _i32(lo))
  return lo, hi


def q_block_full_range(spec: AttentionSpec, k_start, block_k: int,
                       block_q: int):
  """[lo, hi) query blocks that see every key of this KV block (no mask).

  The transpose of `kv_block_full_range`, for kernels that loop over queries.
  """
  if spec.has_segment_ids:
    return 0, 0
  k_end = k_start + block_k
  lo = 0
  hi = spec.q_len // block_q  # blocks without padded rows
  if spec.window_right != UNBOUNDED:
    # the block's first row already sees the block's last key
    lo = _ceil_div(k_end - 1 - spec.kv_offset - spec.window_right, block_q)
  if spec.window_left != UNBOUNDED:
    # the block's last row still sees the block's first key
    hi = jnp.minimum(hi, _floor_div(
        k_start - spec.kv_offset + spec.window_left + 1, block_q))
  hi = jnp.where(k_end <= spec.kv_len, _i32(hi), _i32(lo))
  return lo, hi


# ---------------------------------------------------------------------------
# Whole-block questions (Python ints, trace time). Positional only: segment
# ids can mask more, never less. Windows are >= 0 or UNBOUNDED, so every
# row's visible keys form one interval and the band is never empty by itself.
# ---------------------------------------------------------------------------


def window_bounds(spec: AttentionSpec):
  """(left, right) window sides as numbers, unbounded = +-inf."""
  inf = float("inf")
  left = inf if spec.window_left == UNBOUNDED else spec.window_left
  right = inf if spec.window_right == UNBOUNDED else spec.window_right
  return left, right


def is_empty(spec: AttentionSpec) -> bool:
  """Whether no (query, key) pair of the block is visible by position."""
  left, right = window_bounds(spec)
  off = spec.kv_offset
  # row i sees a key iff i + off - left <= kv_len - 1 and i + off + right >= 0
  first_row = max(0, -off - right)
  last_row = min(spec.q_len - 1, spec.kv_len - 1 - off + left)
  return first_row > last_row


def simplify(spec: AttentionSpec) -> AttentionSpec | None:
  """The simplest spec with the same visibility on this block; None if empty.

  Window sides that cut no (row, key) pair of the block are dropped, and
  with neither left the offset goes too, so blocks that are equally masked
  get equal (hashable) specs: ring attention traces one kernel per distinct
  spec. `causal` is kept only while the right side still binds.
  """
  if is_empty(spec):
    return None
  left, right = window_bounds(spec)
  off = spec.kv_offset
  left_cuts = spec.q_len - 1 + off - left > 0  # last row, key 0
  right_cuts = spec.kv_len - 1 > off + right  # row 0, last key
  return dataclasses.replace(
      spec, window_left=spec.window_left if left_cuts else UNBOUNDED,
      window_right=spec.window_right if right_cuts else UNBOUNDED,
      causal=spec.causal and right_cuts,
      q_offset=spec.q_offset if left_cuts or right_cuts else None)


def bottom_right_view(spec: AttentionSpec) -> AttentionSpec | None:
  """The same attention as a bottom-right spec on a prefix of q and of k/v.

  For kernels that only take the bottom-right alignment (the cuda backend):
  the result has q_len' <= q_len, kv_len' <= kv_len, q_offset None and
  windows >= 0 (or unbounded); attending q[:q_len'] to k[:kv_len'] with it
  gives the rows < q_len' exactly, rows past q_len' see no key (o = 0,
  lse = -inf, dq = 0) and keys past kv_len' are seen by no row (dk = dv = 0).
  None when nothing is visible. Why a prefix suffices: the bottom-right
  diagonal of the sliced block must lie inside the band, i.e.
  off - left <= kv_len' - q_len' <= off + right, and cutting off the rows
  whose first visible key is past the end (or the keys past the last row's
  last visible key) moves it there.
  """
  if is_empty(spec):
    return None
  left, right = window_bounds(spec)
  off, T, S = spec.kv_offset, spec.q_len, spec.kv_len
  if S - T < off - left:  # band right of the corner: drop late rows
    T = S - off + spec.window_left
  elif S - T > off + right:  # band left of the corner: drop late keys
    S = T + off + spec.window_right
  shift = off - (S - T)  # in [-right, left]
  wl = UNBOUNDED if left == float("inf") else spec.window_left - shift
  wr = UNBOUNDED if right == float("inf") else spec.window_right + shift
  return dataclasses.replace(spec, q_len=T, kv_len=S, window_left=wl,
                             window_right=wr, causal=wr == 0, q_offset=None)
