"""Attention dropout's random numbers: one counter-based generator for every
backend.

The keep decision of score element (b, h, i, j) (batch, query head, query row,
key column, all global positions) is a pure function of the call's 64-bit key
and that position, so every backend draws the same mask, a backward pass
regenerates it instead of storing it, and sharded or ring-parallel calls do
not depend on the mesh:

  counter = (i, 4 * (j // 64) + (j % 8) // 2, h, b),  key = (k0, k1)
  w = Philox4x32-7(counter, key)                         (4 x 32 bits)
  c = 2 * ((j % 64) // 8) + j % 2                        (byte 0..15 of w)
  keep(b, h, i, j) = byte c of w  >=  threshold

One Philox call serves the 16 elements of a row that one thread of an MMA
accumulator fragment holds in a 64-column chunk (columns 8m + 2t + e, t =
lane % 4, for both the sm80 mma.m16n8 and the sm90 wgmma layouts), so a kernel
draws exactly its own elements. threshold = round(rate * 256): rates are
multiples of 1/256 (as in FlashAttention-2); kept elements are scaled by
256 / (256 - threshold), so the expectation is exact for the rate used.
Seven Philox rounds, as FlashAttention-2's generator: Random123 (Salmon et
al. 2011) finds Philox4x32-7 passes TestU01's BigCrush, and in the kernels
the rounds are most of dropout's cost. cuda/include/jax_flash/philox.h is the
same generator for the kernels (tests/test_dropout_rng.py checks that they
agree bit for bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Philox4x32 constants (Salmon et al., "Parallel random numbers: as easy as
# 1, 2, 3", SC'11; Random123).
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 7
COLUMN_CHUNK = 64  # columns of one row per Philox call (16 of them per thread)
# A call's key words: the key (k0, k1) and the call's origin in the whole
# request (batch0, head0, row0, col0), see key_words.
N_WORDS = 6


def _mulhilo(a, m: int):
  """(hi, lo) 32-bit halves of the 64-bit product a * m, in uint32 arithmetic
  only (16-bit halves; no uint64, which needs x64 mode)."""
  u16 = jnp.uint32(0xFFFF)
  m0, m1 = jnp.uint32(m & 0xFFFF), jnp.uint32(m >> 16)
  a0, a1 = a & u16, a >> 16
  t = a0 * m0
  u = a1 * m0 + (t >> 16)
  v = a0 * m1 + (u & u16)
  hi = a1 * m1 + (u >> 16) + (v >> 16)
  return hi, a * jnp.uint32(m)


def philox4x32(counter, key, rounds: int = ROUNDS):
  """Philox4x32-`rounds` of uint32 arrays: counter (c0, c1, c2, c3), key (k0,
  k1), all broadcastable; returns the 4 output words."""
  c0, c1, c2, c3 = (jnp.asarray(c, jnp.uint32) for c in counter)
  k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
  for _ in range(rounds):
    hi0, lo0 = _mulhilo(c0, _M0)
    hi1, lo1 = _mulhilo(c2, _M1)
    c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    k0 = k0 + jnp.uint32(_W0)
    k1 = k1 + jnp.uint32(_W1)
  return c0, c1, c2, c3


def threshold(rate: float) -> int:
  """The byte threshold of a dropout rate in [0, 1): round(rate * 256)."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1); got {rate}")
  return min(int(round(rate * 256)), 255)


def keep_scale(rate: float) -> float:
  """The factor of kept elements: 1 / (1 - effective rate)."""
  return 256.0 / (256 - threshold(rate))


def effective_rate(rate: float) -> float:
  """The rate the generator realises (a multiple of 1/256)."""
  return threshold(rate) / 256.0


def seed_words(rng):
  """The generator's key (k0, k1) from a jax.random key (any implementation):
  two uint32 words drawn from it."""
  words = jax.random.bits(rng, (2,), jnp.uint32)
  return words[0], words[1]


def keep_mask(key, batch, head, row, col, rate: float):
  """Keep decisions (bool) at broadcastable integer positions batch, head,
  row, col (global positions; int32 arrays), for key = (k0, k1)."""
  row, col = jnp.asarray(row, jnp.uint32), jnp.asarray(col, jnp.uint32)
  chunk = col // COLUMN_CHUNK
  sub = (col % 8) // 2
  counter = (row, chunk * 4 + sub, jnp.asarray(head, jnp.uint32),
             jnp.asarray(batch, jnp.uint32))
  words = philox4x32(counter, key)
  c = 2 * ((col % COLUMN_CHUNK) // 8) + col % 2  # byte 0..15
  word = c // 4
  w = jnp.where(word == 0, words[0],
                jnp.where(word == 1, words[1],
                          jnp.where(word == 2, words[2], words[3])))
  byte = (w >> (8 * (c % 4))) & jnp.uint32(0xFF)
  return byte >= jnp.uint32(threshold(rate))


def tile_keep(spec, key, batch, head, rows, cols):
  """The keep mask of a tile, or None without dropout (key None).

  spec: the request (its dropout_rate, and dropout_broadcast, which draws
  every batch element and head at (0, 0): one mask for all, as Flax's
  broadcast_dropout); key: the call's words (k0, k1, batch0, head0, row0,
  col0) (key_words; the origins: where the call's batch, heads, query rows
  and key columns start in the whole request, nonzero in one shard of a
  sharded call or one block of ring attention). batch, head, rows, cols:
  broadcastable positions in the call."""
  if key is None:
    return None
  k0, k1, batch0, head0, row0, col0 = key
  if spec.dropout_broadcast:
    batch, head = 0, 0
  else:
    batch = _shifted(batch, batch0)
    head = _shifted(head, head0)
  return keep_mask((k0, k1), batch, head, _shifted(rows, row0),
                   _shifted(cols, col0), spec.dropout_rate)


def _shifted(position, origin):
  return jnp.asarray(position, jnp.uint32) + jnp.asarray(origin, jnp.uint32)


def apply(x, keep, rate: float):
  """x * Z / (1 - rate) for the keep mask Z (x itself when keep is None)."""
  if keep is None:
    return x
  return jnp.where(keep, x * keep_scale(rate), 0.0).astype(x.dtype)


def keep_mask_np(key, batch, head, rows, cols, rate: float) -> np.ndarray:
  """keep_mask as a numpy [len(rows), len(cols)] array for one (batch,
  head): what tests and references use."""
  r = np.asarray(rows)[:, None]
  c = np.asarray(cols)[None, :]
  return np.asarray(keep_mask(key, batch, head, r, c, rate))


def key_words(rng):
  """The words a call's kernels get: the generator's key (k0, k1) from a
  user's `dropout_rng` (a typed jax.random key or a raw uint32[2] PRNGKey),
  with the argument checked, and the call's origin (batch0, head0, row0,
  col0) = (0, 0, 0, 0) (with_origin moves it for one shard or block)."""
  if not (isinstance(rng, jax.Array) or hasattr(rng, "dtype")):
    raise ValueError(f"dropout_rng must be a jax.random key; got {type(rng).__name__}")
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.dtype != jnp.uint32 or rng.shape[-1:] != (2,):
      raise ValueError(f"dropout_rng must be a jax.random key (jax.random.key "
                       f"or a raw uint32[2] PRNGKey); got dtype {rng.dtype}, "
                       f"shape {rng.shape}")
    rng = jax.random.wrap_key_data(rng)
  if rng.shape != ():
    raise ValueError(f"dropout_rng must be one key (shape ()); got shape "
                     f"{rng.shape}; use vmap for one key per example")
  zero = jnp.uint32(0)
  return tuple(seed_words(rng)) + (zero,) * (N_WORDS - 2)


def with_origin(key, batch0=0, head0=0, row0=0, col0=0):
  """key_words with the origin moved by (batch0, head0, row0, col0): the
  words of the shard or block whose first batch element, head, query row
  and key column are those positions of the whole request."""
  k0, k1 = key[:2]
  return (k0, k1) + tuple(_shifted(o, d) for o, d in
                          zip(key[2:], (batch0, head0, row0, col0)))
