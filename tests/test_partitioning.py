"""custom_partitioning of the kernel calls on an Auto mesh (sharding/partition.py).

On the 8 host devices conftest.py asks XLA for, arranged as a (2, 4) mesh
("b", "h") with Auto axes: jit of forward + gradients of the "pallas"
backend (interpret mode on CPU; the same wrapper serves "cuda") on inputs
sharded over batch and/or heads equals the unsharded result, and the compiled
HLO has no all-gather (each device runs the kernel on its own shard). Inputs
sharded over sequence or head_dim, or over heads that do not keep a kv head
with its q heads, are resharded and still give the right answer.

Shapes are tiny: Pallas runs in interpret mode on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flash
from jax_flash._src.sharding.partition import kernel_roles
from jax_flash._src.sharding.rule import sharding_rule

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _ieee_float32():
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="module")
def mesh():
  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip(f"needs 8 devices, have {len(devices)} (conftest sets "
                "--xla_force_host_platform_device_count=8 for CPU)")
  if "pallas" not in jax_flash.available_implementations():
    pytest.skip("pallas backend not registered")
  return Mesh(np.array(devices[:8]).reshape(2, 4), ("b", "h"))


def _inputs(rng, B, T, S, H, Hk, D=32):
  mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32))
  q, k, v = mk(B, T, H, D), mk(B, S, Hk, D), mk(B, S, Hk, D)
  segs = (jnp.asarray(np.arange(T)[None].repeat(B, 0) // 3, jnp.int32),
          jnp.asarray(np.arange(S)[None].repeat(B, 0) // 4, jnp.int32))
  return (q, k, v), segs


def _fwd_and_grads(q, k, v, *segs):
  kw = dict(causal=True, implementation="pallas", return_lse=True)
  if segs:
    kw["segment_ids"] = segs

  def loss(q, k, v):
    o, lse = jax_flash.attention(q, k, v, **kw)
    w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(o * w) + 0.1 * jnp.sum(lse)

  out = jax_flash.attention(q, k, v, **kw)
  return out, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape)
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL)


def _run_sharded(mesh, spec, qkv, segs):
  """(compiled HLO text, result) of jit(_fwd_and_grads) on sharded inputs."""
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  qkv = tuple(put(x, spec) for x in qkv)
  segs = tuple(put(s, P(spec[0] if len(spec) else None)) for s in segs)
  compiled = jax.jit(_fwd_and_grads).lower(*qkv, *segs).compile()
  return compiled.as_text(), compiled(*qkv, *segs)


# name: (partition spec of q/k/v, B, T, S, H, Hk, segment ids)
LOCAL_CASES = {
    "batch": (P("b"), 2, 5, 7, 2, 1, True),
    "heads_gqa": (P(None, None, "h"), 1, 5, 7, 8, 4, False),
    "batch_x_heads": (P("b", None, "h"), 2, 5, 7, 4, 4, False),
    "batch_x_heads_gqa": (P("b", None, "h"), 2, 5, 7, 8, 4, True),
    # 8 kv heads: every head sharding of this mesh fits the kv heads, so the
    # rule shares a factor between q heads (n g) and kv heads n.
    "heads_gqa_shared_factor": (P(None, None, ("b", "h")), 1, 5, 7, 16, 8,
                                False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOCAL_CASES))
def test_batch_head_sharded_runs_locally(mesh, name, rng):
  spec, B, T, S, H, Hk, with_segs = LOCAL_CASES[name]
  qkv, segs = _inputs(rng, B, T, S, H, Hk)
  segs = segs if with_segs else ()
  expected = jax.jit(_fwd_and_grads)(*qkv, *segs)
  hlo, got = _run_sharded(mesh, spec, qkv, segs)
  _close(got, expected)
  # Each device ran the kernel on its shard: nothing gathered, and the
  # output keeps the input's batch/head sharding.
  assert "all-gather" not in hlo
  o_spec = tuple(got[0][0].sharding.spec) + (None,) * 4
  assert o_spec[:3] == (tuple(spec) + (None,) * 3)[:3]


# Inputs that cannot run shard-locally: resharded, never a wrong answer.
# name: (spec of q, spec of k/v, B, T, S, H, Hk)
RESHARD_CASES = {
    "head_dim": (P(None, None, None, "h"), P(None, None, None, "h"),
                 2, 5, 7, 4, 2),
    "seq": (P(None, "h"), P(None, "h"), 2, 8, 12, 4, 2),
    # 4 head shards but 2 kv heads: q heads cannot stay with their kv head.
    "gqa_q_heads_only": (P(None, None, "h"), P(), 1, 5, 7, 8, 2),
    "mqa_q_heads": (P("b", None, "h"), P("b"), 2, 5, 7, 4, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESHARD_CASES))
def test_other_shardings_are_resharded(mesh, name, rng):
  q_spec, kv_spec, B, T, S, H, Hk = RESHARD_CASES[name]
  (q, k, v), _ = _inputs(rng, B, T, S, H, Hk)
  expected = jax.jit(_fwd_and_grads)(q, k, v)
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  got = jax.jit(_fwd_and_grads)(put(q, q_spec), put(k, kv_spec),
                                put(v, kv_spec))
  _close(got, expected)


def test_vmap_of_batch_sharded(mesh, rng):
  """vmap folds into batch first; the folded call is then partitioned.

  The vmapped axis is the sharded one here: folding (V, B) into V*B keeps a
  sharding of V (the major part) but not one of B alone, which XLA gathers.
  """
  qkv, _ = _inputs(rng, 2, 5, 7, 4, 4)
  qkv = tuple(jnp.stack([x, 2 * x]) for x in qkv)  # [V=2, B, ...]
  f = jax.vmap(lambda q, k, v: jax_flash.attention(
      q, k, v, causal=True, implementation="pallas"))
  expected = jax.jit(f)(*qkv)
  xs = tuple(jax.device_put(x, NamedSharding(mesh, P("b", None, None, "h")))
             for x in qkv)
  compiled = jax.jit(f).lower(*xs).compile()
  _close(compiled(*xs), expected)
  assert "all-gather" not in compiled.as_text()


@pytest.mark.parametrize("group,kv_heads,axis_sizes,heads", [
    (1, 4, (2, 4), "n"),        # MHA: q and kv heads are one factor
    (2, 8, (2, 4), "(n g)"),    # GQA, kv heads divisible by every head split
    (2, 4, (2, 4), "h"),        # 8 q heads over 8 devices: 4 kv heads can't
    (4, 1, (2, 4), "h"),        # MQA
    (2, 8, None, "h"),          # mesh unknown
])
def test_sharding_rule(group, kv_heads, axis_sizes, heads):
  # e: the value head dim, a factor of its own (it may differ from d).
  fwd, kw = sharding_rule(*kernel_roles("forward", 2), group, kv_heads,
                          axis_sizes)
  assert fwd == (f"b t {heads} d, b s n d, b s n e, b t, b s -> "
                 f"b t {heads} e, b {heads} t")
  with_sinks, _ = sharding_rule(*kernel_roles("forward", 0, sinks=True),
                                group, kv_heads, axis_sizes)
  assert with_sinks == (f"b t {heads} d, b s n d, b s n e, b {heads} -> "
                        f"b t {heads} e, b {heads} t")
  bwd, _ = sharding_rule(*kernel_roles("backward", 0), group, kv_heads,
                         axis_sizes)
  assert bwd == (f"b t {heads} d, b s n d, b s n e, b t {heads} e, "
                 f"b {heads} t, b t {heads} e, b {heads} t -> "
                 f"b t {heads} d, b s n d, b s n e")
  # Special factors in order of first appearance (Shardy requires it).
  if heads == "(n g)":
    assert kw == dict(need_replication_factors=("t", "g", "d", "s", "e"),
                      g=group)
  else:
    assert kw == dict(need_replication_factors=("t", "d", "s", "e"))


def test_gspmd_fallback(mesh, rng):
  """With the (deprecated) GSPMD partitioner: infer_sharding_from_operands
  and partition serve it too."""
  from jax._src import config as jax_config  # no public toggle
  toggle = getattr(jax_config, "use_shardy_partitioner", None)
  if toggle is None:
    pytest.skip("this jax has no use_shardy_partitioner toggle")
  qkv, _ = _inputs(rng, 2, 5, 7, 8, 4)
  f = lambda q, k, v: jax_flash.attention(q, k, v, causal=True,
                                          implementation="pallas")
  expected = jax.jit(f)(*qkv)
  with toggle(False):
    xs = tuple(jax.device_put(x, NamedSharding(mesh, P("b", None, "h")))
               for x in qkv)
    compiled = jax.jit(f).lower(*xs).compile()
    got = compiled(*xs)
  _close(got, expected)
  assert "all-gather" not in compiled.as_text()
