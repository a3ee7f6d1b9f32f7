"""Which (query, key) pairs may attend: written once, used by every JAX backend.

The functions work on jnp values, so the XLA backend and the Pallas kernels
(traced or interpreted) share them. Positions are absolute row/column indices
into the unpadded sequences; indices past the real length (padding) are masked.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_flash._src.spec import UNBOUNDED, AttentionSpec


def visible(spec: AttentionSpec, q_pos, k_pos, q_seg=None, k_seg=None):
  """Boolean mask, broadcasting q_pos [..., bq, 1] against k_pos [..., 1, bk]."""
  ok = (q_pos < spec.q_len) & (k_pos < spec.kv_len)
  diag = q_pos + spec.kv_offset  # the key aligned with this query (bottom-right)
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
  Works on Python ints and traced int32 scalars alike.
  """
  first = 0
  last = num_kv_blocks
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
