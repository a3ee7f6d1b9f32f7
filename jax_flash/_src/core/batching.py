"""vmap support: vmapped axes are folded into the batch axis.

Every backend call takes arrays whose axis 0 is the batch, and returns arrays
whose axis 0 is the batch. Under `vmap` we therefore reshape (V, B, ...) to
(V*B, ...), make one call (one kernel launch), and split the result again.
Unbatched operands (e.g. k/v shared across a vmap over q) are broadcast.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def fold_into_batch(fn: Callable) -> Callable:
  """Wrap fn(*arrays) -> tuple of arrays, all batch-major, with custom_vmap."""
  wrapped = jax.custom_batching.custom_vmap(fn)

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, *args):
    flat = []
    for x, batched in zip(args, in_batched):
      if not batched:
        x = jnp.broadcast_to(x, (axis_size,) + x.shape)
      flat.append(x.reshape((axis_size * x.shape[1],) + x.shape[2:]))
    # Calling `wrapped` (not fn) keeps nested vmaps folding as well.
    outs = wrapped(*flat)
    outs = tuple(
        o.reshape((axis_size, o.shape[0] // axis_size) + o.shape[1:])
        for o in outs)
    return outs, tuple(True for _ in outs)

  return wrapped
