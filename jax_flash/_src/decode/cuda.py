"""The CUDA decoding kernels (cuda/decode) behind `attention_with_kvcache`.

One FFI call runs the split kernel and, with more than one split, the combine
kernel. The caches are paged, [num_pages, page_size, H_kv, D] with a page
table [B, max_pages]; a contiguous cache [B_cache, S_max, H_kv, D] is passed
as B_cache pages of S_max keys and a one-column table (the cache row of each
sequence). Each sequence's lengths are read on the device, so they may be
traced; the split count is chosen at trace time from the cache's capacity
(the kernels' own policy, cuda/decode/decode_plan.h, asked through the
extension) unless the caller fixes `num_splits`, and the fp32 partials of
the splits are a workspace output sized here. Learnable sinks [B, H] enter
each row once: in the finalize of a single split, else in the combine.
Chunks of more than PREFILL_MIN_TOKENS new tokens do not come here
(`attention_with_kvcache` sends them to the dense forward kernels).
`append` is the kernel that writes new tokens into a cache before them
(decode/append.py wraps it).

The kernels have no backward: `attention_with_kvcache` differentiates the
reference path instead (a custom_vjp around this call). Under vmap the call
runs once per mapped element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._src.backends import ffi

DECODE = ffi.DECODE
DTYPES = ("bfloat16", "float16")
MAX_HEAD_DIM = 256
MAX_SPLITS = 128  # decode_params.h kDecodeMaxSplits
# The decoding kernels are built for a few new tokens (a CTA packs the T_new *
# group query rows of a KV head into 16 or 32 rows, and every CTA streams the
# whole cache); a longer chunk (a prompt's prefill) costs one more pass over
# the keys per 16-32 rows, where the dense forward kernels read each key tile
# once per 64-128 rows at full tensor-core shapes. Calls with more new tokens
# than this go to the dense forward kernels. The value is a first guess, to
# be set where the two cross on the GPU: `benchmarks/bench_decode.py
# --prefill-sweep` times both over T_new at long caches and prints it.
PREFILL_MIN_TOKENS = 64


def unsupported_reason(q, k_cache, platform: str) -> str | None:
  """Why the kernels cannot serve this call, or None if they can (k_cache:
  an array or an Fp8KVCache)."""
  if platform not in ("gpu", "cuda"):
    return f"the CUDA decoding kernels run on a GPU (platform {platform!r})"
  if not ffi.available():
    return ffi.unavailable_reason()
  dtype = jnp.dtype(q.dtype).name
  if dtype not in DTYPES:
    return f"q.dtype must be one of {', '.join(DTYPES)}; got {dtype}"
  fp8 = jnp.dtype(k_cache.dtype) == jnp.dtype(jnp.float8_e4m3fn)
  if not fp8 and jnp.dtype(k_cache.dtype) != jnp.dtype(q.dtype):
    return (f"the caches must have q's dtype ({dtype}) or be FP8 caches; got "
            f"{jnp.dtype(k_cache.dtype).name}")
  if fp8 and (q.shape[-1] % 16 or k_cache.shape[1] % 4 or
              64 < q.shape[-1] <= 96):
    return (f"an FP8 cache needs head_dim % 16 == 0, not in (64, 96], and "
            f"slots (page_size or S_max) % 4 == 0; got {q.shape[-1]}, "
            f"{k_cache.shape[1]}")
  dims = tuple(q.shape) + tuple(k_cache.shape)
  if not all(isinstance(d, (int, np.integer)) for d in dims):
    return "the decoding kernels need static shapes (no symbolic dims)"
  D = q.shape[-1]
  if D % 8 or D > MAX_HEAD_DIM:
    return f"head_dim must be a multiple of 8 up to {MAX_HEAD_DIM}; got {D}"
  B, H_kv = q.shape[0], k_cache.shape[2]
  if B * H_kv > 65535:
    return f"batch * H_kv must be <= 65535; got {B * H_kv}"
  return None


def num_splits_for(B: int, T: int, H: int, H_kv: int, D: int,
                   capacity: int, fp8: bool = False) -> int:
  """The kernels' split policy for a cache of `capacity` keys per sequence."""
  ext = ffi._load()[0]
  return int(ext.decode_num_splits(B * H_kv, T, H // H_kv, capacity, D,
                                   bool(fp8)))


def forward(q, k_pages, v_pages, *args, scale: float, softcap: float | None,
            window_left: int, window_right: int, num_splits: int | None,
            sinks=None):
  """(o [B, T, H, D], lse [B, H, T] float32) from the kernels.

  args: (page_table, seqlens), or for e4m3 pages (k_descale, v_descale,
  page_table, seqlens) with the descales [num_pages, H_kv, page_size].
  sinks: the learnable sink logits [B, H] (the lse includes them), or None.
  """
  *descales, page_table, seqlens = args
  fp8 = bool(descales)
  if not fp8:
    descales = [jnp.zeros((1,), jnp.float32)] * 2  # the handler ignores them
  B, T, H, D = q.shape
  H_kv = k_pages.shape[2]
  capacity = page_table.shape[1] * k_pages.shape[1]
  if num_splits is None:
    num_splits = num_splits_for(B, T, H, H_kv, D, capacity, fp8)
  splits = max(1, min(int(num_splits), MAX_SPLITS, -(-capacity // 64) or 1))
  rows = B * H * T
  partial = (splits * rows * D,) if splits > 1 else (1,)
  lse_partial = (splits * rows,) if splits > 1 else (1,)
  has_sinks = sinks is not None
  sinks = (sinks.astype(jnp.float32) if has_sinks else
           jnp.zeros((1,), jnp.float32))  # the handler ignores the dummy
  ffi._load()
  call = jax.ffi.ffi_call(
      DECODE,
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((B, H, T), jnp.float32),
       jax.ShapeDtypeStruct(partial, jnp.float32),
       jax.ShapeDtypeStruct(lse_partial, jnp.float32)),
      vmap_method="sequential")
  o, lse, _, _ = call(q, k_pages, v_pages, *descales,
                      page_table.astype(jnp.int32),
                      seqlens.astype(jnp.int32), sinks,
                      scale=np.float32(scale),
                      softcap=np.float32(softcap or 0.0),
                      window_left=np.int32(window_left),
                      window_right=np.int32(window_right),
                      num_splits=np.int32(splits), has_sinks=has_sinks)
  return o, lse


def append(k_cache, v_cache, k_new, v_new, page_table, seqlens):
  """(k_cache, v_cache, lengths) from the append kernel
  (cuda/decode/decode_append.h): the new tokens [B, T_new, H_kv, D] written
  at each sequence's seqlens[b] + t through its pages, in place: each
  result aliases its operand (the caches, and the lengths over seqlens), so
  a donated or loop-carried cache or cache index is never copied.
  page_table None: a contiguous cache whose row b is sequence b (no table
  to compute or read). lengths: int32 [B], clamp(seqlens + T_new, 0,
  capacity).
  """
  identity_rows = page_table is None
  if identity_rows:  # a 1-element dummy (a constant), which the kernel ignores
    page_table = jnp.zeros((1, 1), jnp.int32)
  ffi._load()
  call = jax.ffi.ffi_call(
      ffi.DECODE_APPEND,
      (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
       jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
       jax.ShapeDtypeStruct(seqlens.shape, jnp.int32)),
      input_output_aliases={0: 0, 1: 1, 5: 2}, vmap_method="sequential")
  return call(k_cache, v_cache, k_new.astype(k_cache.dtype),
              v_new.astype(v_cache.dtype), jnp.asarray(page_table, jnp.int32),
              seqlens.astype(jnp.int32), identity_rows=identity_rows)
