"""jax_flash.attention composes with jax transformations, for every backend.

jit, vmap (folded into batch by custom_vmap: results must equal a loop of
calls), vmap with only q batched, vmap of grad, nested vmap, jax.checkpoint,
grad under jit, finite-difference gradient checks, and sharding over batch and
heads on a mesh of the 8 host devices that conftest.py asks XLA for.

Shapes are tiny: the Pallas backend runs in interpret mode on CPU.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jax_flash
from reference import enable_x64

IMPLS = ("xla", "pallas")
# B, T, S, H, Hk, D: odd lengths, GQA; D = 32 is the smallest Pallas head dim.
SHAPE = (2, 9, 13, 4, 2, 32)
TOL = dict(rtol=2e-6, atol=2e-6)  # float32; "equal" up to reassociation


def _pallas_on_cpu(node) -> bool:
  """The few Pallas cases cheap enough for interpret mode on CPU (10-30 s
  each); on a GPU every test runs for Pallas too."""
  params = getattr(node, "callspec", None)
  params = params.params if params else {}
  name = node.originalname
  if name == "test_vmap_equals_loop":
    return True
  if name == "test_check_grads":
    kw, dtype = params.get("kw", {}), params.get("dtype")
    return ((dtype == "float64" and kw == dict(causal=False)) or
            (dtype == "float32" and kw.get("softcap") is not None))
  if name == "test_sharded_equals_unsharded":
    return params.get("name") == "batch"
  if name == "test_explicit_mesh_runs_per_shard":
    return True  # the case a pallas_call cannot take without shard_map
  return False


@pytest.fixture(autouse=True)
def _ieee_float32():
  """IEEE float32 matmuls: on GPU XLA's default is often TF32, and two
  differently compiled programs (vmap vs loop, sharded vs not) may then pick
  different algorithms."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(params=IMPLS)
def impl(request):
  name = request.param
  if name not in jax_flash.available_implementations():
    pytest.skip(f"implementation {name!r} is not registered (available: "
                f"{jax_flash.available_implementations()})")
  if (name == "pallas" and jax.default_backend() == "cpu" and
      not _pallas_on_cpu(request.node)):
    pytest.skip("Pallas interpret mode on CPU is slow; this composition test "
                "runs for Pallas on GPU (a subset runs on CPU)")
  return name


def _qkv(rng, lead=(), shape=SHAPE, dtype=jnp.float32):
  B, T, S, H, Hk, D = shape
  mk = lambda *s: jnp.asarray(rng.standard_normal(lead + s, np.float32), dtype)
  return mk(B, T, H, D), mk(B, S, Hk, D), mk(B, S, Hk, D)


def _attn(impl, **kw):
  kw.setdefault("causal", True)
  return functools.partial(jax_flash.attention, implementation=impl, **kw)


def _loss(impl, do=None, **kw):
  def loss(q, k, v):
    o, lse = _attn(impl, return_lse=True, **kw)(q, k, v)
    w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
    w = w if do is None else do
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(o.astype(jnp.float32) * w) + 0.1 * jnp.sum(lse)
  return loss


def _close(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape)
    np.testing.assert_allclose(np.asarray(x, np.float32),
                               np.asarray(y, np.float32), **(tol or TOL))


def test_jit_matches_eager(impl, rng):
  q, k, v = _qkv(rng)
  f = _attn(impl, window=(4, -1), return_lse=True)
  _close(jax.jit(f)(q, k, v), f(q, k, v))


def test_grad_under_jit_matches_eager(impl, rng):
  q, k, v = _qkv(rng)
  g = jax.grad(_loss(impl), argnums=(0, 1, 2))
  _close(jax.jit(g)(q, k, v), g(q, k, v))


def test_vmap_equals_loop(impl, rng):
  """vmap over a new leading axis (segment ids batched too) == a loop."""
  V = 3
  q, k, v = _qkv(rng, lead=(V,))
  B, T, S = SHAPE[:3]
  q_seg = jnp.asarray(rng.integers(0, 2, (V, B, T)), jnp.int32)
  kv_seg = jnp.asarray(rng.integers(0, 2, (V, B, S)), jnp.int32)

  def f(q, k, v, qs, ks):
    return _attn(impl, causal=False, segment_ids=(qs, ks),
                 return_lse=True)(q, k, v)

  out = jax.jit(jax.vmap(f))(q, k, v, q_seg, kv_seg)
  loop = [jax.jit(f)(q[i], k[i], v[i], q_seg[i], kv_seg[i]) for i in range(V)]
  _close(out, jax.tree.map(lambda *xs: jnp.stack(xs), *loop))


def test_vmap_non_leading_axis(impl, rng):
  """in_axes / out_axes other than 0 (the rule sees the axis moved to 0)."""
  q, k, v = _qkv(rng, lead=(2,))
  qt, kt, vt = (jnp.moveaxis(x, 0, 2) for x in (q, k, v))  # [B, T, V, H, D]
  f = _attn(impl)
  out = jax.jit(jax.vmap(f, in_axes=2, out_axes=1))(qt, kt, vt)
  ref = jnp.stack([f(q[i], k[i], v[i]) for i in range(2)], axis=1)
  _close(out, ref)


def test_vmap_only_q_batched(impl, rng):
  """k/v shared across the vmapped axis (broadcast by the batching rule)."""
  V = 3
  q, _, _ = _qkv(rng, lead=(V,))
  _, k, v = _qkv(rng)
  f = _attn(impl, return_lse=True)
  out = jax.jit(jax.vmap(f, in_axes=(0, None, None)))(q, k, v)
  loop = [f(q[i], k, v) for i in range(V)]
  _close(out, jax.tree.map(lambda *xs: jnp.stack(xs), *loop))
  # And its gradient: dk/dv sum over the vmapped axis.
  loss = lambda q, k, v: jnp.sum(jax.vmap(_loss(impl), (0, None, None))(
      q, k, v))
  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  g_loop = [jax.grad(_loss(impl), argnums=(0, 1, 2))(q[i], k, v)
            for i in range(V)]
  _close(g, (jnp.stack([x[0] for x in g_loop]),
             sum(x[1] for x in g_loop), sum(x[2] for x in g_loop)),
         rtol=1e-5, atol=1e-5)


def test_vmap_of_grad_equals_loop(impl, rng):
  V = 2
  q, k, v = _qkv(rng, lead=(V,))
  g = jax.grad(_loss(impl, window=(3, 2)), argnums=(0, 1, 2))
  out = jax.jit(jax.vmap(g))(q, k, v)
  loop = [g(q[i], k[i], v[i]) for i in range(V)]
  _close(out, jax.tree.map(lambda *xs: jnp.stack(xs), *loop))


def test_nested_vmap_equals_loop(impl, rng):
  q, k, v = _qkv(rng, lead=(2, 2))
  f = _attn(impl, softcap=3.0)
  out = jax.jit(jax.vmap(jax.vmap(f)))(q, k, v)
  ref = jnp.stack([jnp.stack([f(q[i, j], k[i, j], v[i, j]) for j in range(2)])
                   for i in range(2)])
  _close(out, ref)


def test_checkpoint(impl, rng):
  q, k, v = _qkv(rng)
  loss = _loss(impl)
  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  g_remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k,
                                                                     v)
  policy = jax.checkpoint_policies.nothing_saveable
  g_policy = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy),
                              argnums=(0, 1, 2)))(q, k, v)
  _close(g_remat, g)
  _close(g_policy, g)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kw", [
    dict(causal=False),
    dict(causal=True),
    dict(window=(3, 1)),
    dict(causal=True, softcap=2.0, segment_ids="pair"),
], ids=["plain", "causal", "window", "causal_softcap_segments"])
@pytest.mark.slow
def test_check_grads(impl, dtype, kw, rng):
  """Finite differences vs the custom_vjp (o and lse both feed the output)."""
  kw = dict(kw)
  B, T, S, H, Hk, D = SHAPE
  if kw.get("segment_ids") == "pair":
    kw["segment_ids"] = (jnp.asarray(np.arange(T)[None].repeat(B, 0) % 2),
                         jnp.asarray(np.arange(S)[None].repeat(B, 0) % 3))
  x64 = dtype == "float64"
  with enable_x64() if x64 else contextlib.nullcontext():
    q, k, v = _qkv(rng, dtype=dtype)
    q, k, v = (x.astype(dtype) for x in (q, k, v))

    def f(q, k, v):
      o, lse = _attn(impl, return_lse=True, **kw)(q, k, v)
      return o, jnp.where(jnp.isfinite(lse), lse, 0.0)

    try:
      jax.eval_shape(f, q, k, v)
    except jax_flash.Unsupported as e:
      pytest.skip(str(e))
    if x64:
      check_grads(f, (q, k, v), order=1, modes=("rev",), atol=1e-6,
                  rtol=1e-6, eps=1e-5)
    else:
      check_grads(f, (q, k, v), order=1, modes=("rev",), atol=5e-2,
                  rtol=5e-2, eps=1e-2)


# ---------------------------------------------------------------------------
# Sharding: all devices (8 on CPU), inputs sharded over batch and/or heads.
# ---------------------------------------------------------------------------


def _sharding_setup(name):
  """(mesh, partition spec, shape B,T,S,H,Hk,D) over all devices: 8 host
  devices on CPU (conftest), however many GPUs otherwise."""
  devices = jax.devices()
  n = len(devices)
  if n < 2 or (name == "batch_x_heads_gqa" and (n < 4 or n % 2)):
    pytest.skip(f"needs more devices, have {n} (conftest sets "
                "--xla_force_host_platform_device_count=8 for CPU)")
  if name == "batch":
    mesh = Mesh(np.array(devices), ("b",))
    return mesh, P("b"), (n, 9, 13, 2, 1, 32)
  if name == "heads":
    mesh = Mesh(np.array(devices), ("h",))
    return mesh, P(None, None, "h"), (1, 9, 13, n, n, 32)
  mesh = Mesh(np.array(devices).reshape(2, n // 2), ("b", "h"))
  return mesh, P("b", None, "h"), (2, 9, 13, n, n // 2, 32)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["batch", "heads", "batch_x_heads_gqa"])
def test_sharded_equals_unsharded(impl, name, rng):
  """jit on inputs sharded over batch / heads (GQA: kv heads sharded too)
  equals the unsharded result, forward and gradients."""
  mesh, spec, shape = _sharding_setup(name)
  q, k, v = _qkv(rng, shape=shape)
  B, T = shape[:2]
  S = shape[2]
  segs = (jnp.asarray(np.arange(T)[None].repeat(B, 0) // 4, jnp.int32),
          jnp.asarray(np.arange(S)[None].repeat(B, 0) // 5, jnp.int32))


  def fwd_and_grads(q, k, v, q_seg, kv_seg):
    kw = dict(causal=True, segment_ids=(q_seg, kv_seg))
    out = _attn(impl, return_lse=True, **kw)(q, k, v)
    grads = jax.grad(_loss(impl, **kw), argnums=(0, 1, 2))(q, k, v)
    return out, grads

  expected = jax.jit(fwd_and_grads)(q, k, v, *segs)
  sharding = NamedSharding(mesh, spec)
  seg_sharding = NamedSharding(mesh, P(spec[0]))  # batch-sharded or not
  qs, ks, vs = (jax.device_put(x, sharding) for x in (q, k, v))
  segs = tuple(jax.device_put(x, seg_sharding) for x in segs)
  assert len(qs.sharding.device_set) == len(mesh.devices.flat)
  got = jax.jit(fwd_and_grads)(qs, ks, vs, *segs)
  _close(got, expected, rtol=1e-5, atol=1e-5)
  # Gradients come back sharded like (or replicated relative to) the inputs
  # only by XLA's choice; their values are what matter here.
  assert got[1][0].shape == q.shape


def _use_mesh(mesh):
  """Context manager that makes `mesh` current (jax 0.11 and 0.12 spell it
  differently)."""
  if hasattr(jax, "set_mesh"):
    return jax.set_mesh(mesh)
  return jax.sharding.use_mesh(mesh)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["batch_x_heads_gqa"])
def test_explicit_mesh_runs_per_shard(impl, name, rng):
  """With explicit mesh axes (jax.make_mesh's default), batch/head-sharded
  inputs run shard-locally (shard_map): same values as unsharded, outputs
  keep the input sharding, and no all-gather of q/k/v in the compiled HLO."""
  devices = jax.devices()
  if len(devices) < 4 or len(devices) % 2:
    pytest.skip(f"needs an even number >= 4 of devices, have {len(devices)}")
  n = len(devices)
  mesh = jax.make_mesh((2, n // 2), ("b", "h"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  shape = (2, 9, 13, n, n // 2, 32)
  q, k, v = _qkv(rng, shape=shape)

  def fwd_and_grads(q, k, v):
    out = _attn(impl, return_lse=True, causal=True)(q, k, v)
    grads = jax.grad(_loss(impl, causal=True), argnums=(0, 1, 2))(q, k, v)
    return out, grads

  expected = jax.jit(fwd_and_grads)(q, k, v)
  with _use_mesh(mesh):
    sharding = NamedSharding(mesh, P("b", None, "h"))
    qs, ks, vs = (jax.device_put(x, sharding) for x in (q, k, v))
    compiled = jax.jit(fwd_and_grads).lower(qs, ks, vs).compile()
    got = compiled(qs, ks, vs)
  _close(got, expected, rtol=1e-5, atol=1e-5)
  assert tuple(got[0][0].sharding.spec)[:3] == ("b", None, "h")
  assert "all-gather" not in compiled.as_text()
