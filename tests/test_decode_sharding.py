"""The decoding kernel call under sharding and vmap (sharding/decode.py).

The kernels need a GPU, so the wrappers are checked here around a reference
body (the gathered cache through the xla backend), on the 8 host devices of
conftest.py as a (2, 4) mesh ("b", "h"): batch- and head-sharded calls equal
the unsharded one and compile without an all-gather; a paged pool sharded over
the batch is gathered first (right answer); vmap folds into one call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flash
from jax_flash._src.sharding import decode as decode_sharding
from jax_flash._src.decode.sequences import gather as _gather

B, T, H, H_KV, D, S = 4, 2, 8, 4, 16, 24
CALLS = []


def _body(q, k_pages, v_pages, table, seqlens):
  CALLS.append((q.shape, k_pages.shape, table.shape))
  return jax_flash.attention(q, _gather(k_pages, table),
                             _gather(v_pages, table), causal=True,
                             kv_seq_lengths=seqlens, return_lse=True,
                             implementation="xla")


@pytest.fixture(scope="module")
def mesh():
  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip(f"needs 8 devices, have {len(devices)}")
  return Mesh(np.array(devices[:8]).reshape(2, 4), ("b", "h"))


def _inputs(rng, paged):
  mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32))
  q = mk(B, T, H, D)
  seqlens = jnp.asarray(rng.integers(1, S + 1, B), jnp.int32)
  if paged:
    page = 8
    n = S // page
    table = jnp.asarray(rng.permutation(B * n).reshape(B, n), jnp.int32)
    k, v = mk(B * n, page, H_KV, D), mk(B * n, page, H_KV, D)
  else:
    table = jnp.arange(B, dtype=jnp.int32)[:, None]
    k, v = mk(B, S, H_KV, D), mk(B, S, H_KV, D)
  return q, k, v, table, seqlens


CASES = {  # name: (paged, spec of q, spec of the caches, all-gather expected)
    "contiguous_batch": (False, P("b"), P("b"), False),
    "contiguous_heads": (False, P(None, None, "h"), P(None, None, "h"), False),
    "contiguous_batch_x_heads": (False, P("b", None, "h"), P("b", None, "h"),
                                 False),
    "paged_heads": (True, P(None, None, "h"), P(None, None, "h"), False),
    "paged_batch_x_heads": (True, P("b", None, "h"), P(None, None, "h"),
                            False),
    "paged_pool_over_batch": (True, P("b"), P("b"), True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_calls_run_locally(mesh, name, rng):
  paged, q_spec, kv_spec, gathers = CASES[name]
  q, k, v, table, seqlens = _inputs(rng, paged)
  # A contiguous cache passes its identity table (attention_with_kvcache: a
  # constant); a batch shard numbers its own rows.
  fn = decode_sharding.decode_call(_body, identity_rows=not paged,
                                   rows=None if paged else B,
                                   group=H // H_KV, kv_heads=H_KV)
  with jax.default_matmul_precision("highest"):
    want = jax.jit(fn)(q, k, v, table, seqlens)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    args = (put(q, q_spec), put(k, kv_spec), put(v, kv_spec),
            put(table, P(q_spec[0] if len(q_spec) else None)),
            put(seqlens, P(q_spec[0] if len(q_spec) else None)))
    compiled = jax.jit(fn).lower(*args).compile()
    got = compiled(*args)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-5)
  assert ("all-gather" in compiled.as_text()) == gathers


@pytest.mark.parametrize("paged", [False, True])
def test_vmap_folds_into_one_call(paged, rng):
  V = 3
  cases = [_inputs(rng, paged) for _ in range(V)]
  stacked = [jnp.stack(xs) for xs in zip(*cases)]
  fn = decode_sharding.decode_call(_body, identity_rows=not paged,
                                   group=H // H_KV, kv_heads=H_KV)
  CALLS.clear()
  got = jax.vmap(fn)(*stacked)
  # One call on the folded batch (custom_vmap also traces the unbatched one).
  assert [c[0][0] for c in CALLS].count(V * B) == 1
  for i, args in enumerate(cases):
    want = fn(*args)
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=1e-5,
                                 atol=1e-5)
  # Caches shared by every vmapped query (in_axes None): no copies of them.
  q = stacked[0]
  k, v, table, seqlens = cases[0][1:]
  got = jax.vmap(fn, in_axes=(0, None, None, None, None))(q, k, v, table,
                                                           seqlens)
  for i in range(V):
    want = fn(q[i], k, v, table, seqlens)
    np.testing.assert_allclose(np.asarray(got[0][i]), np.asarray(want[0]),
                               rtol=1e-5, atol=1e-5)
