"""What the ring attention tests share: their meshes of host devices and the
loss whose gradients they compare."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P


def need(n):
  """Skips without n devices (conftest asks XLA for 8 host devices)."""
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} devices, have {len(jax.devices())} (conftest "
                "sets --xla_force_host_platform_device_count=8 for CPU)")


def mesh(name):
  """(mesh, ring_attention's axis kwargs, input PartitionSpec) for "seq2",
  "seq4", "seq8", "batch2_seq4" or "heads2_seq4"; skips without enough
  devices."""
  n = {"seq2": 2, "seq4": 4}.get(name, 8)
  need(n)
  devs = np.array(jax.devices()[:n])
  if name in ("seq2", "seq4", "seq8"):
    return Mesh(devs, ("s",)), dict(seq_axis="s"), P(None, "s")
  if name == "batch2_seq4":
    return (Mesh(devs.reshape(2, 4), ("b", "s")),
            dict(seq_axis="s", batch_axis="b"), P("b", "s"))
  if name == "heads2_seq4":
    return (Mesh(devs.reshape(2, 4), ("h", "s")),
            dict(seq_axis="s", head_axis="h"), P(None, "s", "h"))
  raise ValueError(name)


def weights(shape):
  return jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32)).reshape(shape)


def loss(attn):
  """sum(o * w) + 0.1 * sum(lse) (finite part): exercises do and dlse."""
  def fn(q, k, v):
    o, lse = attn(q, k, v)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(o * weights(o.shape)) + 0.1 * jnp.sum(lse)
  return fn


def fwd_and_grads(attn, q, k, v):
  return attn(q, k, v), jax.grad(loss(attn), argnums=(0, 1, 2))(q, k, v)
