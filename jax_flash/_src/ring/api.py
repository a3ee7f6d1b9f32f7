"""Ring attention: exact attention over sequence-sharded q/k/v.

Each device of the mesh axis `seq_axis` (size n) holds one chunk of the
queries and one chunk of the keys/values. The kv chunks travel around the
ring (`lax.ppermute`) for up to n steps; at every step each device runs the
chosen backend's *forward kernel* on its own q chunk against the kv chunk it
holds, and folds the partial result into its running (o, lse) with the
online-softmax merge

    lse = logaddexp(lse_a, lse_b),  o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b

so no device ever holds more than two kv chunks (the current one and the next
one in flight). The backward is one custom_vjp around the whole local ring
(`autodiff.differentiable`, the one every op uses): delta =
rowsum(dO * O) - dLSE once, then k/v go around the ring again and every step
runs the backend's *backward kernel* with the *global* lse and delta.

One algorithm serves every mask (ring/plan.py, run by ring/steps.py): each
(q chunk, kv chunk) pair of every step has a static position offset
(`AttentionSpec.q_offset`), so steps that no device needs are skipped at
trace time, communication included, each device picks its case of a step
with a `lax.switch`, and steps with the same cases form one `fori_loop`.
Without a window that is one kernel call per step; causal attention needs
two cases per step: a kv chunk wholly before the q chunk (fully visible) or
wholly after it (nothing to do), plus the diagonal at step 0.

Causal load balance: with the natural ("contiguous") layout the device that
holds the last chunk does n times the work of the first one. The "zigzag"
layout fixes that: the sequence is cut into 2n chunks and device i holds
chunks i and 2n-1-i. Then every step costs every device the same (c x 2c for
chunk length c):
  step 0 (own kv):    causal over the local 2c queries/keys (in local order
                      the mask is plain causal: one call);
  kv from a device j < i: all local queries see the first kv chunk only;
  kv from a device j > i: only the second local q chunk sees both kv chunks.
The default layout is zigzag when exactly one side of the (causal-folded)
window is unbounded (plain causal and the like: triangular work), else
contiguous (full attention or a band is balanced already, and with a band
each device needs only the chunks of a few neighbours).

With `layout="zigzag"` the user still passes naturally ordered arrays; they
are reordered inside the shard_map with two ppermutes per tensor (each moves
half of the local shard), and the output is put back the same way. That costs
about one ring step of communication per tensor and no compute; for causal
attention it pays for itself as soon as n > 2 or so. Models that keep their
activations in zigzag order throughout can skip it: `zigzag_permute` /
`zigzag_unpermute` (ring/zigzag.py) are the (global-array) permutations, and
`layout="zigzag_preordered"` says the inputs are already in that order
(the output then is too).

Precision: partial (o, lse) are merged in float32 (float64 for float64
inputs); per-step dQ/dK/dV come back from the kernels in the input dtype and
are summed in float32, so for bf16 inputs the gradients see one bf16 rounding
per ring step more than a single-device kernel would.

Dropout draws the single-device mask (core/dropout.py: a function of the
key and the global position): each kernel call gets its block's origin, the
device's first batch element and head and its chunk pair's first global row
and column (with dropout a call is one chunk pair, `ring_plan.calls`).

Not supported: T != S (use `jax_flash.attention`) and ring axes made of
several mesh axes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_flash._src.api import attention as api
from jax_flash._src.backends import registry as backends
from jax_flash._src.core import checks, dropout, softmax
from jax_flash._src.ring import plan as ring_plan
from jax_flash._src.ring import steps as ring_steps
from jax_flash._src.ring import zigzag as zigzag_layout
from jax_flash._src.autodiff.differentiable import Kernels, differentiable
from jax_flash._src.core.spec import UNBOUNDED, AttentionSpec

LAYOUTS = ("zigzag", "contiguous", "zigzag_preordered")
STRATEGIES = ("ring", "all_gather")


def ring_attention(query, key, value, *, mesh=None, seq_axis: str,
                   causal: bool = False, scale: float | None = None,
                   window: tuple[int, int] | None = None,
                   softcap: float | None = None, segment_ids=None,
                   dropout_rate: float = 0.0, dropout_rng=None,
                   dropout_broadcast: bool = False, sinks=None,
                   return_lse: bool = False,
                   implementation: str | None = None,
                   batch_axis=None, head_axis=None, layout: str | None = None,
                   strategy: str = "ring"):
  """Exact attention of q/k/v sharded along the sequence over `seq_axis`.

  Args:
    query, key, value: [B, T, H, D], [B, S, H_kv, D] and [B, S, H_kv, D_v]
      (H % H_kv == 0; D_v may differ from D), with T == S. With `mesh` given, these are global arrays (sharded or not:
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
    dropout_rate, dropout_rng, dropout_broadcast: attention dropout, as
      `jax_flash.attention`: the mask of the same key at the same global
      (batch, head, query, key) positions, so the result is the single-device
      one. With `mesh=None` the batch and head positions are those of the
      local arrays (fold a batch/head shard's index into the key where
      the shard_map shards those too). Served by "xla", "pallas" and, for
      chunks of a multiple of 64 tokens (zigzag: each half), "cuda".
    sinks: learnable attention sinks [H] (as `jax_flash.attention`; the
      local heads' inside a shard_map), merged into each row once, after
      the ring.
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
    strategy: "ring" (kv chunks passed around the ring, each transfer
      overlapping the previous step's compute; kv memory per device: one
      chunk in flight) or "all_gather" (every device gathers all kv chunks
      once and dK/dV come back in one reduce-scatter: fewer, larger
      transfers, at the cost of the full kv, and in the backward its fp32
      gradient, on every device). Same result.

  Returns:
    out [B, T, H, D_v] in query.dtype, or (out, lse) if return_lse.
  """
  q, k, v = query, key, value
  _check_arrays(q, k, v)
  causal = checks.static_bool(causal, "causal")
  return_lse = checks.static_bool(return_lse, "return_lse")
  dropout_broadcast = checks.static_bool(dropout_broadcast,
                                         "dropout_broadcast")
  rate = checks.check_dropout(dropout_rate, dropout_rng)
  win = checks.window_fields(window, causal)
  if layout is None:
    one_sided = ((win["window_left"] == UNBOUNDED) !=
                 (win["window_right"] == UNBOUNDED))
    layout = "zigzag" if one_sided else "contiguous"
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS} or None, got "
                     f"{layout!r}")
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got "
                     f"{strategy!r}")
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
  sinks = checks.check_sinks(sinks, H, q.dtype)

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
      scale=checks.check_scale(scale, D), **win,
      softcap=checks.check_softcap(softcap), has_segment_ids=q_seg is not None,
      batch=B // n_b, q_len=T // (n if mesh is not None else 1),
      kv_len=T // (n if mesh is not None else 1), num_heads=H // n_h,
      num_kv_heads=H_kv // n_h, head_dim=D,
      value_head_dim=AttentionSpec.value_head_dim_of(D, v.shape[-1]),
      dtype=jnp.dtype(q.dtype).name,
      dropout_rate=rate, dropout_broadcast=rate > 0.0 and dropout_broadcast,
      # Every call's column origin is a multiple of the chunk length.
      dropout_origin=(T // parts if mesh is not None else
                      T // (2 if zigzag else 1)) if rate > 0.0 else 0)
  # The step kernels run without the sinks (the ring merges them in at the
  # end); the backends are asked whether they serve them all the same.
  backend = backends.choose(dataclasses.replace(
      local, causal=bool(causal), has_sinks=sinks is not None),
      implementation, platform)
  key = dropout.key_words(dropout_rng) if rate > 0.0 else ()
  if api.no_rows((B, H)):
    return api.empty_result(q, return_lse, v.shape[-1])
  ring = _Ring(backend.name, local, seq_axis, n, zigzag, layout == "zigzag",
               strategy == "all_gather", sinks is not None,
               batch_axis if mesh is not None else None,
               head_axis if mesh is not None else None)
  segs = () if q_seg is None else (q_seg.astype(jnp.int32),
                                   kv_seg.astype(jnp.int32))
  sink_args = api.per_batch_sinks(sinks, B)
  body = functools.partial(_local_entry, ring, len(segs))
  if mesh is None:
    o, lse = body(q, k, v, *sink_args, *segs, *key)
  else:
    qkv = P(batch_axis, seq_axis, head_axis, None)
    seg = P(batch_axis, seq_axis)
    sink = P(batch_axis, head_axis)
    if _has_explicit_axes(mesh):
      # shard_map over explicit axes takes inputs only in its in_specs.
      put = lambda x, p: jax.sharding.reshard(x, jax.NamedSharding(mesh, p))
      q, k, v = (put(x, qkv) for x in (q, k, v))
      sink_args = [put(x, sink) for x in sink_args]
      segs = tuple(put(x, seg) for x in segs)
      key = tuple(put(x, P()) for x in key)
    o, lse = jax.shard_map(
        body, mesh=mesh,
        in_specs=((qkv,) * 3 + (sink,) * len(sink_args) + (seg,) * len(segs)
                  + (P(),) * len(key)),
        out_specs=(qkv, P(batch_axis, head_axis, seq_axis)),
        check_vma=False)(q, k, v, *sink_args, *segs, *key)
  return (o, lse) if return_lse else o


def _has_explicit_axes(mesh) -> bool:
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  return explicit is not None and any(
      t == explicit for t in getattr(mesh, "axis_types", ()))


# ---------------------------------------------------------------------------
# The ring (runs per device, inside shard_map).
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Ring:
  backend: str
  spec: AttentionSpec  # local shapes; the global window, causal folded in
  axis: str
  n: int
  zigzag: bool  # zigzag layout of the local shards
  reorder: bool  # inputs in natural order: reorder in and out
  gather: bool = False  # all-gather the kv chunks instead of the ring
  sinks: bool = False  # a sinks [B, H] operand follows v
  # Mesh axes of the batch and heads (the global entry): dropout's origin.
  batch_axis: str | None = None
  head_axis: str | None = None


def _local_entry(ring: _Ring, n_segs: int, q, k, v, *rest):
  """One device's ring: rest = the sinks [B, H] (with ring.sinks), segment
  ids (n_segs of them), then dropout's key words (core/dropout.py
  key_words)."""
  sinks, rest = rest[:int(ring.sinks)], rest[int(ring.sinks):]
  segs, key = rest[:n_segs], rest[n_segs:]
  if key:  # this device's first batch element and head in the request
    index = lambda ax: 0 if ax is None else lax.axis_index(ax)
    key = dropout.with_origin(key, index(ring.batch_axis) * ring.spec.batch,
                              index(ring.head_axis) * ring.spec.num_heads)
  if ring.reorder and ring.n > 1:
    to = lambda x: zigzag_layout.local_to_zigzag(x, ring.axis, ring.n, 1)
    q, k, v = to(q), to(k), to(v)
    segs = tuple(to(s) for s in segs)
  o, lse = _ring_fn(ring)(q, k, v, *sinks, *segs, *key)
  if ring.reorder and ring.n > 1:
    o = zigzag_layout.local_from_zigzag(o, ring.axis, ring.n, 1)
    lse = zigzag_layout.local_from_zigzag(lse, ring.axis, ring.n, 2)
  return o, lse


@functools.lru_cache(maxsize=None)
def _ring_fn(ring: _Ring):
  """fn(q, k, v, [sinks,] *segs, *key words) -> (o, lse) over local shards,
  differentiable."""
  be = backends.get(ring.backend)
  steps = ring_plan.plan(ring.spec, ring.n, ring.zigzag)
  run = functools.partial(ring_steps.forward, be, steps, ring.axis, ring.n,
                          gather=ring.gather)
  run_bwd = functools.partial(ring_steps.backward, be, steps, ring.axis,
                              ring.n, gather=ring.gather)

  n_segs = 2 if ring.spec.has_segment_ids else 0

  def split(rest):  # (q_seg, kv_seg), dropout's key words or None
    segs, key = rest[:n_segs], rest[n_segs:]
    return (segs if segs else (None, None)), (key if key else None)

  def forward(q, k, v, *rest):
    sinks, rest = rest[:int(ring.sinks)], rest[int(ring.sinks):]
    (q_seg, kv_seg), key = split(rest)
    o, lse = run(q, k, v, q_seg, kv_seg, key)
    if sinks:  # the sink: one more partial, of value 0 and lse = sink
      sink_lse = jnp.broadcast_to(sinks[0].astype(lse.dtype)[..., None],
                                  lse.shape)
      o, lse = softmax.merge_partials((o, lse), (jnp.zeros_like(o), sink_lse))
    return o.astype(q.dtype), lse

  def backward(q, k, v, o, lse, do, delta, *rest):
    (q_seg, kv_seg), key = split(rest)
    dq, dk, dv = run_bwd(q, k, v, o, lse, do, delta, q_seg, kv_seg, key)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

  return differentiable(Kernels(forward, backward, sinks=ring.sinks))


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
