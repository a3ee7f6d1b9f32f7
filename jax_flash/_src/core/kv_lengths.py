"""`attention(..., kv_seq_lengths=)`: a per-batch number of valid keys.

For a preallocated KV cache: key/value [..., S, H_kv, D] hold L valid keys
per batch element (the rest is stale or zeros), and the T queries are the
last T tokens of those L, so query i sits at key position L - T + i. Keys at
positions >= L become padding through segment ids. A causal or window band
must then be aligned to the valid end L, not to S: when such a band can cut
anything, each batch element's keys are rotated so that its valid keys end
at position S (a gather of K and V: O(S) extra memory traffic, no extra
FLOPs), where the bottom-right alignment is the right one.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_flash._src.core import checks
from jax_flash._src.core.spec import UNBOUNDED

VALID, PADDING = 1, 0  # kv segment ids; every query row has id VALID


def inputs(spec, k, v, kv_seq_lengths, segment_ids, batch_shape):
  """(k, v, (q_ids, kv_ids)) for `spec` (whose has_segment_ids is set)."""
  if segment_ids is not None:
    raise ValueError(
        "pass either kv_seq_lengths or segment_ids, not both; to combine "
        "them give keys at positions >= length a kv segment id that no query "
        "has")
  lengths = jnp.asarray(kv_seq_lengths)
  if not (jnp.issubdtype(lengths.dtype, jnp.integer) and
          _broadcasts_to(lengths.shape, tuple(batch_shape))):
    raise ValueError(
        f"kv_seq_lengths must be an integer array of shape {tuple(batch_shape)}"
        f" (the batch dims) or broadcastable to it; got shape "
        f"{lengths.shape}, dtype {lengths.dtype}")
  S, T = spec.kv_len, spec.q_len
  checks.check_index_range("kv_seq_lengths", kv_seq_lengths, 0, S,
                           f"key/value have {S} positions")
  lengths = jnp.broadcast_to(jnp.clip(lengths, 0, S).astype(jnp.int32),
                             batch_shape)[..., None]
  pos = jnp.arange(S, dtype=jnp.int32)
  band_cuts = spec.window_left != UNBOUNDED or (
      spec.window_right != UNBOUNDED and T > 1)
  if band_cuts:
    # Rotate by S - L: key p moves to p + S - L (mod S); padding wraps to the
    # front, the valid keys end at S.
    src = (pos + lengths) % S
    gather = lambda x: jnp.take_along_axis(x, src[..., None, None], axis=-3)
    k, v = gather(k), gather(v)
    valid = pos >= S - lengths
  else:  # only key padding matters (no band, or one query at the end)
    valid = pos < lengths
  kv_ids = jnp.where(valid, VALID, PADDING).astype(jnp.int32)
  q_ids = jnp.full(tuple(batch_shape) + (T,), VALID, jnp.int32)
  return k, v, (q_ids, kv_ids)


def _broadcasts_to(shape, target) -> bool:
  if len(shape) > len(target):
    return False
  return all(a in (1, b) for a, b in zip(shape[::-1], target[::-1]))
