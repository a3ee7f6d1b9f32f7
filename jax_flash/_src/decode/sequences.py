"""Each sequence's keys or values as one dense array, from a KV cache.

`attention_with_kvcache` runs everything that the decoding kernels do not
(other backends, gradients, long chunks of new tokens) through
`attention(..., kv_seq_lengths=)` on [B, capacity, H_kv, D] arrays: a cache
whose row b is sequence b as it is, otherwise the rows or pages of each
sequence gathered (table [B, max_pages]; a contiguous cache is one page of
S_max slots per sequence). An FP8 cache is dequantised after the gather, so
only the pages the batch uses are converted, not the whole pool.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_flash._src.decode import fp8_cache


def gather(pages, table):
  """Each sequence's rows [B, max_pages * page_size, ...] from the pages
  [num_pages, page_size, ...] (table [B, max_pages])."""
  B, n = table.shape
  return pages[table].reshape((B, n * pages.shape[1]) + pages.shape[2:])


def gather_dequantized(data, descale, table, dtype):
  """gather of an e4m3 cache's data [num_pages, page_size, H_kv, D] times
  its descale [num_pages, H_kv, page_size], in dtype (still rotated when
  the cache is)."""
  B, n = table.shape
  flat = lambda x: x[table].reshape((B * n,) + x.shape[1:])
  rows = fp8_cache.dequantize_rows(flat(data), flat(descale), dtype)
  return rows.reshape((B, n * data.shape[1]) + data.shape[2:])


def per_sequence(cache, table, dtype, identity_rows: bool):
  """[B, capacity, H_kv, D]: sequence b's keys (or values) at [b].

  cache: an array (returned in its own dtype) or an Fp8KVCache (dequantised
  to dtype and rotated back). identity_rows: row b of the cache is sequence
  b (a contiguous cache of B rows without cache_batch_idx): no gather.
  """
  if not isinstance(cache, fp8_cache.Fp8KVCache):
    return cache if identity_rows else gather(cache, table)
  seed = cache.rotation_seed
  acc = dtype if seed is None else jnp.float32  # unrotate in float32
  if identity_rows:
    x = fp8_cache.dequantize_rows(cache.data, cache.descale, acc)
  else:
    x = gather_dequantized(cache.data, cache.descale, table, acc)
  if seed is not None:
    x = fp8_cache.unrotate(x, seed)
  return x.astype(dtype)
