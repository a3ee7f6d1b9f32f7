"""jax_flash.ring_attention: sequence-sharded attention over the 8 host devices.

Forward (o and lse) and gradients (through o and lse) against the float64
reference (the project's error criterion, tests/reference.py) and against the
unsharded `jax_flash.attention`; meshes (8,) seq-only and (2, 4) batch x seq
(and heads x seq); causal / non-causal, contiguous / zigzag layouts, GQA,
segment ids with fully masked rows; sliding windows (left, right, both,
with causal, GQA and segment ids, sizes that cut chunks mid-way, the static
step plan that skips steps); the plan's kernel calls without a window; the
zigzag permutation; the jit +
NamedSharding entry and the inside-shard_map entry; the Pallas backend on a
tiny shape (interpret mode on CPU); argument errors.
"""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flash
import reference
import ring_helpers
from jax_flash._src.core import masking
from jax_flash._src.ring import api as ring
from jax_flash._src.ring import plan as ring_plan
from jax_flash._src.ring import zigzag
from jax_flash._src.core.spec import AttentionSpec

_need = ring_helpers.need
_mesh = ring_helpers.mesh
_weights = ring_helpers.weights
_loss = ring_helpers.loss
_fwd_and_grads = ring_helpers.fwd_and_grads


# B, T, H, H_kv, D: GQA; T divisible by 2 * 8 (zigzag over 8 devices).
SHAPE = (2, 48, 4, 2, 16)
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _ieee_float32():
  with jax.default_matmul_precision("highest"):
    yield


def _qkv(rng, shape=SHAPE, dtype=jnp.float32):
  B, T, H, Hk, D = shape
  mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)
  return mk(B, T, H, D), mk(B, T, Hk, D), mk(B, T, Hk, D)


def _segments(rng, B, T):
  """Packed segments; q ids 7 never occur in kv: those rows see no key."""
  q_seg = np.sort(rng.integers(0, 3, (B, T)), axis=1)
  kv_seg = q_seg.copy()
  q_seg[:, T // 3:T // 3 + 3] = 7
  return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)


def _check_vs_reference(got, q, k, v, **kw):
  (o, lse), grads = got
  ref_o, ref_lse = reference.attention(q, k, v, **kw)
  # The same-dtype dense XLA baseline of the error criterion (jitted: eager
  # op-by-op dispatch of it and its gradient costs seconds per test).
  dense = functools.partial(reference.dense_attention_jax, **kw)
  (base_o, base_lse), base_g = jax.jit(
      functools.partial(_fwd_and_grads, dense))(q, k, v)
  reference.assert_close_to_reference("o", o, ref_o, base_o)
  reference.assert_close_to_reference("lse", lse, ref_lse, base_lse)
  dlse = np.where(np.isfinite(ref_lse), 0.1, 0.0)
  ref_g = reference.attention_vjp(q, k, v, np.asarray(_weights(o.shape)),
                                  dlse=dlse, **kw)
  for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref_g, base_g):
    reference.assert_close_to_reference(name, g, r, b)


def _close(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape)
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    fin = np.isfinite(y)
    np.testing.assert_array_equal(x[~fin], y[~fin])
    np.testing.assert_allclose(x[fin], y[fin], **(tol or TOL))


@pytest.mark.parametrize("mesh_name,causal,layout,segments,extra", [
    ("seq8", False, None, True, {}),
    ("seq8", True, "contiguous", True, dict(softcap=2.5, scale=0.3)),
    ("batch2_seq4", True, "zigzag", True, {}),
    ("heads2_seq4", True, "zigzag", False, dict(softcap=3.0)),
])
@pytest.mark.slow
def test_matches_reference_and_unsharded(mesh_name, causal, layout, segments,
                                         extra, rng):
  """jit on NamedSharding inputs: o, lse and grads vs float64 and vs
  unsharded jax_flash.attention (GQA; softcap and scale pass through)."""
  mesh, axes, spec = _mesh(mesh_name)
  q, k, v = _qkv(rng)
  B, T = q.shape[:2]
  segs = _segments(rng, B, T) if segments else None
  kw = dict(causal=causal, **extra)
  if segments:
    kw["segment_ids"] = segs

  def ring_attn(q, k, v):
    return jax_flash.ring_attention(q, k, v, mesh=mesh, layout=layout,
                                    return_lse=True, **axes, **kw)

  def plain(q, k, v):
    return jax_flash.attention(q, k, v, return_lse=True, **kw)

  sh = NamedSharding(mesh, spec)
  qs, ks, vs = (jax.device_put(x, sh) for x in (q, k, v))
  got = jax.jit(functools.partial(_fwd_and_grads, ring_attn))(qs, ks, vs)
  assert got[0][0].sharding.spec[:2] == spec[:2] or len(
      got[0][0].sharding.device_set) == 8
  _check_vs_reference(got, q, k, v, **kw)
  _close(got, jax.jit(functools.partial(_fwd_and_grads, plain))(q, k, v))


# Local chunk 6 (contiguous) or 3 (zigzag) on 8 devices, 12 / 6 on 4: the
# windows cut chunks mid-way, span several chunks, or cover everything.
@pytest.mark.parametrize("mesh_name,window,causal,layout,segments", [
    ("seq8", (5, -1), False, None, False),  # left only: zigzag by default
    ("seq8", (5, -1), False, "contiguous", True),
    ("seq8", (7, 3), False, None, True),  # a band: contiguous by default
    ("seq8", (-1, 4), False, None, False),  # right only
    ("seq8", (0, 0), False, None, True),  # the diagonal alone
    ("seq8", (100, 100), False, None, False),  # wider than the sequence
    ("batch2_seq4", (11, -1), True, None, True),  # local causal attention
    ("batch2_seq4", (13, 0), False, "zigzag", False),  # the same, by window
    ("heads2_seq4", (17, 2), True, "contiguous", False),  # causal caps right
    ("heads2_seq4", (29, 1), False, "zigzag", True),
])
@pytest.mark.slow
def test_window_matches_reference_and_unsharded(mesh_name, window, causal,
                                                layout, segments, rng):
  """Sliding windows: o, lse and grads vs float64 and vs unsharded
  jax_flash.attention (GQA; segment ids with rows that see no key)."""
  test_matches_reference_and_unsharded(
      mesh_name, causal, layout, segments, dict(window=window), rng)


@pytest.mark.parametrize("window,zigzag,shifts", [
    ((3, 0), False, (0, 1)),  # only the previous chunk
    ((6, 0), False, (0, 1)),  # exactly one chunk back
    ((7, 0), False, (0, 1, 2)),
    ((7, 3), False, (0, 1, 2, 7)),  # and the next chunk (wraps to shift 7)
    ((0, 0), False, (0,)),
    ((3, 0), True, (0, 1, 7)),  # zigzag: neighbours on both sides
])
def test_window_plan_skips_steps(window, zigzag, shifts):
  """The static plan keeps only the steps in which some device sees a key
  (8 devices, local length 6)."""
  spec = AttentionSpec(scale=1.0, q_len=6, kv_len=6, window_left=window[0],
                       window_right=window[1])
  steps = ring_plan.plan(spec, 8, zigzag)
  assert tuple(s.shift for s in steps) == shifts
  for step in steps:  # the table covers every device with a known case
    assert len(step.table) == 8 and max(step.table) < len(step.cases)


@pytest.mark.parametrize("window,zigzag", [
    ((-1, -1), False), ((-1, -1), True), ((-1, 0), False), ((-1, 0), True)])
def test_plan_without_window_is_one_call_per_step(window, zigzag):
  """Full and plain causal attention on the general plan cost what a
  dedicated ring would: every step, at most one kernel call per device,
  of the sizes the zigzag argument promises (chunk c: causal 2c x 2c at
  step 0, then c x 2c or 2c x c), the diagonal bottom-right aligned."""
  n, L = 8, 6
  spec = AttentionSpec(scale=1.0, q_len=L, kv_len=L, window_left=window[0],
                       window_right=window[1])
  steps = ring_plan.plan(spec, n, zigzag)
  assert tuple(s.shift for s in steps) == tuple(range(n))
  assert len(ring_plan.runs(steps[1:])) == 1  # steps 1.. are one loop
  (step0,) = steps[0].cases
  (diag,) = ring_plan.calls(step0)
  assert (diag.q0, diag.k0, diag.spec.q_len, diag.spec.kv_len) == (0, 0, L, L)
  assert diag.spec.window_right == window[1] and diag.spec.q_offset is None
  sizes = set()
  for case in steps[1].cases:
    got = ring_plan.calls(case)
    assert len(got) <= 1 and all(not c.spec.has_window for c in got)
    sizes |= {(c.spec.q_len, c.spec.kv_len) for c in got}
  c = L // 2
  expected = ({(L, L)} if window[1] == -1 else
              {(c, L), (L, c)} if zigzag else {(L, L)})
  assert sizes == expected


def test_plan_calls_cover_exactly_the_visible_pairs():
  """Brute force over windows, ring sizes and layouts: at every step, the
  kernel calls of each device's case see exactly the (query, key) pairs the
  global window allows, each once, and the plan drops only steps in which no
  device sees a key."""
  size = 3
  for (wl, wr), n, zigzag in itertools.product(
      ((-1, -1), (-1, 0), (4, 0), (2, 5), (0, 0), (7, -1), (-1, 3), (9, 9)),
      (1, 2, 3, 4), (False, True)):
    m = 2 if zigzag else 1
    spec = AttentionSpec(scale=1.0, q_len=m * size, kv_len=m * size,
                         window_left=wl, window_right=wr)
    steps = {s.shift: s for s in ring_plan.plan(spec, n, zigzag)}
    for shift, j in itertools.product(range(n), range(n)):
      pos = lambda dev: np.concatenate([
          np.arange(ch * size, (ch + 1) * size)
          for ch in ring_plan.chunks_of(dev, n, zigzag)])
      qp, kp = pos(j)[:, None], pos((j - shift) % n)[None, :]
      want = ((wl == -1) | (kp >= qp - wl)) & ((wr == -1) | (kp <= qp + wr))
      seen = np.zeros(want.shape, int)
      if shift in steps:
        step = steps[shift]
        for c in ring_plan.calls(step.cases[step.table[j]]):
          rows = np.arange(c.q1 * size - c.q0 * size)[:, None]
          cols = np.arange(c.k1 * size - c.k0 * size)[None, :]
          seen[c.q0 * size:c.q1 * size, c.k0 * size:c.k1 * size] += np.asarray(
              masking.visible(c.spec, rows, cols))
      np.testing.assert_array_equal(seen, want.astype(int),
                                    err_msg=f"{(wl, wr, n, zigzag, shift, j)}")


def test_window_skipped_steps_move_no_data(rng):
  """A window of one chunk back: the forward moves k and v once (not n - 1
  times), and the backward once more plus dK/dV home."""
  mesh, axes, _ = _mesh("seq8")
  q, k, v = _qkv(rng)
  attn = functools.partial(jax_flash.ring_attention, mesh=mesh, window=(3, 0),
                           **axes)
  count = lambda f: len(re.findall(
      r"collective-permute(-start)?\(",
      jax.jit(f).lower(q, k, v).compile().as_text()))
  grad = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)), argnums=(0, 1, 2))
  assert count(attn) == 2
  assert count(grad) == 6


def test_zigzag_permutation_round_trips(rng):
  _need(8)
  n, T = 8, 48
  x = jnp.asarray(rng.standard_normal((2, T, 3)), jnp.float32)
  idx = zigzag.zigzag_indices(T, n)
  c = T // (2 * n)
  # device i holds chunks i and 2n-1-i
  assert list(idx[:2 * c]) == list(range(c)) + list(range(T - c, T))
  z = zigzag.zigzag_permute(x, n)
  np.testing.assert_array_equal(zigzag.zigzag_unpermute(z, n), x)
  # The in-shard_map reordering (two ppermutes) equals the global one, and
  # its inverse round-trips.
  mesh = Mesh(np.array(jax.devices()[:n]), ("s",))
  to = jax.shard_map(lambda x: zigzag.local_to_zigzag(x, "s", n, 1), mesh=mesh,
                     in_specs=P(None, "s"), out_specs=P(None, "s"))
  back = jax.shard_map(lambda x: zigzag.local_from_zigzag(x, "s", n, 1),
                       mesh=mesh, in_specs=P(None, "s"),
                       out_specs=P(None, "s"))
  np.testing.assert_array_equal(jax.jit(to)(x), z)
  np.testing.assert_array_equal(jax.jit(back)(z), x)


@pytest.mark.parametrize("mesh_name,layout,window", [
    ("batch2_seq4", "zigzag_preordered", None),
    ("batch2_seq4", "contiguous", None),
    ("batch2_seq4", "zigzag_preordered", (9, 2)),
    ("batch2_seq4", "contiguous", (4, -1)),
    ("seq8", "contiguous", (30, -1)),  # steps 1-4 alike: a fori_loop
])
@pytest.mark.slow
def test_inside_shard_map(mesh_name, layout, window, rng):
  """mesh=None: called on local shards inside the user's shard_map (which
  checks that loop and switch branches vary alike over the ring axis); with
  "zigzag_preordered" the user keeps the sequence in zigzag order."""
  mesh, axes, spec = _mesh(mesh_name)
  n = mesh.shape["s"]
  q, k, v = _qkv(rng)
  segs = _segments(rng, *q.shape[:2])
  pre = layout == "zigzag_preordered"
  perm = (lambda x, a=1: zigzag.zigzag_permute(x, n, a)) if pre else (
      lambda x, a=1: x)
  unperm = (lambda x, a=1: zigzag.zigzag_unpermute(x, n, a)) if pre else (
      lambda x, a=1: x)

  def local(q, k, v, qs, ks):
    return jax_flash.ring_attention(q, k, v, seq_axis="s", causal=True,
                                    window=window, segment_ids=(qs, ks),
                                    layout=layout, return_lse=True)

  qkv = P(*spec[:2])
  attn_sm = jax.shard_map(local, mesh=mesh, in_specs=(qkv,) * 5,
                          out_specs=(qkv, P(spec[0], None, "s")))

  def attn(q, k, v):
    o, lse = attn_sm(perm(q), perm(k), perm(v), perm(segs[0]), perm(segs[1]))
    return unperm(o), unperm(lse, 2)

  got = jax.jit(functools.partial(_fwd_and_grads, attn))(q, k, v)
  _check_vs_reference(got, q, k, v, causal=True, window=window,
                      segment_ids=segs)


def test_sharded_inputs_stay_sharded_no_all_gather(rng):
  """The compiled program only moves kv chunks (collective-permute): no
  all-gather of q/k/v, and the output keeps the input sharding."""
  mesh, axes, spec = _mesh("batch2_seq4")
  q, k, v = _qkv(rng)
  sh = NamedSharding(mesh, P("b", "s", None, None))
  qs, ks, vs = (jax.device_put(x, sh) for x in (q, k, v))
  attn = functools.partial(jax_flash.ring_attention, mesh=mesh, causal=True,
                           return_lse=True, **axes)
  f = jax.jit(functools.partial(_fwd_and_grads, attn))
  compiled = f.lower(qs, ks, vs).compile()
  text = compiled.as_text()
  assert "collective-permute" in text
  assert "all-gather" not in text
  (o, _), grads = compiled(qs, ks, vs)
  assert o.sharding.is_equivalent_to(sh, 4)
  assert grads[1].sharding.is_equivalent_to(sh, 4)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(3, 1))])
def test_eager_call_and_single_device_axis(kw, rng):
  """Eager (no jit) works, and a ring of size 1 is plain attention."""
  devs = jax.devices()
  q, k, v = _qkv(rng, shape=(2, 16, 2, 2, 8))
  mesh = Mesh(np.array(devs[:1]), ("s",))
  o = jax_flash.ring_attention(q, k, v, mesh=mesh, seq_axis="s", **kw)
  _close(o, jax_flash.attention(q, k, v, **kw))


@pytest.mark.parametrize("n,kw", [
    (2, dict(causal=True)),
    (4, dict(window=(5, 2))),  # cuts the 4-row chunks; both directions
    (4, dict(window=(3, -1), causal=True, layout="zigzag")),
])
@pytest.mark.slow
def test_pallas_backend_tiny(n, kw, rng):
  """The per-step kernels from the Pallas backend (interpret mode on CPU)."""
  if "pallas" not in jax_flash.available_implementations():
    pytest.skip("pallas backend not registered")
  _need(n)
  mesh = Mesh(np.array(jax.devices()[:n]), ("s",))
  q, k, v = _qkv(rng, shape=(1, 4 * n, 2, 1, 32))
  attn = functools.partial(jax_flash.ring_attention, mesh=mesh, seq_axis="s",
                           return_lse=True, implementation="pallas", **kw)
  got = jax.jit(functools.partial(_fwd_and_grads, attn))(q, k, v)
  kw.pop("layout", None)
  _check_vs_reference(got, q, k, v, **kw)


@pytest.mark.parametrize("kwargs,shape,match", [
    (dict(), (1, 48, 2, 2, 8), "T == S"),
    (dict(causal=True), (1, 40, 2, 2, 8), "divisible by 16"),
    (dict(layout="contiguous"), (1, 44, 2, 2, 8), "divisible by 8"),
    (dict(layout="ring"), (1, 48, 2, 2, 8), "layout"),
    (dict(seq_axis="x"), (1, 48, 2, 2, 8), "not an axis"),
    (dict(implementation="nope"), (1, 48, 2, 2, 8), "implementation"),
    (dict(scale=float("nan")), (1, 48, 2, 2, 8), "scale"),
    (dict(window=(3,)), (1, 48, 2, 2, 8), "window"),
    (dict(window=(-2, 3)), (1, 48, 2, 2, 8), "window"),
])
def test_errors(kwargs, shape, match, rng):
  mesh, axes, _ = _mesh("seq8")
  q, k, v = _qkv(rng, shape=shape)
  if match == "T == S":
    k, v = k[:, :32], v[:, :32]
  kw = dict(axes, mesh=mesh)
  kw.update(kwargs)
  with pytest.raises(ValueError, match=match):
    jax_flash.ring_attention(q, k, v, **kw)


@pytest.mark.parametrize("name", ["causal", "return_lse"])
def test_bool_options_need_a_bool(name, rng):
  mesh, axes, _ = _mesh("seq8")
  q, k, v = _qkv(rng, shape=(1, 48, 2, 2, 8))
  with pytest.raises(TypeError, match=rf"{name} must be a Python bool, got "
                     r"'yes' \(str\)"):
    jax_flash.ring_attention(q, k, v, mesh=mesh, **axes, **{name: "yes"})


def test_errors_heads_and_outside_shard_map(rng):
  mesh, axes, _ = _mesh("heads2_seq4")
  q, k, v = _qkv(rng, shape=(1, 32, 4, 1, 8))  # 1 kv head over 2 devices
  with pytest.raises(ValueError, match="divisible"):
    jax_flash.ring_attention(q, k, v, mesh=mesh, **axes)
  with pytest.raises(ValueError, match="inside a jax.shard_map"):
    jax_flash.ring_attention(q, k, v, seq_axis="s")


def _use_mesh(mesh):
  if hasattr(jax, "set_mesh"):
    return jax.set_mesh(mesh)
  return jax.sharding.use_mesh(mesh)


def test_explicit_mesh_axes(rng):
  """Explicit mesh axes (jax.make_mesh's default): inputs sharded otherwise
  than P(batch, seq) are resharded onto the ring; output is seq-sharded."""
  _need(8)
  mesh = jax.make_mesh((2, 4), ("b", "s"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  q, k, v = _qkv(rng, shape=(2, 32, 4, 2, 8))
  attn = functools.partial(jax_flash.ring_attention, mesh=mesh, seq_axis="s",
                           batch_axis="b", causal=True, return_lse=True)
  plain = functools.partial(jax_flash.attention, causal=True, return_lse=True)
  expected = jax.jit(functools.partial(_fwd_and_grads, plain))(q, k, v)
  with _use_mesh(mesh):
    sh = NamedSharding(mesh, P("b", None))  # not sequence-sharded
    qs, ks, vs = (jax.device_put(x, sh) for x in (q, k, v))
    got = jax.jit(functools.partial(_fwd_and_grads, attn))(qs, ks, vs)
  _close(got, expected)
  assert tuple(got[0][0].sharding.spec)[:2] == ("b", "s")


@pytest.mark.parametrize("mesh_name,layout", [("seq8", "contiguous"),
                                              ("batch2_seq4", "zigzag")])
def test_packed_documents_skip_calls_they_do_not_cross(mesh_name, layout,
                                                       rng):
  """Packed documents of random lengths over 8 and 4 sequence shards: exact
  against the unsharded call (o, lse, grads), and the per-call skip (ids
  whose ranges do not meet) is in the program."""
  mesh, axes, spec = _mesh(mesh_name)
  q, k, v = _qkv(rng)
  B, T = q.shape[:2]
  ids = np.zeros((B, T), np.int32)
  for b in range(B):  # documents of 1..13 tokens, in order
    cuts = np.cumsum(rng.integers(1, 14, T))
    ids[b] = np.searchsorted(cuts, np.arange(T), side="right")
  seg = jnp.asarray(ids)
  kw = dict(causal=True, segment_ids=seg)

  def ring_attn(q, k, v):
    return jax_flash.ring_attention(q, k, v, mesh=mesh, layout=layout,
                                    return_lse=True, **axes, **kw)

  def plain(q, k, v):
    return jax_flash.attention(q, k, v, return_lse=True, **kw)

  sh = NamedSharding(mesh, spec)
  qs, ks, vs = (jax.device_put(x, sh) for x in (q, k, v))
  step = jax.jit(functools.partial(_fwd_and_grads, ring_attn))
  assert "conditional" in step.lower(qs, ks, vs).as_text("hlo")
  got = step(qs, ks, vs)
  _close(got, jax.jit(functools.partial(_fwd_and_grads, plain))(q, k, v))


def test_ids_can_meet():
  from jax_flash._src.ring.steps import ids_can_meet
  a = jnp.array([[0, 0, 1, 1]])
  assert bool(ids_can_meet(a, jnp.array([[1, 2, 2, 3]])))
  assert not bool(ids_can_meet(a, jnp.array([[2, 2, 3, 3]])))
  assert not bool(ids_can_meet(jnp.array([[5, 6]]), a))
  # Per batch row: row 0 apart, row 1 meets.
  assert bool(ids_can_meet(jnp.array([[0, 1], [4, 5]]),
                           jnp.array([[2, 3], [5, 6]])))
  assert not bool(ids_can_meet(jnp.array([[0, 1], [4, 5]]),
                               jnp.array([[2, 3], [6, 7]])))


@pytest.mark.parametrize("mesh_name,kw", [
    ("seq8", dict(causal=True)),
    ("batch2_seq4", dict(causal=False, window=(7, 3), segments=True)),
    ("heads2_seq4", dict(causal=True, layout="contiguous")),
])
def test_all_gather_strategy_matches_the_ring(mesh_name, kw, rng):
  """strategy="all_gather": the same o, lse and gradients as the ring (and
  the unsharded call), with one all-gather and one reduce-scatter."""
  mesh, axes, spec = _mesh(mesh_name)
  q, k, v = _qkv(rng)
  kw = dict(kw)
  if kw.pop("segments", False):
    kw["segment_ids"] = _segments(rng, *q.shape[:2])

  def make(strategy):
    return lambda q, k, v: jax_flash.ring_attention(
        q, k, v, mesh=mesh, return_lse=True, strategy=strategy, **axes, **kw)

  sh = NamedSharding(mesh, spec)
  qs, ks, vs = (jax.device_put(x, sh) for x in (q, k, v))
  step = jax.jit(functools.partial(_fwd_and_grads, make("all_gather")))
  hlo = step.lower(qs, ks, vs).compile().as_text()
  assert "all-gather" in hlo and "reduce-scatter" in hlo
  got = step(qs, ks, vs)
  ring = jax.jit(functools.partial(_fwd_and_grads, make("ring")))(qs, ks, vs)
  _close(got, ring)
  plain_kw = {k_: v_ for k_, v_ in kw.items() if k_ != "layout"}
  plain = jax.jit(functools.partial(_fwd_and_grads, lambda q, k, v: (
      jax_flash.attention(q, k, v, return_lse=True, **plain_kw))))(q, k, v)
  _close(got, plain)


def test_unknown_strategy_is_refused(rng):
  mesh, axes, _ = _mesh("seq8")
  q, k, v = _qkv(rng)
  with pytest.raises(ValueError, match="strategy must be one of"):
    jax_flash.ring_attention(q, k, v, mesh=mesh, strategy="tree", **axes)


def test_sharded_flax_example_trains(monkeypatch):
  """examples/sharded_attention.py on the (data, seq) mesh of 8 host
  devices: the ring model equals the unsharded one, and it trains."""
  _need(8)
  import importlib.util
  import pathlib
  import sys
  path = (pathlib.Path(__file__).resolve().parents[1] / "examples" /
          "sharded_attention.py")
  spec = importlib.util.spec_from_file_location("sharded_example", path)
  mod = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "sharded_example", mod)
  spec.loader.exec_module(mod)
  assert mod.main(["--implementation", "xla", "--batch", "2", "--seq", "64",
                   "--train-steps", "12"]) == 0
