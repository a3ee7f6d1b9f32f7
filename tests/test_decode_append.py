"""The append kernel's op (decode/append.py `kernel_append`: new tokens
written into a 16-bit cache whose row b is sequence b, and the lengths
after) on the CPU, with the kernel call replaced by its contract
(decode_contract.py): sharded over batch and KV heads without
communication, vmapped, differentiated, and inside the Flax modules'
decoding steps, each against the plain-JAX write (`append.reference`) or
the xla path. The kernel itself: cuda/tests/selftest_decode.cu ("append"
cases, also on the host emulator).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flash.flax as jff
from decode_contract import use_contract
from jax_flash._src.decode import append

B, T, H_KV, D, S = 4, 2, 4, 16, 12


def _inputs(rng, dtype=jnp.float32):
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  # Lengths 0, mid, one token short of full (one new token dropped), full.
  seqlens = jnp.asarray([0, 5, S - 1, S], jnp.int32)
  return (mk(B, S, H_KV, D), mk(B, S, H_KV, D), mk(B, T, H_KV, D),
          mk(B, T, H_KV, D), seqlens)


def _check(got, want):
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_matches_reference(rng, monkeypatch):
  calls = use_contract(monkeypatch)
  args = _inputs(rng)
  got = jax.jit(append.kernel_append)(*args)
  assert calls.appends == 1
  k, v, k_new, v_new, seqlens = args
  _check(got, append.reference(*args))
  # Independently: row 2 keeps the first new token at slot S - 1 and drops
  # the second; row 3 (full) changes nothing; lengths clamp at S.
  np.testing.assert_array_equal(np.asarray(got[0][2, S - 1]), k_new[2, 0])
  np.testing.assert_array_equal(np.asarray(got[1][3]), v[3])
  np.testing.assert_array_equal(np.asarray(got[2]), [T, 5 + T, S, S])


@pytest.fixture(scope="module")
def mesh():
  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip(f"needs 8 devices, have {len(devices)}")
  return Mesh(np.array(devices[:8]).reshape(2, 4), ("b", "h"))


@pytest.mark.parametrize("spec", [P("b"), P(None, None, "h"),
                                  P("b", None, "h")],
                         ids=["batch", "heads", "batch_x_heads"])
def test_sharded_runs_locally(mesh, spec, rng, monkeypatch):
  use_contract(monkeypatch)
  args = _inputs(rng)
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  sharded = [put(x, spec) for x in args[:4]] + [
      put(args[4], P(spec[0]))]
  compiled = jax.jit(append.kernel_append).lower(*sharded).compile()
  _check(compiled(*sharded), append.reference(*args))
  assert "all-gather" not in compiled.as_text()


def test_vmap(rng, monkeypatch):
  calls = use_contract(monkeypatch)
  cases = [_inputs(rng) for _ in range(3)]
  stacked = [jnp.stack(xs) for xs in zip(*cases)]
  got = jax.vmap(append.kernel_append)(*stacked)
  for i, args in enumerate(cases):
    _check([x[i] for x in got], append.reference(*args))
  # New tokens shared by every element (in_axes None) broadcast.
  got = jax.vmap(append.kernel_append, in_axes=(0, 0, None, None, 0))(
      stacked[0], stacked[1], cases[0][2], cases[0][3], stacked[4])
  for i, args in enumerate(cases):
    want = append.reference(args[0], args[1], cases[0][2], cases[0][3],
                            args[4])
    _check([x[i] for x in got], want)
  del calls


def test_gradients_are_the_writes(rng, monkeypatch):
  use_contract(monkeypatch)
  args = _inputs(rng)
  w = [jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
       for x in args[:2]]

  def loss(fn):
    def f(k, v, k_new, v_new):
      kc, vc, _ = fn(k, v, k_new, v_new, args[4])
      return jnp.sum(kc * w[0]) + jnp.sum(vc * w[1]) ** 2
    return f

  got = jax.grad(loss(append.kernel_append), argnums=(0, 1, 2, 3))(*args[:4])
  want = jax.grad(loss(append.reference), argnums=(0, 1, 2, 3))(*args[:4])
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  # The dropped token (row 2's second) gets no gradient; the slot it would
  # overwrite is not its.
  assert not np.asarray(got[2][2, 1]).any()


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_flax_decode_steps_match_the_xla_path(kind, rng, monkeypatch):
  """Prefill, then single-token steps: outputs, caches and cache index on
  the kernel path (append kernel + decoding kernels, by their contracts)
  equal the xla path's."""
  batch, prompt, steps, features = 2, 5, 3, 32
  total = prompt + steps
  x = jnp.asarray(rng.standard_normal((batch, total, features)), jnp.float32)

  def run(implementation):
    if kind == "linen":
      layer = jff.SelfAttention(num_heads=4, num_kv_heads=2, causal=True,
                                decode=True, implementation=implementation)
      variables = layer.init(jax.random.key(0), x)
      params, state = variables["params"], {"cache": variables["cache"]}

      @jax.jit
      def call(state, chunk):
        y, upd = layer.apply({"params": params, **state}, chunk,
                             mutable=["cache"])
        return upd, y

      def step(chunk):
        nonlocal state
        state, y = call(state, chunk)
        return y

      caches = lambda: jax.tree.leaves(state)
    else:
      from flax import nnx
      layer = jff.nnx.SelfAttention(4, features, num_kv_heads=2, causal=True,
                                    implementation=implementation,
                                    rngs=nnx.Rngs(0))
      layer.init_cache(x.shape, jnp.float32)
      call = nnx.jit(lambda m, chunk: m(chunk, decode=True))
      step = lambda chunk: call(layer, chunk)
      caches = lambda: [layer.cached_key[...], layer.cached_value[...],
                        layer.cache_index[...]]
    outs = [step(x[:, :prompt])]
    outs += [step(x[:, t:t + 1]) for t in range(prompt, total)]
    return jnp.concatenate(outs, 1), caches()

  want, want_cache = run("xla")
  calls = use_contract(monkeypatch)
  got, got_cache = run(None)
  # Traced once each: the prompt's chunk (5 tokens: the decoding kernels
  # too) and the one-token step.
  assert calls.appends == 2 and len(calls) == 2
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                             atol=1e-5)
  for a, b in zip(got_cache, want_cache):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                               atol=1e-6)
