"""`jax_flash.attention_with_kvcache`: decoding against a KV cache.

FlashAttention's `flash_attn_with_kvcache` in JAX: the new tokens' keys and
values (if given) are written into the cache at each sequence's end, then the
queries attend to each sequence's valid keys, aligned to their end (the
queries are the last T_new tokens). The cache is contiguous [B_cache, S_max,
H_kv, D] (rows chosen by `cache_batch_idx`) or paged [num_pages, page_size,
H_kv, D] with a page table [B, max_pages].

On a GPU with the CUDA extension (implementation None or "cuda") the
decoding kernels read the cache where it lies (cuda/decode: split-KV over
the keys, the query heads of a KV head packed into one tile, paged loads,
learnable sinks; decode/kernel_op.py). A long chunk of new tokens (more than
decode/cuda.py's PREFILL_MIN_TOKENS: a prompt's prefill) and everything the
kernels do not serve take the dense path instead: each sequence's keys as
one array (the cache itself when its row b is sequence b, else the rows or
pages gathered: sequences.py) through `attention(..., kv_seq_lengths=)`, so
the dense forward kernels or any other backend and every transformation
apply; gradients always come from that path. The updated caches are
returned as arrays; under `jax.jit` with the caches donated, XLA writes them
in place.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

from jax_flash._src.api import attention as api
from jax_flash._src.backends.registry import Unsupported
from jax_flash._src.core import checks
from jax_flash._src.decode import append
from jax_flash._src.decode import cuda as decode_cuda
from jax_flash._src.decode import fp8_cache
from jax_flash._src.decode import kernel_op
from jax_flash._src.decode import sequences


def _check(q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table,
           cache_batch_idx, num_splits):
  fp8 = [isinstance(c, fp8_cache.Fp8KVCache) for c in (k_cache, v_cache)]
  if fp8[0] != fp8[1]:
    raise ValueError("k_cache and v_cache must both be FP8 caches "
                     "(jax_flash.quantize_kv_cache) or both arrays")
  if fp8[0]:
    if k_cache.shape[-1] != v_cache.shape[-1]:
      raise ValueError(f"FP8 caches need one head dim for keys and values; "
                       f"got k_cache {k_cache.shape}, v_cache {v_cache.shape}")
    if k_cache.rotation_seed != v_cache.rotation_seed:
      raise ValueError(f"the FP8 caches must share their rotation; got seeds "
                       f"{k_cache.rotation_seed}, {v_cache.rotation_seed}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
      r, s_, h, _ = c.data.shape
      if tuple(c.descale.shape) != (r, h, s_):
        raise ValueError(f"{name}.descale must be [rows, H_kv, slots] = "
                         f"{(r, h, s_)}; got {tuple(c.descale.shape)}")
  for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
    if not hasattr(x, "ndim") or x.ndim != 4:
      raise ValueError(
          f"attention_with_kvcache: {name} must be a rank-4 array; got "
          f"{getattr(x, 'shape', type(x).__name__)}")
  if k_cache.shape[:-1] != v_cache.shape[:-1]:
    raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} "
                     f"must have the same shape but for the head dim "
                     f"(value's may differ)")
  B, T, H, D = q.shape
  H_kv, Dk, Dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
  if Dk != D or H_kv == 0 or H % H_kv:
    raise ValueError(
        f"attention_with_kvcache: q [B, T_new, H, D] = {q.shape} does not "
        f"fit the cache [.., .., H_kv, D] = {k_cache.shape} (head_dim must "
        f"match and H % H_kv == 0)")
  if (k_new is None) != (v_new is None):
    raise ValueError("pass k_new and v_new together")
  if k_new is not None:
    want = (B, k_new.shape[1], H_kv, D)
    want_v = want[:-1] + (Dv,)
    if k_new.shape != want or v_new.shape != want_v:
      raise ValueError(f"k_new and v_new must be [B, T_new, H_kv, D] = "
                       f"{want} and [B, T_new, H_kv, D_v] = {want_v}; got "
                       f"{k_new.shape}, {v_new.shape}")
  if not hasattr(cache_seqlens, "shape") or tuple(
      cache_seqlens.shape) != (B,) or not jnp.issubdtype(
          cache_seqlens.dtype, jnp.integer):
    raise ValueError(f"cache_seqlens must be an integer array [B] = [{B}]; "
                     f"got {getattr(cache_seqlens, 'shape', cache_seqlens)}")
  if page_table is not None:
    if cache_batch_idx is not None:
      raise ValueError("cache_batch_idx works with a contiguous cache, not "
                       "with page_table")
    if page_table.ndim != 2 or page_table.shape[0] != B or not jnp.issubdtype(
        page_table.dtype, jnp.integer):
      raise ValueError(f"page_table must be an integer array [B, max_pages] "
                       f"with B = {B}; got {page_table.shape}, "
                       f"{page_table.dtype}")
  if cache_batch_idx is not None and (
      tuple(cache_batch_idx.shape) != (B,) or
      not jnp.issubdtype(cache_batch_idx.dtype, jnp.integer)):
    raise ValueError(f"cache_batch_idx must be an integer array [B] = [{B}]")
  _check_indices(k_cache, cache_seqlens, k_new, page_table, cache_batch_idx)
  if num_splits is not None and (isinstance(num_splits, bool) or
                                 not isinstance(num_splits, numbers.Integral)
                                 or num_splits < 1):
    raise ValueError(f"num_splits must be None or an int >= 1, got "
                     f"{num_splits!r}")


def _check_indices(k_cache, cache_seqlens, k_new, page_table,
                   cache_batch_idx):
  """Index values known at trace time must address the cache (traced ones
  are clamped or dropped, see attention_with_kvcache's docstring)."""
  T_new = 0 if k_new is None else k_new.shape[1]
  if page_table is None:
    capacity = k_cache.shape[1]
    room = f"the cache holds {capacity} tokens per sequence"
  else:
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    capacity = page_table.shape[1] * page_size
    room = (f"page_table has {page_table.shape[1]} pages of {page_size} "
            f"tokens per sequence")
  checks.check_index_range("cache_seqlens", cache_seqlens, 0, capacity, room)
  if T_new:
    checks.check_index_range(
        "cache_seqlens", cache_seqlens, 0, capacity - T_new,
        f"{room}, and k_new adds {T_new}")
  if page_table is not None:
    lens, table = checks.concrete(cache_seqlens), checks.concrete(page_table)
    if lens is not None and table is not None:
      # Only the pages a sequence uses must be valid (the rest may be
      # padding of any value).
      used = (lens + T_new + page_size - 1) // page_size
      cols = np.arange(table.shape[1])[None, :]
      checks.check_index_range(
          "page_table", np.where(cols < used[:, None], table, 0), 0,
          num_pages - 1, f"a pool of {num_pages} pages")
  if cache_batch_idx is not None:
    checks.check_index_range("cache_batch_idx", cache_batch_idx, 0,
                             k_cache.shape[0] - 1,
                             f"the cache has {k_cache.shape[0]} rows")


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k_new=None,
                           v_new=None, page_table=None, cache_batch_idx=None,
                           causal: bool = True, scale: float | None = None,
                           window: tuple[int, int] | None = None,
                           softcap: float | None = None, sinks=None,
                           return_lse: bool = False, num_splits=None,
                           implementation: str | None = None):
  """Attention of new queries against a KV cache (FlashAttention's names).

  Args:
    q: [B, T_new, H, D], the new tokens' queries.
    k_cache, v_cache: contiguous [B_cache, S_max, H_kv, D], or paged
      [num_pages, page_size, H_kv, D] with `page_table`; arrays of q's
      dtype, or both `jax_flash.Fp8KVCache` (e4m3, quantize_kv_cache).
      v_cache's head dim D_v may differ from D (then the output has D_v;
      the decoding kernels need D_v == D, other calls take the reference
      path).
    cache_seqlens: int [B], valid tokens per sequence before k_new (traced).
    k_new, v_new: optional [B, T_new, H_kv, D], written at positions
      cache_seqlens[b] ... + T_new - 1 of each sequence.
    page_table: int [B, max_pages]: sequence b's position p lives in page
      page_table[b, p // page_size], slot p % page_size.
    cache_batch_idx: int [B]: the cache row of each sequence (contiguous).

    Index values known at trace time are checked (a ValueError naming the
    argument): cache_seqlens (+ T_new) within the capacity, the used
    page_table entries in [0, num_pages), cache_batch_idx in [0, B_cache).
    Traced values are not: lengths are clipped to [0, capacity], new tokens
    past the capacity are dropped (written nowhere, not attended), and
    out-of-range page or row indices are clamped when read.
    causal, scale, window, softcap, implementation: as `jax_flash.attention`,
      aligned to each sequence's end (the queries are its last T_new tokens).
      With None or "cuda" on a GPU, up to PREFILL_MIN_TOKENS (64) new tokens
      run on the decoding kernels, longer chunks on the dense forward kernels.
    sinks: learnable attention sinks [H], as `jax_flash.attention`.
    return_lse: also return the logsumexp [B, H, T_new].
    num_splits: how many parts each sequence's keys are split into (the
      CUDA decoding kernels; None: chosen from the batch, the heads and the
      cache length). Other paths run one pass over the keys.

  Returns:
    out [B, T_new, H, D_v], then lse if return_lse, then (with k_new) the
    updated k_cache and v_cache: a tuple unless only `out` is returned.
  """
  res, caches, _ = with_lengths(
      q, k_cache, v_cache, cache_seqlens, k_new=k_new, v_new=v_new,
      page_table=page_table, cache_batch_idx=cache_batch_idx, causal=causal,
      scale=scale, window=window, softcap=softcap, sinks=sinks,
      return_lse=return_lse, num_splits=num_splits,
      implementation=implementation)
  out = (res if isinstance(res, tuple) else (res,)) + caches
  return out if len(out) > 1 else out[0]


def with_lengths(q, k_cache, v_cache, cache_seqlens, *, k_new=None,
                 v_new=None, page_table=None, cache_batch_idx=None,
                 causal: bool = True, scale=None, window=None, softcap=None,
                 sinks=None, return_lse: bool = False, num_splits=None,
                 implementation: str | None = None):
  """`attention_with_kvcache` as (out or (out, lse), (k_cache, v_cache) with
  k_new else (), lengths): lengths int32 [B] are the tokens each sequence
  holds after the new ones, clamped to [0, capacity] (a decoding module's
  next cache index). Where the append kernel wrote the new tokens they come
  from it, so no other kernel computes them."""
  _check(q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table,
         cache_batch_idx, num_splits)
  causal = checks.static_bool(causal, "causal")
  return_lse = checks.static_bool(return_lse, "return_lse")
  B = q.shape[0]
  seqlens = cache_seqlens.astype(jnp.int32)
  if page_table is not None:
    page_size = k_cache.shape[1]
    capacity = page_table.shape[1] * page_size
  else:
    capacity = k_cache.shape[1]
  rows = (jnp.arange(B, dtype=jnp.int32) if cache_batch_idx is None else
          cache_batch_idx.astype(jnp.int32))
  identity_rows = (page_table is None and cache_batch_idx is None and
                   k_cache.shape[0] == B)
  fp8 = isinstance(k_cache, fp8_cache.Fp8KVCache)
  kernels = (_decoding_kernels_serve(q, k_cache, v_cache, implementation) and
             not api.no_rows(q.shape[:3]))

  lengths_known = None  # the clamped lengths, where a kernel wrote them
  caches = ()
  if k_new is not None:
    T_new = k_new.shape[1]
    if kernels and identity_rows and not fp8:
      # One launch writes both caches in place and the lengths.
      k_cache, v_cache, lengths_known = append.kernel_append(
          k_cache, v_cache, k_new, v_new, seqlens)
      seqlens = lengths_known
    else:
      at = append.slots(seqlens, T_new, k_cache.shape, page_table, rows)
      k_cache = append.write(k_cache, at, k_new)
      v_cache = append.write(v_cache, at, v_new)
      seqlens = seqlens + T_new
    caches = (k_cache, v_cache)

  if identity_rows:
    # A constant (no kernel computes it in every call).
    table = jnp.asarray(np.arange(B, dtype=np.int32)[:, None])
  elif page_table is None:
    # A contiguous cache is B_cache pages of S_max keys, one per sequence.
    table = rows[:, None]
  else:
    table = page_table.astype(jnp.int32)
  sinks = checks.check_sinks(sinks, q.shape[2], q.dtype)
  if kernels:
    opts = kernel_op.KernelOptions(
        scale=checks.check_scale(scale, q.shape[-1]),
        softcap=checks.check_softcap(softcap),
        **checks.window_fields(window, causal),
        num_splits=num_splits, identity_rows=identity_rows)
    op = kernel_op.decode_op(opts, fp8, sinks is not None)
    # Per sequence (the kernels' operand; a vmap folds it like q).
    sink_rows = api.per_batch_sinks(sinks, B)
    # The kernels clamp each length to the capacity themselves (and so does
    # the op's backward): no elementwise kernel before the call.
    lengths = seqlens
    if fp8:
      seed = k_cache.rotation_seed
      qr = q if seed is None else fp8_cache.rotate(q, seed).astype(q.dtype)
      o, lse = op(qr, k_cache.data, v_cache.data, *sink_rows,
                  k_cache.descale, v_cache.descale, table, lengths)
      if seed is not None:  # the values were rotated: o R^T
        o = fp8_cache.unrotate(o, seed).astype(q.dtype)
    else:
      o, lse = op(q, k_cache, v_cache, *sink_rows, table, lengths)
    res = (o, lse) if return_lse else o
    lengths = (lengths_known if lengths_known is not None else
               jnp.clip(seqlens, 0, capacity))
  else:
    lengths = jnp.clip(seqlens, 0, capacity)
    # The reference path, and the dense forward kernels' for long chunks:
    # attention over each sequence's keys, its first lengths[b] valid. The
    # queries are the last T_new of them, which is kv_seq_lengths' alignment
    # of causal and window bands.
    view = lambda c: sequences.per_sequence(c, table, q.dtype, identity_rows)
    res = api.attention(q, view(k_cache), view(v_cache), causal=causal,
                        scale=scale, window=window, softcap=softcap,
                        kv_seq_lengths=lengths, sinks=sinks,
                        return_lse=return_lse, implementation=implementation)
  return res, caches, lengths.astype(jnp.int32)


def _decoding_kernels_serve(q, k_cache, v_cache, implementation) -> bool:
  """Whether the decoding kernels run this call (implementation None or
  "cuda"; "cuda" raises Unsupported, naming why, where they cannot).

  A chunk of more than PREFILL_MIN_TOKENS new tokens (a prompt's prefill)
  goes to `attention` instead, the dense forward kernels on a GPU: they are
  built for long query blocks, the decoding kernels for a few tokens.
  """
  T = q.shape[1]
  if implementation not in (None, "cuda") or (
      isinstance(T, int) and T > decode_cuda.PREFILL_MIN_TOKENS):
    return False
  if v_cache.shape[-1] != q.shape[-1]:
    reason = (f"the decoding kernels need the value head_dim equal to the "
              f"query/key head_dim; got {v_cache.shape[-1]} and "
              f"{q.shape[-1]}; implementation=None or 'xla' serves it")
  else:
    reason = decode_cuda.unsupported_reason(q, k_cache, api._platform(q))
  if implementation == "cuda" and reason:
    raise Unsupported(f"attention_with_kvcache(implementation='cuda'): "
                      f"{reason}")
  return reason is None
