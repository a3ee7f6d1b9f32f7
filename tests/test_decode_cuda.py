"""The CUDA decoding kernels behind `attention_with_kvcache` (cuda/decode).

GPU only (skipped without a CUDA GPU and the extension); the GPU scripts set
JAX_FLASH_POISON_OUTPUTS=1, so every output and split partial is NaN before
the kernels run. Each case: random caches at odd sizes, every slot that no
sequence may read NaN, shuffled page tables, ragged lengths (0, 1, odd,
full), against float64 per sequence; the error bound is 2x that of the
same-dtype dense XLA attention (reference.dense_attention_jax). Learnable
sinks (one split and several, FP8 caches) and long chunks of new tokens,
which run on the dense forward kernels instead, too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import reference
from jax_flash._src.decode import cuda as decode_cuda
from jax_flash._src.backends import ffi
from reference import assert_close_to_reference

ON_GPU = jax.default_backend() == "gpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU"),
    pytest.mark.skipif(not ffi.available(),
                       reason=f"CUDA extension not built: "
                       f"{ffi.unavailable_reason()}"),
]


def _case(rng, *, B, T, H, H_kv, D, capacity, page, dtype, seqlens=None):
  """Inputs as the caller holds them plus each sequence's dense keys."""
  dt = jnp.dtype(dtype)
  if seqlens is None:
    seqlens = rng.integers(0, capacity + 1, B)
    seqlens[0], seqlens[-1] = capacity, min(1, capacity)
  seqlens = np.asarray(seqlens, np.int32)
  rnd = lambda *s: np.asarray(jnp.asarray(rng.standard_normal(s), dt),
                              np.float64)
  q = rnd(B, T, H, D)
  k_seq, v_seq = rnd(B, capacity, H_kv, D), rnd(B, capacity, H_kv, D)
  if page:
    n = -(-capacity // page)
    pages = B * n + 3  # unused pages stay NaN
    table = rng.permutation(pages)[:B * n].reshape(B, n).astype(np.int32)
    k_cache = np.full((pages, page, H_kv, D), np.nan)
    v_cache = np.full((pages, page, H_kv, D), np.nan)
    for b in range(B):
      for j in range(seqlens[b]):
        k_cache[table[b, j // page], j % page] = k_seq[b, j]
        v_cache[table[b, j // page], j % page] = v_seq[b, j]
    extra = dict(page_table=jnp.asarray(table))
  else:
    rows = rng.permutation(B + 2)[:B].astype(np.int32)  # spare rows: NaN
    k_cache = np.full((B + 2, capacity, H_kv, D), np.nan)
    v_cache = np.full((B + 2, capacity, H_kv, D), np.nan)
    for b in range(B):
      k_cache[rows[b], :seqlens[b]] = k_seq[b, :seqlens[b]]
      v_cache[rows[b], :seqlens[b]] = v_seq[b, :seqlens[b]]
    extra = dict(cache_batch_idx=jnp.asarray(rows))
  args = (jnp.asarray(q, dt), jnp.asarray(k_cache, dt),
          jnp.asarray(v_cache, dt), jnp.asarray(seqlens))
  return args, extra, (q, k_seq, v_seq, seqlens)


def _references(dense, kw, dtype):
  """(o64, lse64, o_xla, lse_xla): per sequence, its first seqlens[b] keys
  (kw may hold sinks [H])."""
  q, k_seq, v_seq, seqlens = dense
  o64, l64, ox, lx = [], [], [], []
  for b in range(q.shape[0]):
    L = int(seqlens[b])
    sl = lambda x: x[b:b + 1, :L]
    if L == 0:  # nothing visible: O = 0, LSE = the sink (-inf), exactly
      sink = np.asarray(kw.get("sinks", np.full(q.shape[2], -np.inf)))
      for out in (o64, ox):
        out.append(np.zeros(q.shape[1:3] + v_seq.shape[-1:]))
      for out in (l64, lx):
        out.append(np.repeat(np.asarray(sink, np.float64)[:, None],
                             q.shape[1], 1))
      continue
    o, l = reference.attention(q[b:b + 1], sl(k_seq), sl(v_seq), **kw)
    o64.append(o[0])
    l64.append(l[0])
    cast = lambda x: jnp.asarray(x, dtype)
    o, l = reference.dense_attention_jax(cast(q[b:b + 1]), cast(sl(k_seq)),
                                         cast(sl(v_seq)), **kw)
    ox.append(np.asarray(o, np.float64)[0])
    lx.append(np.asarray(l, np.float64)[0])
  return tuple(map(np.stack, (o64, l64, ox, lx)))


CASES = [
    # B, T, H, H_kv, D, capacity, page, dtype, kw, num_splits
    (4, 1, 32, 8, 128, 1000, 64, "bfloat16", dict(causal=True), None),
    (3, 1, 8, 1, 128, 777, None, "bfloat16", dict(causal=True), 5),
    (2, 5, 16, 2, 64, 300, 16, "float16", dict(causal=True), None),
    (2, 8, 8, 2, 96, 333, 100, "bfloat16", dict(causal=True, window=(50, 0)), 3),
    (2, 3, 4, 4, 256, 190, 32, "float16", dict(causal=True, softcap=30.0), 2),
    (1, 16, 8, 1, 40, 129, 256, "bfloat16", dict(causal=True), None),
    (3, 2, 4, 2, 128, 200, None, "bfloat16", dict(causal=False), 1),
    (1, 1, 64, 8, 128, 4100, 128, "bfloat16", dict(causal=True), None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:8]
                                                                   + (c[9],))))
def test_matches_float64(case, rng):
  B, T, H, H_kv, D, cap, page, dtype, kw, splits = case
  args, extra, dense = _case(rng, B=B, T=T, H=H, H_kv=H_kv, D=D,
                             capacity=cap, page=page, dtype=dtype)
  fn = jax.jit(lambda *a: jax_flash.attention_with_kvcache(
      *a, **extra, **kw, return_lse=True, num_splits=splits,
      implementation="cuda"))
  assert "jax_flash_decode" in fn.lower(*args).as_text()
  o, lse = fn(*args)
  o64, l64, ox, lx = _references(dense, kw, dtype)
  assert_close_to_reference("out", o, o64, ox)
  assert_close_to_reference("lse", lse, l64, lx)


def test_appended_tokens_and_donation(rng):
  """k_new / v_new land in the cache (in place when donated), then count."""
  B, T, H, H_kv, D, cap = 3, 4, 8, 2, 128, 260
  seqlens = np.array([0, 100, cap - T], np.int32)
  args, extra, dense = _case(rng, B=B, T=T, H=H, H_kv=H_kv, D=D, capacity=cap,
                             page=64, dtype="bfloat16", seqlens=seqlens)
  q, k_seq, v_seq, _ = dense
  new = lambda: np.asarray(jnp.asarray(
      rng.standard_normal((B, T, H_kv, D)), jnp.bfloat16), np.float64)
  k_new, v_new = new(), new()
  step = jax.jit(lambda q, kc, vc, s, kn, vn: jax_flash.attention_with_kvcache(
      q, kc, vc, s, k_new=kn, v_new=vn, **extra), donate_argnums=(1, 2))
  o, kc, vc = step(*args, jnp.asarray(k_new, jnp.bfloat16),
                   jnp.asarray(v_new, jnp.bfloat16))
  for b in range(B):
    L = seqlens[b]
    k_seq[b, L:L + T], v_seq[b, L:L + T] = k_new[b], v_new[b]
  o64, _, ox, _ = _references((q, k_seq, v_seq, seqlens + T),
                              dict(causal=True), "bfloat16")
  assert_close_to_reference("out", o, o64, ox)
  table = np.asarray(extra["page_table"])
  got = np.asarray(kc, np.float64)
  for b in range(B):
    for t in range(T):
      p = seqlens[b] + t
      np.testing.assert_array_equal(got[table[b, p // 64], p % 64], k_new[b, t])


def test_append_kernel_writes_in_place(rng):
  """A cache whose row b is sequence b takes k_new / v_new from the append
  kernel (cuda/decode/decode_append.h) under a donated jit: the new tokens
  in their slots, every other slot as it was (NaN where nobody wrote), the
  token past the capacity dropped, the outputs over the appended keys."""
  B, T, H, H_kv, D, cap = 3, 2, 8, 4, 128, 200
  seqlens = np.array([0, 77, cap - 1], np.int32)  # row 2: one token dropped
  bf = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
  k_seq = np.full((B, cap, H_kv, D), np.nan)
  v_seq = np.full((B, cap, H_kv, D), np.nan)
  for b in range(B):
    k_seq[b, :seqlens[b]] = bf(rng.standard_normal((seqlens[b], H_kv, D)))
    v_seq[b, :seqlens[b]] = bf(rng.standard_normal((seqlens[b], H_kv, D)))
  q = bf(rng.standard_normal((B, T, H, D)))
  k_new = bf(rng.standard_normal((B, T, H_kv, D)))
  v_new = bf(rng.standard_normal((B, T, H_kv, D)))
  to = lambda x: jnp.asarray(x, jnp.bfloat16)
  step = jax.jit(lambda q, kc, vc, s, kn, vn: jax_flash.attention_with_kvcache(
      q, kc, vc, s, k_new=kn, v_new=vn, implementation="cuda"),
      donate_argnums=(1, 2))
  args = (to(q), to(k_seq), to(v_seq), jnp.asarray(seqlens), to(k_new),
          to(v_new))
  assert "jax_flash_decode_append" in step.lower(*args).as_text()
  o, kc, vc = step(*args)
  want_k, want_v = k_seq.copy(), v_seq.copy()
  for b in range(B):
    n = min(T, cap - seqlens[b])
    want_k[b, seqlens[b]:seqlens[b] + n] = k_new[b, :n]
    want_v[b, seqlens[b]:seqlens[b] + n] = v_new[b, :n]
  np.testing.assert_array_equal(np.asarray(kc, np.float64), want_k)
  np.testing.assert_array_equal(np.asarray(vc, np.float64), want_v)
  lengths = np.minimum(seqlens + T, cap)
  o64, _, ox, _ = _references((q, want_k, want_v, lengths),
                              dict(causal=True), "bfloat16")
  assert_close_to_reference("out", o, o64, ox)


def test_flax_decoding_steps_on_the_kernels(rng):
  """jff.SelfAttention(decode=True): a prompt, then single-token steps on
  the kernels (append + decode) against the same steps on xla."""
  import jax_flash.flax as jff
  batch, prompt, steps, features = 4, 70, 5, 256
  x = jnp.asarray(rng.standard_normal((batch, prompt + steps, features)),
                  jnp.bfloat16)

  def run(implementation):
    layer = jff.SelfAttention(num_heads=4, num_kv_heads=2, causal=True,
                              decode=True, dtype=jnp.bfloat16,
                              implementation=implementation)
    variables = layer.init(jax.random.key(0), x)
    params, cache = variables["params"], variables["cache"]

    @jax.jit
    def call(cache, chunk):
      y, upd = layer.apply({"params": params, "cache": cache}, chunk,
                           mutable=["cache"])
      return upd["cache"], y

    cache, y = call(cache, x[:, :prompt])
    ys = [y]
    for t in range(prompt, prompt + steps):
      cache, y = call(cache, x[:, t:t + 1])
      ys.append(y)
    return np.asarray(jnp.concatenate(ys, 1), np.float32), cache

  got, got_cache = run("cuda")
  want, want_cache = run("xla")
  np.testing.assert_array_equal(np.asarray(got_cache["cache_index"]),
                                np.asarray(want_cache["cache_index"]))
  for name in ("cached_key", "cached_value"):
    np.testing.assert_allclose(
        np.asarray(got_cache[name], np.float32),
        np.asarray(want_cache[name], np.float32), atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(got, want, atol=5e-2, rtol=5e-2)


def test_gradients_follow_the_reference_path(rng):
  """The kernels have no backward: grads come from the reference path."""
  args, extra, _ = _case(rng, B=2, T=2, H=4, H_kv=2, D=64, capacity=150,
                         page=None, dtype="bfloat16")

  def loss(impl):
    return lambda q, k, v: jnp.sum(jax_flash.attention_with_kvcache(
        q, k, v, args[3], **extra, implementation=impl).astype(jnp.float32))

  q, k, v = args[:3]
  k = jnp.nan_to_num(k)  # slots nobody reads: finite, for the cotangents
  v = jnp.nan_to_num(v)
  g_cuda = jax.grad(loss("cuda"), argnums=(0, 1, 2))(q, k, v)
  g_ref = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_cuda, g_ref):
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(b, np.float32), atol=2e-2)


@pytest.mark.parametrize("page", [None, 32])
def test_traced_lengths_out_of_range(rng, page):
  """Lengths past the capacity or below 0, traced: the kernels clamp them
  (no clip before the call), as the reference path does; gradients too."""
  cap = 150
  args, extra, _ = _case(rng, B=3, T=2, H=4, H_kv=2, D=64, capacity=cap,
                         page=page, dtype="bfloat16",
                         seqlens=np.full(3, cap))
  q, k, v = args[:3]
  k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
  lengths = jnp.array([cap + 37, -5, cap], jnp.int32)

  def run(impl):
    fn = lambda q, lens: jax_flash.attention_with_kvcache(
        q, k, v, lens, **extra, return_lse=True, implementation=impl)
    return jax.jit(fn)(q, lengths)

  (o_cuda, lse_cuda), (o_ref, lse_ref) = run("cuda"), run("xla")
  np.testing.assert_allclose(np.asarray(o_cuda, np.float32),
                             np.asarray(o_ref, np.float32), atol=2e-2)
  np.testing.assert_allclose(np.asarray(lse_cuda), np.asarray(lse_ref),
                             atol=2e-3)
  assert np.all(np.asarray(lse_cuda)[1] == -np.inf)  # no keys: lse = -inf

  def loss(impl):
    return lambda q, lens: jnp.sum(jax_flash.attention_with_kvcache(
        q, k, v, lens, **extra, implementation=impl).astype(jnp.float32))

  grad = lambda impl: np.asarray(
      jax.jit(jax.grad(loss(impl)))(q, lengths), np.float32)
  np.testing.assert_allclose(grad("cuda"), grad("xla"), atol=2e-2)


def test_vmap_and_split_policy(rng):
  args, extra, dense = _case(rng, B=2, T=1, H=8, H_kv=2, D=128, capacity=512,
                             page=None, dtype="bfloat16")
  fn = lambda q: jax_flash.attention_with_kvcache(q, *args[1:], **extra)
  qs = jnp.stack([args[0], args[0][::-1]])
  out = jax.vmap(fn)(qs)
  np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(fn(args[0])))
  # The policy splits a long cache of few sequences, not a full batch.
  assert decode_cuda.num_splits_for(1, 1, 32, 8, 128, 131072) > 8
  assert decode_cuda.num_splits_for(64, 1, 32, 8, 128, 4096) == 1


def test_refusals():
  q = jnp.zeros((1, 1, 4, 64), jnp.float32)
  k = jnp.zeros((1, 64, 2, 64), jnp.float32)
  with pytest.raises(jax_flash.Unsupported, match="dtype"):
    jax_flash.attention_with_kvcache(q, k, k, jnp.array([3]),
                                     implementation="cuda")
  qb = jnp.zeros((1, 1, 4, 36), jnp.bfloat16)
  kb = jnp.zeros((1, 64, 2, 36), jnp.bfloat16)
  with pytest.raises(jax_flash.Unsupported, match="multiple of 8"):
    jax_flash.attention_with_kvcache(qb, kb, kb, jnp.array([3]),
                                     implementation="cuda")
  # Empty batch: no launch, empty outputs.
  qe = jnp.zeros((0, 1, 4, 64), jnp.bfloat16)
  ke = jnp.zeros((0, 64, 2, 64), jnp.bfloat16)
  assert jax_flash.attention_with_kvcache(qe, ke, ke, jnp.zeros((0,),
                                          jnp.int32)).shape == qe.shape


FP8_CASES = [
    # B, T, H, H_kv, D, capacity, page, dtype, kw, rotate
    (4, 1, 32, 8, 128, 1000, 64, "bfloat16", dict(causal=True), False),
    (2, 8, 16, 4, 128, 520, None, "bfloat16", dict(causal=True), True),
    (2, 3, 8, 2, 64, 300, 16, "float16", dict(causal=True, window=(70, 0)),
     False),
    (1, 2, 4, 1, 256, 190, 32, "bfloat16", dict(causal=True, softcap=30.0),
     True),
]


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: "-".join(
    map(str, c[:8] + (c[9],))))
def test_fp8_cache_matches_float64(case, rng):
  """The kernels on an e4m3 cache against float64 attention on the same
  (dequantised) cache; baseline: same-dtype dense XLA on those values."""
  B, T, H, H_kv, D, cap, page, dtype, kw, rotate = case
  args, extra, dense = _case(rng, B=B, T=T, H=H, H_kv=H_kv, D=D,
                             capacity=cap, page=page, dtype=dtype)
  q, k_cache, v_cache, seqlens = args
  kq = jax_flash.quantize_kv_cache(k_cache, rotate=rotate, seed=5)
  vq = jax_flash.quantize_kv_cache(v_cache, rotate=rotate, seed=5)
  fn = jax.jit(lambda q, kq, vq, s: jax_flash.attention_with_kvcache(
      q, kq, vq, s, **extra, **kw, return_lse=True, implementation="cuda"))
  assert "jax_flash_decode" in fn.lower(q, kq, vq, seqlens).as_text()
  o, lse = fn(q, kq, vq, seqlens)
  # Each sequence's dequantised keys and values (rotated back).
  kd, vd = np.asarray(kq.dequantize()), np.asarray(vq.dequantize())
  if page:
    table = np.asarray(extra["page_table"])
    view = lambda c: c[table].reshape(B, -1, H_kv, D)
  else:
    rows = np.asarray(extra["cache_batch_idx"])
    view = lambda c: c[rows]
  q64 = np.asarray(q, np.float64)
  o64, l64, ox, lx = _references((q64, view(kd), view(vd),
                                  np.asarray(seqlens)), kw, dtype)
  # The FP8 path rounds q (rotated when the cache is) to fp16 for the
  # products: an atol for that on top of the 2x criterion.
  assert_close_to_reference("out", o, o64, ox, atol=2e-3)
  assert_close_to_reference("lse", lse, l64, lx, atol=2e-3)


SINK_CASES = [
    # B, T, H, H_kv, D, capacity, page, dtype, kw, num_splits
    (3, 1, 16, 4, 128, 700, 64, "bfloat16", dict(causal=True), 1),
    (3, 1, 16, 4, 128, 700, 64, "bfloat16", dict(causal=True), 4),
    (2, 6, 8, 2, 64, 333, None, "float16", dict(causal=True, window=(90, 0)),
     None),
]


@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: "-".join(map(
    str, c[:8] + (c[9],))))
def test_sinks_match_float64(case, rng):
  """Each head's sink enters every row once: in one split's finalize or in
  the combine of several; an empty sequence has O = 0 and LSE = the sink."""
  B, T, H, H_kv, D, cap, page, dtype, kw, splits = case
  seqlens = np.array([0] + [cap] + [cap // 3] * (B - 2), np.int32)
  args, extra, dense = _case(rng, B=B, T=T, H=H, H_kv=H_kv, D=D,
                             capacity=cap, page=page, dtype=dtype,
                             seqlens=seqlens)
  sinks = jnp.asarray(rng.normal(1.0, 2.0, H), jnp.float32)
  fn = jax.jit(lambda *a: jax_flash.attention_with_kvcache(
      *a, **extra, **kw, sinks=sinks, return_lse=True, num_splits=splits,
      implementation="cuda"))
  assert "jax_flash_decode" in fn.lower(*args).as_text()
  o, lse = fn(*args)
  o64, l64, ox, lx = _references(dense, dict(kw, sinks=np.asarray(sinks)),
                                 dtype)
  assert_close_to_reference("out", o, o64, ox)
  assert_close_to_reference("lse", lse, l64, lx)


def test_sinks_on_an_fp8_cache_and_their_gradient(rng):
  B, T, H, H_kv, D, cap = 2, 2, 8, 2, 128, 260
  args, extra, _ = _case(rng, B=B, T=T, H=H, H_kv=H_kv, D=D, capacity=cap,
                         page=32, dtype="bfloat16",
                         seqlens=np.array([0, 201], np.int32))
  q, k_cache, v_cache, seqlens = args
  kq, vq = (jax_flash.quantize_kv_cache(jnp.nan_to_num(c), seed=1)
            for c in (k_cache, v_cache))
  sinks = jnp.asarray(rng.normal(1.0, 2.0, H), jnp.float32)

  def loss(impl):
    def f(q, s):
      o, lse = jax_flash.attention_with_kvcache(
          q, kq, vq, seqlens, **extra, sinks=s, return_lse=True,
          num_splits=3, implementation=impl)
      return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(lse))
    return f

  lowered = jax.jit(loss("cuda")).lower(q, sinks).as_text()
  assert "jax_flash_decode" in lowered
  got = jax.jit(jax.value_and_grad(loss("cuda"), argnums=(0, 1)))(q, sinks)
  want = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1)))(q, sinks)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, atol=3e-2 * max(1.0, np.abs(b).max()))


@pytest.mark.parametrize("page", [None, 64], ids=["contiguous", "paged"])
def test_long_chunks_run_on_the_dense_kernels(page, rng, monkeypatch):
  """More than PREFILL_MIN_TOKENS new tokens: the dense forward kernels, no
  decoding kernel; float64 within the criterion, as the decoding kernels on
  the same chunk (forced)."""
  B, H, H_kv, D, cap = 2, 8, 2, 128, 700
  T = decode_cuda.PREFILL_MIN_TOKENS + 37
  seqlens = np.array([0, 411], np.int32)
  args, extra, dense = _case(rng, B=B, T=T, H=H, H_kv=H_kv, D=D,
                             capacity=cap, page=page, dtype="bfloat16",
                             seqlens=seqlens + T)
  q, k_cache, v_cache, _ = args
  kw = dict(causal=True, window=(300, 0))
  step = lambda *a: jax_flash.attention_with_kvcache(
      *a, **extra, **kw, return_lse=True, implementation="cuda")
  # The chunk's own keys are already in the cache (at seqlens[b] ...).
  lens = jnp.asarray(seqlens + T)
  text = jax.jit(step).lower(q, k_cache, v_cache, lens).as_text()
  assert ffi.FWD in text and ffi.DECODE not in text
  o64, l64, ox, lx = _references(dense, kw, "bfloat16")
  routed = jax.jit(step)(q, k_cache, v_cache, lens)
  monkeypatch.setattr(decode_cuda, "PREFILL_MIN_TOKENS", T)
  decoded = jax.jit(lambda *a: step(*a))(q, k_cache, v_cache, lens)
  for o, lse in (routed, decoded):
    assert_close_to_reference("out", o, o64, ox)
    assert_close_to_reference("lse", lse, l64, lx)
