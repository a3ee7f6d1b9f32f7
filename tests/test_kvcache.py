"""`attention_with_kvcache` against float64: contiguous and paged caches,
ragged lengths, appended tokens, GQA, causal and windows, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import reference

B, H, H_KV, D, S_MAX = 3, 4, 2, 32, 96


def _reference(q, k_full, v_full, lengths, **kw):
  """Per sequence: attention of q to its first lengths[b] keys, bottom-right."""
  outs = []
  for b in range(q.shape[0]):
    L = int(lengths[b])
    o, _ = reference.attention(q[b:b + 1], k_full[b:b + 1, :L],
                               v_full[b:b + 1, :L], **kw)
    outs.append(o[0])
  return np.stack(outs)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("t_new", [1, 5])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False),
                                dict(causal=True, window=(20, -1))], ids=str)
def test_matches_float64(paged, t_new, kw, rng, x64):
  seqlens = np.array([0, 37, S_MAX - t_new], np.int32)  # empty, odd, full
  q = rng.standard_normal((B, t_new, H, D))
  k_new = rng.standard_normal((B, t_new, H_KV, D))
  v_new = rng.standard_normal((B, t_new, H_KV, D))
  k_seq = rng.standard_normal((B, S_MAX, H_KV, D))  # each sequence's cache
  v_seq = rng.standard_normal((B, S_MAX, H_KV, D))
  args = {}
  if paged:
    page = 16
    n_pages = B * S_MAX // page
    perm = rng.permutation(n_pages)  # shuffled page table
    table = perm.reshape(B, S_MAX // page)
    k_cache = np.zeros((n_pages, page, H_KV, D))
    v_cache = np.zeros((n_pages, page, H_KV, D))
    for b in range(B):
      for p in range(S_MAX // page):
        k_cache[table[b, p]] = k_seq[b, p * page:(p + 1) * page]
        v_cache[table[b, p]] = v_seq[b, p * page:(p + 1) * page]
    args["page_table"] = jnp.asarray(table.astype(np.int32))
  else:
    order = np.array([2, 0, 1])  # cache rows in another order
    k_cache = np.zeros((B, S_MAX, H_KV, D))
    v_cache = np.zeros((B, S_MAX, H_KV, D))
    k_cache[order], v_cache[order] = k_seq, v_seq
    args["cache_batch_idx"] = jnp.asarray(order.astype(np.int32))
  out, kc, vc = jax.jit(lambda *a: jax_flash.attention_with_kvcache(
      *a[:4], k_new=a[4], v_new=a[5], **args, **kw))(
          jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache),
          jnp.asarray(seqlens), jnp.asarray(k_new), jnp.asarray(v_new))
  k_full, v_full = k_seq.copy(), v_seq.copy()
  for b in range(B):
    k_full[b, seqlens[b]:seqlens[b] + t_new] = k_new[b]
    v_full[b, seqlens[b]:seqlens[b] + t_new] = v_new[b]
  want = _reference(q, k_full, v_full, seqlens + t_new, **kw)
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-10)
  # The returned cache is the reference update.
  got_k = np.asarray(kc)
  for b in range(B):
    for t in range(t_new):
      p = seqlens[b] + t
      if paged:
        stored = got_k[table[b, p // 16], p % 16]
      else:
        stored = got_k[order[b], p]
      np.testing.assert_array_equal(stored, k_new[b, t])


def test_without_new_tokens_and_lse(rng, x64):
  seqlens = np.array([1, 50, S_MAX], np.int32)
  q = jnp.asarray(rng.standard_normal((B, 2, H, D)))
  k = jnp.asarray(rng.standard_normal((B, S_MAX, H_KV, D)))
  v = jnp.asarray(rng.standard_normal((B, S_MAX, H_KV, D)))
  out, lse = jax_flash.attention_with_kvcache(q, k, v, jnp.asarray(seqlens),
                                              return_lse=True)
  want = _reference(np.asarray(q), np.asarray(k), np.asarray(v), seqlens,
                    causal=True)
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-10)
  assert lse.shape == (B, H, 2)
  # Length 1 with two causal queries: the first query sees nothing.
  assert np.isneginf(np.asarray(lse)[0, :, 0]).all()


def test_donated_cache_updates_in_place(rng):
  """Under jit with the caches donated, the result reuses their buffers."""
  k = jnp.asarray(rng.standard_normal((B, S_MAX, H_KV, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, S_MAX, H_KV, D)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((B, 1, H, D)), jnp.float32)
  new = jnp.asarray(rng.standard_normal((B, 1, H_KV, D)), jnp.float32)
  step = jax.jit(lambda q, k, v, s, kn, vn: jax_flash.attention_with_kvcache(
      q, k, v, s, k_new=kn, v_new=vn), donate_argnums=(1, 2))
  text = step.lower(q, k, v, jnp.array([3, 4, 5]), new, new).as_text()
  assert "tf.aliasing_output" in text or "jax.buffer_donor" in text
  out, k2, _ = step(q, k, v, jnp.array([3, 4, 5]), new, new)
  np.testing.assert_array_equal(np.asarray(k2)[1, 4], np.asarray(new)[1, 0])
  assert out.shape == q.shape


@pytest.mark.parametrize("bad, message", [
    (dict(q=np.zeros((B, 1, 3, D), np.float32)), "H % H_kv"),
    (dict(cache_seqlens=np.zeros((B, 1), np.int32)), "cache_seqlens"),
    (dict(k_new=np.zeros((B, 1, H_KV, D), np.float32)), "together"),
    (dict(page_table=np.zeros((B, 2), np.int32),
          cache_batch_idx=np.zeros((B,), np.int32)), "cache_batch_idx"),
    (dict(page_table=np.zeros((B, 2), np.float32)), "page_table"),
    (dict(num_splits=0), "num_splits"),
])
def test_errors(bad, message):
  args = dict(q=np.zeros((B, 1, H, D), np.float32),
              k_cache=np.zeros((B, S_MAX, H_KV, D), np.float32),
              v_cache=np.zeros((B, S_MAX, H_KV, D), np.float32),
              cache_seqlens=np.zeros((B,), np.int32))
  args.update(bad)
  args = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x
          for n, x in args.items()}
  with pytest.raises(ValueError, match=message):
    jax_flash.attention_with_kvcache(**args)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU refusal")
def test_cuda_kernels_refuse_off_gpu():
  q = jnp.zeros((1, 1, 2, 64), jnp.bfloat16)
  k = jnp.zeros((1, 16, 1, 64), jnp.bfloat16)
  with pytest.raises(jax_flash.Unsupported, match="GPU|extension"):
    jax_flash.attention_with_kvcache(q, k, k, jnp.array([3]),
                                     implementation="cuda")


@pytest.fixture
def kernel_path_on_cpu(monkeypatch):
  """The kernel path's Python wiring (tables, identity rows, custom_vjp,
  sharding/vmap wrappers) with the kernel call replaced by the reference:
  `decode_cuda.forward`'s contract on the CPU."""
  from jax_flash._src.api import attention as api
  from jax_flash._src.decode import cuda as decode_cuda
  from jax_flash._src.decode.sequences import gather as _gather
  calls = []

  def forward(q, k_pages, v_pages, table, seqlens, *, scale, softcap,
              window_left, window_right, num_splits):
    calls.append(num_splits)
    return api.attention(q, _gather(k_pages, table), _gather(v_pages, table),
                         scale=scale, softcap=softcap,
                         window=(window_left, window_right),
                         kv_seq_lengths=seqlens, return_lse=True,
                         implementation="xla")

  monkeypatch.setattr(decode_cuda, "unsupported_reason", lambda *a: None)
  monkeypatch.setattr(decode_cuda, "forward", forward)
  return calls


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kernel_path_wiring(paged, rng, x64, kernel_path_on_cpu):
  seqlens = np.array([1, 37, S_MAX - 3], np.int32)
  q = rng.standard_normal((B, 3, H, D))
  k_seq = rng.standard_normal((B, S_MAX, H_KV, D))
  v_seq = rng.standard_normal((B, S_MAX, H_KV, D))
  kw = dict(causal=True, window=(30, -1), softcap=20.0)
  if paged:
    page = 16
    table = rng.permutation(B * S_MAX // page).reshape(B, -1)
    k_cache = np.zeros((B * S_MAX // page, page, H_KV, D))
    v_cache = np.zeros_like(k_cache)
    for b in range(B):
      for p in range(table.shape[1]):
        k_cache[table[b, p]] = k_seq[b, p * page:(p + 1) * page]
        v_cache[table[b, p]] = v_seq[b, p * page:(p + 1) * page]
    extra = dict(page_table=jnp.asarray(table.astype(np.int32)))
  else:
    k_cache, v_cache, extra = k_seq, v_seq, {}
  fn = lambda q, k, v: jax_flash.attention_with_kvcache(
      q, k, v, jnp.asarray(seqlens), **extra, **kw, num_splits=3)
  out = jax.jit(fn)(jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache))
  assert kernel_path_on_cpu == [3]
  want = _reference(q, k_seq, v_seq, seqlens, **kw)
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-10)
  # Gradients (through the reference path) and vmap over the queries.
  loss = lambda q, k, v: jnp.sum(fn(q, k, v) ** 2)
  g = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k_cache),
                                        jnp.asarray(v_cache))
  assert all(np.isfinite(np.asarray(x)).all() for x in g)
  qs = jnp.stack([jnp.asarray(q), jnp.asarray(q[::-1])])
  got = jax.vmap(fn, in_axes=(0, None, None))(qs, jnp.asarray(k_cache),
                                              jnp.asarray(v_cache))
  np.testing.assert_allclose(np.asarray(got[0]), want, atol=1e-10)


def _index_args(**bad):
  args = dict(q=np.zeros((2, 1, H, D), np.float32),
              k_cache=np.zeros((2, 32, H_KV, D), np.float32),
              v_cache=np.zeros((2, 32, H_KV, D), np.float32),
              cache_seqlens=np.array([3, 4], np.int32))
  args.update(bad)
  return {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x
          for n, x in args.items()}


_NEW = np.zeros((2, 4, H_KV, D), np.float32)
_POOL = np.zeros((4, 8, H_KV, D), np.float32)  # 4 pages of 8 slots


@pytest.mark.parametrize("bad, message", [
    (dict(cache_seqlens=np.array([3, 40], np.int32)),
     r"cache_seqlens out of range: cache_seqlens\[1\]=40; valid values are "
     r"0\.\.32 \(the cache holds 32 tokens per sequence\)"),
    (dict(cache_seqlens=np.array([-1, 4], np.int32)),
     r"cache_seqlens\[0\]=-1; valid values are 0\.\.32"),
    (dict(cache_seqlens=np.array([30, 4], np.int32), k_new=_NEW, v_new=_NEW),
     r"cache_seqlens\[0\]=30; valid values are 0\.\.28 \(the cache holds 32 "
     r"tokens per sequence, and k_new adds 4\)"),
    (dict(k_cache=_POOL, v_cache=_POOL,
          page_table=np.array([[0, 9], [1, 2]], np.int32),
          cache_seqlens=np.array([10, 4], np.int32)),
     r"page_table\[0, 1\]=9; valid values are 0\.\.3 \(a pool of 4 pages\)"),
    (dict(k_cache=_POOL, v_cache=_POOL,
          page_table=np.array([[0], [1]], np.int32),
          cache_seqlens=np.array([10, 4], np.int32)),
     r"cache_seqlens\[0\]=10; valid values are 0\.\.8 \(page_table has 1 "
     r"pages of 8 tokens"),
    (dict(cache_batch_idx=np.array([0, 7], np.int32)),
     r"cache_batch_idx\[1\]=7; valid values are 0\.\.1 \(the cache has 2 rows"),
], ids=["seqlens-over", "seqlens-negative", "new-past-capacity",
        "page-index", "page-table-short", "batch-idx"])
def test_concrete_index_errors(bad, message):
  with pytest.raises(ValueError, match=message):
    jax_flash.attention_with_kvcache(**_index_args(**bad))


def test_unused_page_table_entries_are_not_checked():
  # Only pages below the sequence's length must be valid; the rest may hold
  # any padding value.
  out = jax_flash.attention_with_kvcache(**_index_args(
      k_cache=_POOL, v_cache=_POOL,
      page_table=np.array([[0, -1], [1, 99]], np.int32)))
  assert out.shape == (2, 1, H, D)


def test_traced_indices_are_not_checked():
  # Under jit the values are unknown at trace time: clipped, not raised.
  args = _index_args()
  f = jax.jit(lambda s: jax_flash.attention_with_kvcache(
      args["q"], args["k_cache"], args["v_cache"], s))
  assert f(jnp.array([3, 40], jnp.int32)).shape == (2, 1, H, D)


def test_static_bool_options():
  with pytest.raises(TypeError, match=r"causal must be a Python bool, got "
                     r"'yes' \(str\)"):
    jax_flash.attention_with_kvcache(**_index_args(), causal="yes")
  with pytest.raises(TypeError, match=r"return_lse must be a Python bool"):
    jax_flash.attention_with_kvcache(**_index_args(), return_lse=1)
