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
