"""An FP8 (e4m3) KV cache for `attention_with_kvcache`.

Decoding is bound by reading the cache, so storing it in e4m3 halves the
bytes. Every cached key and value is quantised on its own (a float32 descale
per (token, KV head) = its row's amax / 448): appending tokens never touches
the rows already cached, and an outlier costs only its own row's precision.
e4m3 is a floating-point format, so within a row every element keeps about
the same relative precision (2^-4) down to 2^-14 of the row's amax. Optionally
(`rotate=True`, head_dim 64, 128 or 256) each row is first multiplied along
head_dim by the orthogonal Hadamard rotation R of jax_flash's FP8 scheme
(fp8/scheme.py), which spreads a channel far louder than the rest over all
coordinates; attention then runs on (q R) against the rotated keys, and the
output, computed from rotated values, is rotated back (o R^T): both are exact
identities, so only the quantisation error remains. With per-row scales the
rotation rarely pays (measured in tests/test_fp8_cache.py: a channel 8x louder
gives a larger RMS error rotated than not), so it is off by default.

Layout (the same for a contiguous cache, rows = B_cache and slots = S_max,
and a paged one, rows = num_pages and slots = page_size):
  data     float8_e4m3fn [rows, slots, H_kv, D]
  descale  float32       [rows, H_kv, slots]  (slots a multiple of 4)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_flash._src.fp8 import quantize as fp8_quantize
from jax_flash._src.fp8 import scheme

E4M3 = jnp.float8_e4m3fn
ROTATABLE = (64, 128, 256)  # Hadamard sizes


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("data", "descale"),
                   meta_fields=("rotation_seed",))
@dataclasses.dataclass(frozen=True)
class Fp8KVCache:
  """A key or value cache in e4m3 with a descale per (token, KV head).

  A pytree (`data`, `descale` are its leaves; `rotation_seed` is static), so
  it goes through jit (donate it to update it in place), scans and
  device_put. Build one with `jax_flash.quantize_kv_cache`; pass two (keys
  and values, the same rotation) as `attention_with_kvcache`'s caches.

  Attributes:
    data: float8_e4m3fn [rows, slots, H_kv, D] (rotated if rotation_seed).
    descale: float32 [rows, H_kv, slots]: row values = data * descale.
    rotation_seed: the Hadamard rotation's seed (scheme.rotation_matrix), or
      None (not rotated).
  """

  data: jax.Array
  descale: jax.Array
  rotation_seed: int | None

  @property
  def shape(self):
    return tuple(self.data.shape)

  @property
  def ndim(self):
    return self.data.ndim

  @property
  def dtype(self):
    return self.data.dtype

  def dequantize(self, dtype=jnp.float32):
    """The cached rows [rows, slots, H_kv, D], rotated back."""
    x = dequantize_rows(self.data, self.descale)
    if self.rotation_seed is not None:
      x = unrotate(x, self.rotation_seed)
    return x.astype(dtype)


def dequantize_rows(data, descale, dtype=jnp.float32):
  """data [rows, slots, H_kv, D] times descale [rows, H_kv, slots] (as
  stored: still rotated if the cache is)."""
  return (data.astype(jnp.float32) *
          jnp.swapaxes(descale, 1, 2)[..., None]).astype(dtype)


def rotate(x, seed: int):
  """x [..., D] R (float32)."""
  return fp8_quantize.rotate(x, seed)


def unrotate(x, seed: int):
  """x [..., D] R^T (float32): undoes `rotate`."""
  r = jnp.asarray(scheme.rotation_matrix(x.shape[-1], seed), jnp.float32)
  return jnp.einsum("...e,de->...d", x.astype(jnp.float32), r,
                    precision=jax.lax.Precision.HIGHEST)


def quantize_rows(x, seed: int | None):
  """(e4m3 [..., H_kv, D], descale [..., H_kv]) of rows x [..., H_kv, D]."""
  x = rotate(x, seed) if seed is not None else x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=-1)
  nz = amax > 0
  descale = jnp.where(nz, amax / scheme.E4M3_MAX, 1.0).astype(jnp.float32)
  inv = jnp.where(nz, scheme.E4M3_MAX / jnp.where(nz, amax, 1.0), 1.0)
  data = fp8_quantize.to_e4m3(x * inv[..., None])
  return data, descale


def quantize_kv_cache(x, *, rotate: bool = False, seed: int = 0) -> Fp8KVCache:
  """A key or value cache [rows, slots, H_kv, D] (any float dtype) in e4m3.

  rotate: apply the Hadamard rotation first (needs D in 64, 128, 256).
  seed: the rotation's seed (keys and values of one cache pair must share
    it; queries are rotated with it at attention time).
  An empty cache to be filled by appends: quantize_kv_cache(jnp.zeros(...)).
  """
  if not hasattr(x, "ndim") or x.ndim != 4:
    raise ValueError(f"quantize_kv_cache: x must be [rows, slots, H_kv, D]; "
                     f"got {getattr(x, 'shape', type(x).__name__)}")
  D = x.shape[-1]
  if rotate and D not in ROTATABLE:
    raise ValueError(f"quantize_kv_cache: rotate=True needs head_dim in "
                     f"{ROTATABLE}; got {D} (pass rotate=False)")
  if x.shape[1] % 4:
    raise ValueError(f"quantize_kv_cache: the slots per row (S_max or "
                     f"page_size) must be a multiple of 4; got {x.shape[1]}")
  seed = int(seed) if rotate else None
  data, descale = quantize_rows(x, seed)
  return Fp8KVCache(data, jnp.swapaxes(descale, 1, 2), seed)


def write(cache: Fp8KVCache, rows, slots, x) -> Fp8KVCache:
  """cache with x [B, T, H_kv, D] quantised into (rows [B, T], slots [B, T]);
  out-of-range rows are dropped."""
  data, descale = quantize_rows(x, cache.rotation_seed)  # descale [B, T, H_kv]
  new_data = cache.data.at[rows, slots].set(data, mode="drop")
  heads = jnp.arange(x.shape[2], dtype=jnp.int32)
  new_descale = cache.descale.at[rows[..., None], heads, slots[..., None]].set(
      descale, mode="drop")
  return Fp8KVCache(new_data, new_descale, cache.rotation_seed)
