"""Attention with dropout on the probabilities: O = (P * Z / (1 - rate)) V.

The mask Z comes from dropout.py's generator at global positions (batch
element, query head, query row, key column) under a key drawn from the
caller's jax.random key, so the backward regenerates it (the key is the only
residual besides q, k, v, o and the LSE) and vmap / sharding keep each
element's mask. The LSE is that of the undropped P; rows that see no key
give zeros and zero gradients.

Served by the blockwise XLA backend (xla.py) and the Pallas kernels (the
same generator inside the kernels); reverse-mode differentiable (a
custom_vjp: jax.grad / jax.vjp, not jax.jvp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_flash._src.backends import registry as backends
from jax_flash._src.backends import xla
from jax_flash._src.autodiff.derivatives import softmax_delta
from jax_flash._src.core.spec import AttentionSpec


@functools.lru_cache(maxsize=None)
def attention_fn(spec: AttentionSpec, rate: float, broadcast: bool = False,
                 backend: str = "xla"):
  """fn(q, k, v, k0, k1, *segment_ids) -> (o, lse) on batch-major arrays;
  (k0, k1) uint32 scalars, the generator's key; broadcast: one mask for all
  batch elements and heads (Flax's broadcast_dropout); backend: "xla" or
  "pallas" (whose forward/backward take the same `dropout` argument)."""
  impl = xla if backend == "xla" else backends.get(backend)

  def forward(q, k, v, k0, k1, *segs):
    q_seg, kv_seg = segs if segs else (None, None)
    return impl.forward(spec, q, k, v, q_seg, kv_seg,
                        dropout=(rate, (k0, k1), broadcast))

  @jax.custom_vjp
  def attention(q, k, v, k0, k1, *segs):
    return forward(q, k, v, k0, k1, *segs)

  def attention_fwd(q, k, v, k0, k1, *segs):
    o, lse = forward(q, k, v, k0, k1, *segs)
    return (o, lse), (q, k, v, o, lse, k0, k1, segs)

  def attention_bwd(res, cotangents):
    q, k, v, o, lse, k0, k1, segs = res
    do, dlse = cotangents
    q_seg, kv_seg = segs if segs else (None, None)
    delta = softmax_delta(o, do, dlse)
    dq, dk, dv = impl.backward(spec, q, k, v, o, lse, do.astype(o.dtype),
                               delta, q_seg, kv_seg,
                               dropout=(rate, (k0, k1), broadcast))
    return (dq, dk, dv, None, None) + tuple(None for _ in segs)

  attention.defvjp(attention_fwd, attention_bwd)
  return attention


def key_words(rng):
  """The generator's key from a jax.random key (typed or raw uint32[2])."""
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
  words = jax.random.bits(rng, (2,), jnp.uint32)
  return words[0], words[1]
