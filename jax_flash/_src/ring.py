"""Ring attention: exact attention over sequence-sharded q/k/v.

Each device of the mesh axis `seq_axis` (size n) holds one chunk of the
queries and one chunk of the keys/values. The kv chunks travel around the
ring (`lax.ppermute`, i -> i+1) for n steps; at every step each device runs
the chosen backend's *forward kernel* on its own q chunk against the kv chunk
it holds, and folds the partial result into its running (o, lse) with the
online-softmax merge

    lse = logaddexp(lse_a, lse_b),  o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b

so no device ever holds more than two kv chunks (the current one and the next
one in flight). The ppermute of the next kv chunk is issued before the compute
on the current one, so XLA can overlap communication with compute.

Backward (one `jax.custom_vjp` around the whole local ring): delta =
rowsum(dO * O) - dLSE is computed once; k/v go around the ring again, and at
every step the backend's *backward kernel* runs on (local q, current kv) with
the *global* lse and delta. Since P = exp(S - lse_global) blockwise, the
per-block dQ, dK, dV are exactly the block's share of the true gradients: dQ
accumulates locally, dK/dV accumulate in buffers that travel with their kv
chunk and are back on their home device after n rotations.

Causal masking needs only two kernel variants, because a whole kv chunk is
either fully visible from a q chunk (it lies entirely before), "diagonal" (the
same chunk: causal with T_local == S_local), or invisible (skipped: it adds
nothing, lse = -inf). With the natural ("contiguous") layout the device that
holds the last chunk does n times the work of the first one. The "zigzag"
layout fixes that: the sequence is cut into 2n chunks and device i holds
chunks i and 2n-1-i. Then every step costs every device the same
(c x 2c for chunk length c):
  step 0 (own kv):    causal over the local 2c queries/keys (both diagonals
                      plus one full block; in local order the mask is plain
                      causal);
  kv from a device j < i: all local queries see the first kv chunk only;
  kv from a device j > i: only the second local q chunk sees both kv chunks.
The device-dependent choice is a `lax.cond` on `axis_index`.

With `layout="zigzag"` the user still passes naturally ordered arrays; they
are reordered inside the shard_map with two ppermutes per tensor (each moves
half of the local shard), and the output is put back the same way. That costs
about one ring step of communication per tensor and no compute; for causal
attention it pays for itself as soon as n > 2 or so. Models that keep their
activations in zigzag order throughout can skip it: `zigzag_permute` /
`zigzag_unpermute` here are the (global-array) permutations, and
`layout="zigzag_preordered"` says the inputs are already in that order
(the output then is too).

Precision: partial (o, lse) are merged in float32 (float64 for float64
inputs); per-step dQ/dK/dV come back from the kernels in the input dtype and
are summed in float32, so for bf16 inputs the gradients see one bf16 rounding
per ring step more than a single-device kernel would.

Sliding windows (`window=(left, right)`, with or without causal) take
another route, ring_plan.py + ring_band.py: every (q chunk, kv chunk) pair
of every step has a static position offset (`AttentionSpec.q_offset`), so
steps that no device needs are skipped at trace time, communication
included, and each device picks its case of a step with a `lax.switch`.
The default layout is zigzag when exactly one side of the (causal-folded)
window is unbounded (plain causal and the like: triangular work), else
contiguous (a band is balanced already, and each device then needs only
the chunks of a few neighbours). Plain causal keeps the path above: its
two-variant structure is smaller to compile than the general plan.

Not supported (yet): T != S (use `jax_flash.attention`), ring axes made of
several mesh axes, and skipping the zigzag permutation's communication for
the non-causal case is automatic only through the default `layout=None`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_flash._src import backends, checks, ring_band, ring_plan, softmax
from jax_flash._src.spec import UNBOUNDED, AttentionSpec

LAYOUTS = ("zigzag", "contiguous", "zigzag_preordered")
NEG_INF = float("-inf")


def ring_attention(query, key, value, *, mesh=None, seq_axis: str,
                   causal: bool = False, scale: float | None = None,
                   window: tuple[int, int] | None = None,
                   softcap: float | None = None, segment_ids=None,
                   return_lse: bool = False,
                   implementation: str | None = None,
                   batch_axis=None, head_axis=None, layout: str | None = None):
  """Exact attention of q/k/v sharded along the sequence over `seq_axis`.

  Args:
    query, key, value: [B, T, H, D] and [B, S, H_kv, D] (H % H_kv == 0), with
      T == S. With `mesh` given, these are global arrays (sharded or not:
      `jax.shard_map` places them as `P(batch_axis, seq_axis, head_axis)`);
      with `mesh=None` the call must be inside a `jax.shard_map` in which
      `seq_axis` is a manual axis, and the arrays are the local shards.
    mesh: the `jax.sharding.Mesh`, or None inside a shard_map (see above).
    seq_axis: mesh axis name the sequence is sharded over (the ring).
    causal: causal mask over the global sequence.
    scale: multiplier of q.k; default 1/sqrt(D).
    window: (left, right) sliding window over the global sequence, -1 =
      unbounded on that side: query i sees keys [i - left, i + right]
      (right capped at 0 by `causal`). Ring steps in which no device sees a
      key are skipped, communication included.
    softcap: if set, scores become softcap * tanh(scores / softcap).
    segment_ids: one integer array [B, T], or (q_ids, kv_ids), sharded like
      the sequence; attention only within equal ids.
    return_lse: also return the natural-log logsumexp [B, H, T].
    implementation: backend for the per-step kernels ("cuda", "pallas",
      "xla" or None for the best available).
    batch_axis, head_axis: mesh axes (or None) the batch / heads are sharded
      over as well (global entry only); heads need H and H_kv divisible.
    layout: "zigzag" (inputs in natural order, reordered internally for
      causal load balance), "contiguous" (no reordering; causal work is
      unbalanced), "zigzag_preordered" (the sequence axis of inputs and
      outputs is already in zigzag order, see `zigzag_permute`). Default:
      "zigzag" when exactly one side of the causal-folded window is
      unbounded (causal: triangular work), else "contiguous" (full or banded
      work is balanced anyway).

  Returns:
    out [B, T, H, D] in query.dtype, or (out, lse) if return_lse.
  """
  q, k, v = query, key, value
  _check_arrays(q, k, v)
  win = checks.window_fields(window, causal)
  if layout is None:
    one_sided = ((win["window_left"] == UNBOUNDED) !=
                 (win["window_right"] == UNBOUNDED))
    layout = "zigzag" if one_sided else "contiguous"
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS} or None, got "
                     f"{layout!r}")
  if not isinstance(seq_axis, str):
    raise ValueError(f"seq_axis must be one mesh axis name (a string), got "
                     f"{seq_axis!r}")
  if implementation is not None and not isinstance(implementation, str):
    raise ValueError(f"implementation must be a string or None, got "
                     f"{implementation!r}")
  B, T, H, D = q.shape
  H_kv = k.shape[2]
  q_seg, kv_seg = checks.check_segment_ids(segment_ids, q.shape[:1],
                                        q.shape[1], k.shape[1]) or (None, None)

  if mesh is None:
    for name, ax in (("batch_axis", batch_axis), ("head_axis", head_axis)):
      if ax is not None:
        raise ValueError(f"{name} is only used with `mesh`; inside a "
                         "shard_map the arrays are already the local shards")
    try:
      n = lax.axis_size(seq_axis)
    except Exception as e:  # NameError / unbound axis
      raise ValueError(
          f"ring_attention(mesh=None) must run inside a jax.shard_map where "
          f"seq_axis={seq_axis!r} is a manual mesh axis") from e
    n_b = n_h = 1
    platform = backends.default_platform()
  else:
    names = tuple(mesh.axis_names)
    for name, ax in (("seq_axis", seq_axis), ("batch_axis", batch_axis),
                     ("head_axis", head_axis)):
      if ax is not None and ax not in names:
        raise ValueError(f"{name}={ax!r} is not an axis of the mesh; axes: "
                         f"{names}")
    if len({a for a in (seq_axis, batch_axis, head_axis) if a is not None}) != \
        len([a for a in (seq_axis, batch_axis, head_axis) if a is not None]):
      raise ValueError("seq_axis, batch_axis and head_axis must be distinct")
    n = mesh.shape[seq_axis]
    n_b = mesh.shape[batch_axis] if batch_axis is not None else 1
    n_h = mesh.shape[head_axis] if head_axis is not None else 1
    if B % n_b:
      raise ValueError(f"batch {B} is not divisible by the size {n_b} of "
                       f"batch_axis={batch_axis!r}")
    if H % n_h or H_kv % n_h:
      raise ValueError(f"query heads {H} and key/value heads {H_kv} must both "
                       f"be divisible by the size {n_h} of "
                       f"head_axis={head_axis!r}")
    platform = next(iter(mesh.devices.flat)).platform
  zigzag = layout != "contiguous"
  parts = 2 * n if zigzag else n
  if mesh is not None and T % parts:
    raise ValueError(
        f"sequence length {T} must be divisible by {parts} ("
        f"{'2 x ' if zigzag else ''}the size {n} of seq_axis={seq_axis!r}"
        f"{' for the zigzag layout' if zigzag else ''})")
  if mesh is None and zigzag and T % 2:
    raise ValueError(f"the zigzag layout needs an even local sequence length "
                     f"(2 chunks per device); got {T}")

  local = AttentionSpec(
      scale=checks.check_scale(scale, D), causal=False,
      softcap=checks.check_softcap(softcap), has_segment_ids=q_seg is not None,
      batch=B // n_b, q_len=T // (n if mesh is not None else 1),
      kv_len=T // (n if mesh is not None else 1), num_heads=H // n_h,
      num_kv_heads=H_kv // n_h, head_dim=D, dtype=jnp.dtype(q.dtype).name)
  check_spec = dataclasses.replace(local, causal=bool(causal), **win)
  backend = backends.choose(check_spec, implementation, platform)
  ring = _Ring(backend.name, local, seq_axis, n, zigzag, layout == "zigzag",
               win["window_left"], win["window_right"])
  segs = () if q_seg is None else (q_seg.astype(jnp.int32),
                                   kv_seg.astype(jnp.int32))
  body = functools.partial(_local_entry, ring)
  if mesh is None:
    o, lse = body(q, k, v, *segs)
  else:
    qkv = P(batch_axis, seq_axis, head_axis, None)
    seg = P(batch_axis, seq_axis)
    if _has_explicit_axes(mesh):
      # shard_map over explicit axes takes inputs only in its in_specs.
      put = lambda x, p: jax.sharding.reshard(x, jax.NamedSharding(mesh, p))
      q, k, v = (put(x, qkv) for x in (q, k, v))
      segs = tuple(put(x, seg) for x in segs)
    o, lse = jax.shard_map(
        body, mesh=mesh, in_specs=(qkv,) * 3 + (seg,) * len(segs),
        out_specs=(qkv, P(batch_axis, head_axis, seq_axis)),
        check_vma=False)(q, k, v, *segs)
  return (o, lse) if return_lse else o


def _has_explicit_axes(mesh) -> bool:
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  return explicit is not None and any(
      t == explicit for t in getattr(mesh, "axis_types", ()))


# ---------------------------------------------------------------------------
# Zigzag order.
# ---------------------------------------------------------------------------


def zigzag_indices(length: int, n: int) -> np.ndarray:
  """Natural positions in zigzag order: chunks (0, 2n-1, 1, 2n-2, ...)."""
  if length % (2 * n):
    raise ValueError(f"length {length} is not divisible by 2 * {n}")
  c = length // (2 * n)
  order = [ch for i in range(n) for ch in (i, 2 * n - 1 - i)]
  return np.concatenate([np.arange(ch * c, (ch + 1) * c) for ch in order])


def zigzag_permute(x, n: int, axis: int = 1):
  """Global array, natural order -> zigzag order along `axis`."""
  return jnp.take(x, zigzag_indices(x.shape[axis], n), axis=axis)


def zigzag_unpermute(x, n: int, axis: int = 1):
  """Inverse of `zigzag_permute`."""
  return jnp.take(x, np.argsort(zigzag_indices(x.shape[axis], n)), axis=axis)


def _dest(ch: int, n: int) -> int:
  """Device that holds natural chunk `ch` (of 2n) in the zigzag layout."""
  return ch if ch < n else 2 * n - 1 - ch


def _local_to_zigzag(x, axis_name, n, axis):
  """Inside shard_map: local shard of natural order -> local zigzag shard.

  Device d holds natural chunks 2d, 2d+1; zigzag device j needs j, 2n-1-j.
  The first halves of all devices go in one ppermute, the second halves in
  another (each is a permutation of the devices); an even device gets its
  first slot from the first-halves permute, an odd one from the second.
  """
  h0, h1 = jnp.split(x, 2, axis=axis)
  r0 = lax.ppermute(h0, axis_name, [(d, _dest(2 * d, n)) for d in range(n)])
  r1 = lax.ppermute(h1, axis_name,
                    [(d, _dest(2 * d + 1, n)) for d in range(n)])
  even = lax.axis_index(axis_name) % 2 == 0
  return jnp.concatenate([jnp.where(even, r0, r1), jnp.where(even, r1, r0)],
                         axis=axis)


def _local_from_zigzag(x, axis_name, n, axis):
  """Inverse of `_local_to_zigzag`."""
  s0, s1 = jnp.split(x, 2, axis=axis)
  even = lax.axis_index(axis_name) % 2 == 0
  ev, od = jnp.where(even, s0, s1), jnp.where(even, s1, s0)
  r0 = lax.ppermute(ev, axis_name, [(_dest(2 * d, n), d) for d in range(n)])
  r1 = lax.ppermute(od, axis_name,
                    [(_dest(2 * d + 1, n), d) for d in range(n)])
  return jnp.concatenate([r0, r1], axis=axis)


# ---------------------------------------------------------------------------
# The ring (runs per device, inside shard_map).
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Ring:
  backend: str
  spec: AttentionSpec  # local shapes; masking fields unset
  axis: str
  n: int
  zigzag: bool  # zigzag layout of the local shards
  reorder: bool  # inputs in natural order: reorder in and out
  window_left: int = UNBOUNDED  # global window, causal folded in
  window_right: int = UNBOUNDED

  @property
  def causal(self) -> bool:
    return self.window_right == 0

  @property
  def banded(self) -> bool:
    """A window other than plain causal: planned by ring_plan.py."""
    return self.window_left != UNBOUNDED or self.window_right not in (
        UNBOUNDED, 0)

  def variant(self, T, S, causal=False):
    return dataclasses.replace(self.spec, q_len=T, kv_len=S, causal=causal,
                               window_right=0 if causal else UNBOUNDED)


def _local_entry(ring: _Ring, q, k, v, *segs):
  if ring.reorder and ring.n > 1:
    to = lambda x: _local_to_zigzag(x, ring.axis, ring.n, 1)
    q, k, v = to(q), to(k), to(v)
    segs = tuple(to(s) for s in segs)
  o, lse = _ring_fn(ring)(q, k, v, *segs)
  if ring.reorder and ring.n > 1:
    o = _local_from_zigzag(o, ring.axis, ring.n, 1)
    lse = _local_from_zigzag(lse, ring.axis, ring.n, 2)
  return o, lse


def _acc_dtype(dtype):
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


# One source for both rings: the ppermute, and the online-softmax ⊕.
_rotate = ring_band.rotate
_merge = softmax.merge_partials


def _split(x, c, axis=1):
  return lax.slice_in_dim(x, 0, c, axis=axis), lax.slice_in_dim(
      x, c, x.shape[axis], axis=axis)


def _pad_front(x, c, axis=1, value=0.0):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (c, 0)
  return jnp.pad(x, pad, constant_values=value)


def _pad_back(x, c, axis=1):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, c)
  return jnp.pad(x, pad)


def _band_ring(ring: _Ring, be):
  """(forward, backward) for a sliding window, on ring_plan.py's plan."""
  spec = dataclasses.replace(ring.spec, window_left=ring.window_left,
                             window_right=ring.window_right)
  steps = ring_plan.plan(spec, ring.n, ring.zigzag)

  def forward(q, k, v, *segs):
    q_seg, kv_seg = segs if segs else (None, None)
    o, lse = ring_band.forward(be, steps, ring.axis, ring.n, q, k, v, q_seg,
                               kv_seg)
    return o.astype(q.dtype), lse.astype(_lse_dtype(q.dtype))

  def backward(q, k, v, o, lse, do, delta, segs):
    q_seg, kv_seg = segs if segs else (None, None)
    dq, dk, dv = ring_band.backward(be, steps, ring.axis, ring.n, q, k, v, o,
                                    lse, do, delta, q_seg, kv_seg)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

  return forward, backward


def _full_ring(ring: _Ring, be):
  """(forward, backward) without a window, or causal: every step, in a
  fori_loop; causal steps pick their half with a lax.cond (see top)."""
  n, axis, L = ring.n, ring.axis, ring.spec.q_len
  c = L // 2
  step0_spec = ring.variant(L, L, causal=ring.causal)
  full_spec = ring.variant(L, L)

  def src_of(s):
    """Home device of the kv chunk held at step s (and my index)."""
    j = lax.axis_index(axis)
    return (j - s) % n, j

  # ----- forward --------------------------------------------------------
  def fwd_block(spec, q, kv, q_seg):
    k, v, kv_seg = kv
    o, lse = be.forward(spec, q, k, v, q_seg, kv_seg)
    acc = _acc_dtype(q.dtype)
    return o.astype(acc), lse.astype(acc)

  def fwd_step(s, q, kv, q_seg):
    """Partial (o, lse) of the local q against the kv chunk of step s >= 1."""
    if not ring.causal:
      return fwd_block(full_spec, q, kv, q_seg)
    src, j = src_of(s)
    acc = _acc_dtype(q.dtype)
    if not ring.zigzag:
      def empty(q, kv, q_seg):
        return ring_band.empty_partial(q, acc)
      return lax.cond(src < j, functools.partial(fwd_block, full_spec), empty,
                      q, kv, q_seg)

    def earlier(q, kv, q_seg):  # all my queries see the first kv chunk
      k, v, ks = kv
      first = lambda x: None if x is None else _split(x, c)[0]
      return fwd_block(ring.variant(L, c), q, (first(k), first(v), first(ks)),
                       q_seg)

    def later(q, kv, q_seg):  # my second q chunk sees both kv chunks
      second = lambda x, a=1: None if x is None else _split(x, c, a)[1]
      o, lse = fwd_block(ring.variant(c, L), second(q), kv, second(q_seg))
      return _pad_front(o, c), _pad_front(lse, c, 2, NEG_INF)

    return lax.cond(src < j, earlier, later, q, kv, q_seg)

  def forward(q, k, v, *segs):
    q_seg, kv_seg = segs if segs else (None, None)
    kv = (k, v, kv_seg)
    if n == 1:
      res = fwd_block(step0_spec, q, kv, q_seg)
    else:
      nxt = _rotate(kv, axis, n)  # in flight while step 0 computes
      res = fwd_block(step0_spec, q, kv, q_seg)

      def body(s, carry):
        kv, res = carry
        nxt = _rotate(kv, axis, n)
        return nxt, _merge(res, fwd_step(s, q, kv, q_seg))

      kv, res = lax.fori_loop(1, n - 1, body, (nxt, res))
      res = _merge(res, fwd_step(n - 1, q, kv, q_seg))
    o, lse = res
    return o.astype(q.dtype), lse.astype(_lse_dtype(q.dtype))

  # ----- backward -------------------------------------------------------
  def bwd_block(spec, q, kv, o, lse, do, delta, q_seg):
    k, v, kv_seg = kv
    grads = be.backward(spec, q, k, v, o, lse, do, delta, q_seg, kv_seg)
    acc = _acc_dtype(q.dtype)
    return tuple(g.astype(acc) for g in grads)

  def bwd_step(s, q, kv, o, lse, do, delta, q_seg):
    """(dq, dk, dv) of the local q vs the kv chunk of step s >= 1."""
    args = (q, kv, o, lse, do, delta, q_seg)
    if not ring.causal:
      return bwd_block(full_spec, *args)
    src, j = src_of(s)
    acc = _acc_dtype(q.dtype)
    if not ring.zigzag:
      def empty(q, kv, *_):
        # *_like: inside a user's shard_map the zeros must vary over the
        # ring axis like the other branch's outputs (lax.cond checks it).
        return (jnp.zeros_like(q, dtype=acc), jnp.zeros_like(kv[0], dtype=acc),
                jnp.zeros_like(kv[1], dtype=acc))
      return lax.cond(src < j, functools.partial(bwd_block, full_spec), empty,
                      *args)

    def earlier(q, kv, o, lse, do, delta, q_seg):
      first = lambda x: None if x is None else _split(x, c)[0]
      dq, dk, dv = bwd_block(ring.variant(L, c), q,
                             tuple(first(x) for x in kv), o, lse, do, delta,
                             q_seg)
      return dq, _pad_back(dk, c), _pad_back(dv, c)

    def later(q, kv, o, lse, do, delta, q_seg):
      second = lambda x, a=1: None if x is None else _split(x, c, a)[1]
      dq, dk, dv = bwd_block(ring.variant(c, L), second(q), kv, second(o),
                             second(lse, 2), second(do), second(delta, 2),
                             second(q_seg))
      return _pad_front(dq, c), dk, dv

    return lax.cond(src < j, earlier, later, *args)

  def backward(q, k, v, o, lse, do, delta, segs):
    q_seg, kv_seg = segs if segs else (None, None)
    kv = (k, v, kv_seg)
    dq, dk, dv = bwd_block(step0_spec, q, kv, o, lse, do, delta, q_seg)
    if n > 1:
      nxt = _rotate(kv, axis, n)
      dkv = _rotate((dk, dv), axis, n)  # travels home with its kv chunk

      def body(s, carry):
        kv, dkv, dq = carry
        nxt = _rotate(kv, axis, n)
        g = bwd_step(s, q, kv, o, lse, do, delta, q_seg)
        dkv = _rotate((dkv[0] + g[1], dkv[1] + g[2]), axis, n)
        return nxt, dkv, dq + g[0]

      kv, dkv, dq = lax.fori_loop(1, n - 1, body, (nxt, dkv, dq))
      g = bwd_step(n - 1, q, kv, o, lse, do, delta, q_seg)
      dq = dq + g[0]
      dk, dv = _rotate((dkv[0] + g[1], dkv[1] + g[2]), axis, n)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

  return forward, backward


@functools.lru_cache(maxsize=None)
def _ring_fn(ring: _Ring):
  """custom_vjp fn(q, k, v, *segs) -> (o, lse) over local shards."""
  be = backends.get(ring.backend)
  forward, backward = (_band_ring if ring.banded else _full_ring)(ring, be)

  @jax.custom_vjp
  def ring_fn(q, k, v, *segs):
    return forward(q, k, v, *segs)

  def ring_fwd(q, k, v, *segs):
    o, lse = forward(q, k, v, *segs)
    return (o, lse), (q, k, v, o, lse, segs)

  def ring_bwd(res, cts):
    q, k, v, o, lse, segs = res
    do, dlse = cts
    acc = _acc_dtype(q.dtype)
    delta = jnp.einsum("bthd,bthd->bht", do.astype(acc), o.astype(acc),
                       precision=lax.Precision.HIGHEST) - dlse.astype(acc)
    dq, dk, dv = backward(q, k, v, o, lse, do.astype(o.dtype), delta, segs)
    return (dq, dk, dv) + tuple(None for _ in segs)

  ring_fn.defvjp(ring_fwd, ring_bwd)
  return ring_fn


def _lse_dtype(dtype):
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


# ---------------------------------------------------------------------------
# Argument checks (trace time).
# ---------------------------------------------------------------------------


def _check_arrays(q, k, v):
  """The checks of `jax_flash.attention`, plus what the ring needs."""
  checks.check_arrays(q, k, v)
  for name, x in (("query", q), ("key", k), ("value", v)):
    if x.ndim != 4:
      raise ValueError(f"ring_attention: {name} must have shape [batch, seq, "
                       f"heads, head_dim]; got shape {x.shape}")
  if q.shape[1] != k.shape[1]:
    raise ValueError(
        f"ring_attention needs equal query and key/value sequence lengths "
        f"(T == S); got T={q.shape[1]}, S={k.shape[1]}. Use "
        f"jax_flash.attention for T != S.")
