"""What the linen and nnx `SelfAttention` modules share: their head sizes and
the KV-cache step of `decode=True`.

A decode call takes a chunk of any length T (a whole prompt, or one token):
the chunk's keys and values are written into the cache at each row's index
and the chunk attends to the cache and causally to itself in one
`jax_flash.attention_with_kvcache` call.
"""

from __future__ import annotations

import jax.numpy as jnp

import jax_flash
from jax_flash._src.core import checks
from jax_flash._src.decode import kvcache


def head_sizes(*, num_heads: int, num_kv_heads: int | None,
               head_dim: int | None, qkv_features: int | None,
               features: int) -> tuple[int, int]:
  """(head_dim, num_kv_heads) from a module's options; ValueError if they do
  not fit together."""
  if head_dim is None:
    qkv = qkv_features if qkv_features is not None else features
    if qkv % num_heads:
      raise ValueError(f"qkv_features ({qkv}) must be divisible by "
                       f"num_heads ({num_heads})")
    head_dim = qkv // num_heads
  kv_heads = num_kv_heads or num_heads
  if num_heads % kv_heads:
    raise ValueError(f"num_heads ({num_heads}) must be a multiple of "
                     f"num_kv_heads ({kv_heads})")
  return head_dim, kv_heads


def cache_shapes(batch: int, max_len: int, kv_heads: int, head_dim: int,
                 value_head_dim: int | None = None):
  """Shapes of (cached_key, cached_value, cache_index)."""
  return ((batch, max_len, kv_heads, head_dim),
          (batch, max_len, kv_heads, value_head_dim or head_dim), (batch,))


def attend(module, q, k, v, *, segment_ids, lengths, sinks, return_lse,
           dropout):
  """A call without the cache: `jax_flash.attention` with the module's
  options (causal, scale, window, softcap, implementation,
  deterministic_backward)."""
  if lengths is not None:
    raise ValueError("lengths= is for decode=True; pad with segment_ids "
                     "otherwise")
  return jax_flash.attention(
      q, k, v, causal=module.causal, scale=module.scale, window=module.window,
      softcap=module.softcap, segment_ids=segment_ids, sinks=sinks,
      return_lse=return_lse, implementation=module.implementation,
      deterministic=module.deterministic_backward, **dropout)


def check_decode_call(q, segment_ids, dropout):
  """What a `decode=True` call must not have, and the queries' rank."""
  if segment_ids is not None or dropout:
    raise ValueError("decode=True takes no segment_ids and no dropout")
  if q.ndim != 4:
    raise ValueError(f"decode=True takes inputs [batch, T, features]; got "
                     f"queries of shape {q.shape}")


def attend_with_cache(q, k, v, cached_key, cached_value, cache_index, *,
                      lengths=None, causal: bool, scale, window, softcap,
                      return_lse: bool, implementation, sinks=None):
  """One `decode=True` call of T tokens against the cache.

  The call was checked by `check_decode_call`.

  Args:
    q: [B, T, H, D]; k: [B, T, H_kv, D], v: [B, T, H_kv, D_v], the chunk's
      projections.
    cached_key, cached_value: [B, max_len, H_kv, D or D_v]; cache_index:
      int [B], the tokens each row holds.
    lengths: optional int [B], the valid tokens of each row of the chunk
      (right padding after them; causal only). A row's index advances by its
      length, so the next call overwrites its padding. Padded positions are
      zeroed before attention: their outputs are finite and meaningless.

  Returns:
    (out or (out, lse), cached_key, cached_value, cache_index), updated.
  """
  B, T = q.shape[:2]
  max_len = cached_key.shape[1]
  if cached_key.shape[0] != B:
    raise ValueError(f"decode=True: a batch of {B} rows does not fit the "
                     f"cache of {cached_key.shape[0]} rows")
  if T > max_len:
    raise ValueError(
        f"decode=True: a chunk of {T} tokens is longer than the cache "
        f"({max_len} tokens per row); size the cache for the prompt and the "
        f"tokens to generate (the length of the input at init, or "
        f"init_cache's input_shape)")
  held = checks.concrete(cache_index)
  if held is not None and (held + T > max_len).any():
    row = int((held + T > max_len).argmax())
    raise ValueError(
        f"decode=True: row {row} holds {int(held[row])} tokens; a chunk of "
        f"{T} more does not fit the cache of {max_len} tokens per row")
  advance = T
  if lengths is not None:
    lengths = _check_lengths(lengths, B, T, causal)
    valid = jnp.arange(T, dtype=jnp.int32)[None] < lengths[:, None]  # [B, T]
    zero = lambda x: jnp.where(valid[:, :, None, None], x,
                               jnp.zeros((), x.dtype))
    q, k, v = zero(q), zero(k), zero(v)
    advance = jnp.clip(lengths, 0, T)
  out, (cached_key, cached_value), held = kvcache.with_lengths(
      q, cached_key, cached_value, cache_index,
      k_new=k.astype(cached_key.dtype), v_new=v.astype(cached_value.dtype),
      causal=causal, scale=scale, window=window, softcap=softcap,
      sinks=sinks, return_lse=return_lse, implementation=implementation)
  if lengths is None:
    # min(index + T, max_len), as the call computed it (on the GPU the
    # append kernel writes it with the new keys: no kernel of its own).
    index = held
  else:
    index = jnp.minimum(cache_index + advance, max_len)
  return out, cached_key, cached_value, index.astype(cache_index.dtype)


def _check_lengths(lengths, B, T, causal):
  if not causal:
    raise ValueError(
        "decode=True: lengths= (right-padded chunks) needs causal=True; "
        "without it the valid tokens would attend to the padding")
  if not hasattr(lengths, "shape") or tuple(lengths.shape) != (B,) or (
      not jnp.issubdtype(lengths.dtype, jnp.integer)):
    raise ValueError(f"lengths must be an integer array [batch] = [{B}]; got "
                     f"{getattr(lengths, 'shape', lengths)}")
  checks.check_index_range("lengths", lengths, 0, T,
                           f"the chunk has {T} tokens")
  return lengths.astype(jnp.int32)
