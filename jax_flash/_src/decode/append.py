"""Writing the new tokens' keys and values into a KV cache (the k_new /
v_new of `attention_with_kvcache`), and the lengths after them.

Two backends of one write: `write` in plain JAX (any cache, any backend;
an FP8 cache quantises the new rows), and `kernel_append`, the CUDA append
kernel (cuda/decode/decode_append.h) for a 16-bit cache whose row b is
sequence b: one launch writes both caches in place (the call's results
alias its cache operands) and the clamped lengths the decoding kernels read
next, where XLA would run one scatter per cache plus the index arithmetic
as kernels of their own, every layer of every decoding step. The kernel's
gradient, its vmap and its reference are `write`'s.

New token t of sequence b goes to position seqlens[b] + t; positions
outside [0, capacity) are dropped (written nowhere).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_flash._src.decode import cuda as decode_cuda
from jax_flash._src.decode import fp8_cache
from jax_flash._src.sharding.partition import by_roles


def slots(seqlens, T_new: int, cache_shape, page_table=None, rows=None):
  """Where the new tokens go: index arrays (cache rows or pages [B, T_new],
  slots [B, T_new]) for `write`, dropped positions pointing past the cache.

  seqlens: int32 [B], the tokens each sequence holds before them; the
  cache [B_cache, S_max, ...] (rows [B]: each sequence's row) or paged
  [num_pages, page_size, ...] with page_table [B, max_pages].
  """
  pos = seqlens[:, None] + jnp.arange(T_new, dtype=jnp.int32)[None]
  if page_table is not None:
    page_size = cache_shape[1]
    capacity = page_table.shape[1] * page_size
    inside = (pos >= 0) & (pos < capacity)
    page = jnp.take_along_axis(page_table.astype(jnp.int32),
                               jnp.clip(pos // page_size, 0,
                                        page_table.shape[1] - 1), 1)
    return jnp.where(inside, page, cache_shape[0]), pos % page_size
  capacity = cache_shape[1]
  inside = (pos >= 0) & (pos < capacity)
  return (jnp.broadcast_to(rows[:, None], pos.shape),
          jnp.where(inside, pos, capacity))


def write(cache, at, x):
  """cache with x [B, T_new, H_kv, D] at `slots`' indices (dropped ones
  nowhere); an Fp8KVCache quantises x."""
  if isinstance(cache, fp8_cache.Fp8KVCache):
    return fp8_cache.write(cache, *at, x)
  return cache.at[at].set(x.astype(cache.dtype), mode="drop")


def lengths_after(seqlens, T_new: int, capacity: int):
  """The tokens each sequence holds after T_new more, as the decoding
  kernels clamp them: [0, capacity]."""
  return jnp.clip(seqlens + T_new, 0, capacity).astype(jnp.int32)


def reference(k_cache, v_cache, k_new, v_new, seqlens):
  """`kernel_append`'s results by `write` (row b = sequence b)."""
  B, T_new = k_new.shape[:2]
  at = slots(seqlens, T_new, k_cache.shape,
             rows=jnp.arange(B, dtype=jnp.int32))
  return (write(k_cache, at, k_new), write(v_cache, at, v_new),
          lengths_after(seqlens, T_new, k_cache.shape[1]))


def kernel_append(k_cache, v_cache, k_new, v_new, seqlens):
  """(k_cache, v_cache, lengths) after the new tokens, by the CUDA append
  kernel.

  k_cache, v_cache: 16-bit [B, S_max, H_kv, D], row b = sequence b; k_new,
  v_new [B, T_new, H_kv, D] in the caches' dtype; seqlens int32 [B].
  lengths: int32 [B], clamp(seqlens + T_new, 0, S_max).
  """
  return _append_op(k_cache.shape[2])(k_cache, v_cache, k_new, v_new,
                                      seqlens.astype(jnp.int32))


def _body(k_cache, v_cache, k_new, v_new, seqlens):
  # Each (local) row is its own sequence: no table.
  return decode_cuda.append(k_cache, v_cache, k_new, v_new, None, seqlens)


@functools.lru_cache(maxsize=None)
def _append_op(kv_heads: int):
  """The kernel call: sharded over batch and KV heads with no
  communication (custom_partitioning: the new tokens shard as queries of
  one head per KV head), vmapped through `reference`, differentiated
  through `write`'s transpose."""
  sharded = by_roles(_body, ("kv", "kv", "q", "q", "lengths"),
                     ("kv", "kv", "lengths"), group=1, kv_heads=kv_heads)
  batched = jax.custom_batching.custom_vmap(sharded)

  @batched.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = [x if b else jnp.broadcast_to(x, (axis_size,) + x.shape)
            for x, b in zip(args, in_batched)]
    return jax.vmap(reference)(*args), (True, True, True)

  @jax.custom_vjp
  def op(k_cache, v_cache, k_new, v_new, seqlens):
    return batched(k_cache, v_cache, k_new, v_new, seqlens)

  def fwd(k_cache, v_cache, k_new, v_new, seqlens):
    return op(k_cache, v_cache, k_new, v_new, seqlens), (k_new, seqlens)

  def bwd(res, cotangents):
    # The write is linear: a cache's cotangent passes where no new token
    # landed, and each new token's is its slot's.
    k_new, seqlens = res
    dk_cache, dv_cache, _ = cotangents
    B, T_new = k_new.shape[:2]
    at = slots(seqlens, T_new, dk_cache.shape,
               rows=jnp.arange(B, dtype=jnp.int32))
    zero = jnp.zeros(k_new.shape, dk_cache.dtype)
    take = lambda ct: ct.at[at].get(mode="fill", fill_value=0).astype(
        k_new.dtype)
    return (write(dk_cache, at, zero), write(dv_cache, at, zero),
            take(dk_cache), take(dv_cache), None)

  op.defvjp(fwd, bwd)
  return op
