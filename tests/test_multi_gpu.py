"""Sharding on real GPUs with the CUDA kernels (needs >= 2 GPUs).

The same properties as test_partitioning.py / test_ring.py (which run on 8
host CPU devices), checked where the custom calls really run: batch/head
sharded calls stay local (no all-gather of q/k/v in the compiled HLO) and
ring attention over a sequence-sharded mesh matches the unsharded kernel and
the float64 reference, forward and gradients. Run on a 2-GPU machine through
tools/gpu/gpu_check.sh (GPU_TESTS=tests/test_multi_gpu.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flash
import reference
from jax_flash._src.backends import ffi
from reference import assert_close_to_reference

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(len(GPUS) < 2, reason="needs at least 2 GPUs"),
    pytest.mark.skipif(not ffi.available(), reason="CUDA extension not built"),
]


def _inputs(rng, B, T, H, H_kv, D, dtype=jnp.bfloat16):
  q = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
  k = jnp.asarray(rng.standard_normal((B, T, H_kv, D)), dtype)
  v = jnp.asarray(rng.standard_normal((B, T, H_kv, D)), dtype)
  do = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
  return q, k, v, do


def _value_and_grads(attn, q, k, v, do):
  def loss(q, k, v):
    o = attn(q, k, v)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o
  (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return o, grads


@pytest.mark.parametrize("axis", ["batch", "heads"])
def test_batch_or_head_sharded_runs_locally(axis, rng):
  n = len(GPUS)
  mesh = Mesh(np.array(GPUS), ("x",))
  B, H = (2 * n, 4) if axis == "batch" else (1, 4 * n)
  q, k, v, do = _inputs(rng, B, 256, H, H // 2, 128)
  spec = P("x") if axis == "batch" else P(None, None, "x")
  sh = NamedSharding(mesh, spec)
  qs, ks, vs, dos = (jax.device_put(x, sh) for x in (q, k, v, do))
  attn = functools.partial(jax_flash.attention, causal=True, implementation="cuda")
  hlo = jax.jit(attn).lower(qs, ks, vs).compile().as_text()
  assert "all-gather" not in hlo, "batch/head-sharded attention gathered its inputs"
  o_sh, g_sh = _value_and_grads(attn, qs, ks, vs, dos)
  o_1, g_1 = _value_and_grads(attn, q, k, v, do)
  np.testing.assert_array_equal(np.asarray(o_sh), np.asarray(o_1))
  for a, b in zip(g_sh, g_1):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=0, atol=1e-2)


@pytest.mark.parametrize("causal,window,segments", [
    (True, None, False),
    (False, None, True),
    (True, (300, 0), False),
    (False, (200, 100), False),
])
def test_ring_attention_matches_unsharded_and_reference(causal, window, segments, rng):
  n = len(GPUS)
  mesh = Mesh(np.array(GPUS), ("s",))
  B, T, H, H_kv, D = 2, 2 * n * 160, 4, 2, 128  # zigzag: T divisible by 2n
  q, k, v, do = _inputs(rng, B, T, H, H_kv, D)
  kw = dict(causal=causal, window=window)
  seg = None
  if segments:
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)
    kw["segment_ids"] = seg
  sh = NamedSharding(mesh, P(None, "s"))
  qs, ks, vs, dos = (jax.device_put(x, sh) for x in (q, k, v, do))
  ring = functools.partial(jax_flash.ring_attention, mesh=mesh, seq_axis="s",
                           implementation="cuda", **kw)
  single = functools.partial(jax_flash.attention, implementation="cuda", **kw)
  o_r, g_r = _value_and_grads(ring, qs, ks, vs, dos)
  o_1, g_1 = _value_and_grads(single, q, k, v, do)

  ref_kw = dict(causal=causal, window=window,
                segment_ids=None if seg is None else (np.asarray(seg), np.asarray(seg)))
  ref_o, _ = reference.attention(q, k, v, **ref_kw)
  ref_grads = reference.attention_vjp(q, k, v, do, **ref_kw)
  base_kw = dict(causal=causal, window=window,
                 segment_ids=None if seg is None else (seg, seg))
  base_o, base_grads = _value_and_grads(
      lambda q, k, v: reference.dense_attention_jax(q, k, v, **base_kw)[0], q, k, v, do)
  assert_close_to_reference("ring o", o_r, ref_o, base_o)
  assert_close_to_reference("single o", o_1, ref_o, base_o)
  for name, g, r, b in zip(("dq", "dk", "dv"), g_r, ref_grads, base_grads):
    assert_close_to_reference("ring " + name, g, r, b)
