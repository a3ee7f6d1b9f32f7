"""The zigzag layout of ring attention: the sequence cut into 2n chunks,
device i holding chunks i and 2n-1-i, so that every device does the same
causal work (see ring/api.py). Global permutations, and the exchange that
turns each device's natural-order shard into its zigzag shard inside a
shard_map (and back).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax


def zigzag_indices(length: int, n: int) -> np.ndarray:
  """Natural positions in zigzag order: chunks (0, 2n-1, 1, 2n-2, ...)."""
  if length % (2 * n):
    raise ValueError(f"length {length} is not divisible by 2 * {n}")
  c = length // (2 * n)
  order = [ch for i in range(n) for ch in (i, 2 * n - 1 - i)]
  return np.concatenate([np.arange(ch * c, (ch + 1) * c) for ch in order])


def zigzag_permute(x, n: int, axis: int = 1):
  """Global array, natural order -> zigzag order along `axis`."""
  return jnp.take(x, zigzag_indices(x.shape[axis], n), axis=axis)


def zigzag_unpermute(x, n: int, axis: int = 1):
  """Inverse of `zigzag_permute`."""
  return jnp.take(x, np.argsort(zigzag_indices(x.shape[axis], n)), axis=axis)


def _dest(ch: int, n: int) -> int:
  """Device that holds natural chunk `ch` (of 2n) in the zigzag layout."""
  return ch if ch < n else 2 * n - 1 - ch


def local_to_zigzag(x, axis_name, n, axis):
  """Inside shard_map: local shard of natural order -> local zigzag shard.

  Device d holds natural chunks 2d, 2d+1; zigzag device j needs j, 2n-1-j.
  The first halves of all devices go in one ppermute, the second halves in
  another (each is a permutation of the devices); an even device gets its
  first slot from the first-halves permute, an odd one from the second.
  """
  h0, h1 = jnp.split(x, 2, axis=axis)
  r0 = lax.ppermute(h0, axis_name, [(d, _dest(2 * d, n)) for d in range(n)])
  r1 = lax.ppermute(h1, axis_name,
                    [(d, _dest(2 * d + 1, n)) for d in range(n)])
  even = lax.axis_index(axis_name) % 2 == 0
  return jnp.concatenate([jnp.where(even, r0, r1), jnp.where(even, r1, r0)],
                         axis=axis)


def local_from_zigzag(x, axis_name, n, axis):
  """Inverse of `local_to_zigzag`."""
  s0, s1 = jnp.split(x, 2, axis=axis)
  even = lax.axis_index(axis_name) % 2 == 0
  ev, od = jnp.where(even, s0, s1), jnp.where(even, s1, s0)
  r0 = lax.ppermute(ev, axis_name, [(_dest(2 * d, n), d) for d in range(n)])
  r1 = lax.ppermute(od, axis_name,
                    [(_dest(2 * d + 1, n), d) for d in range(n)])
  return jnp.concatenate([r0, r1], axis=axis)
