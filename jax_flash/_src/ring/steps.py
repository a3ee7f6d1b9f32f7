"""Runs ring/plan.py's static plan: the ring's forward and backward per device.

Per device, inside shard_map. Steps the plan drops cost nothing, their
communication included: kv jumps to the next useful step with one
`ppermute` by the step difference (on NVLink/ICI a shift by s costs what a
shift by 1 does), and dK/dV go home with one ppermute after the last step.
Within a step a device picks its case with a `lax.switch` on the plan's
table, indexed by `axis_index` (a step with one case calls it directly). A
run of steps with the same cases is a `fori_loop` (the table row indexed by
the loop counter), so compile time does not grow with the ring size, with
or without a window.

The next kv transfer is issued before the current step's compute, so XLA can
overlap communication with compute. With segment ids, a kernel call whose
query and key ids cannot meet (their [min, max] ranges are disjoint: packed
documents that do not cross into the other chunk) is skipped at run time
(`lax.cond`), giving the empty partial / zero gradients it would compute. Partial (o, lse) merge with the
online-softmax ⊕ (`softmax.merge_partials`) in float32/64, and the backward
runs the backend's backward kernel with the global lse and delta at every
step: P = exp(S - lse_global) blockwise, so each block's dQ, dK, dV are
exactly its share of the true gradients; dQ accumulates locally, dK/dV in
buffers that travel with their kv chunk and go home at the end. With
dropout each call gets the key words of its chunk pair's global origin
(`_call_key`: this device's q chunk, the source device's kv chunk), in the
forward and again in the backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flash._src.ring import plan as ring_plan
from jax_flash._src.core import dropout, softmax

NEG_INF = float("-inf")
MIN_LOOP = 3  # shorter runs are unrolled


def rotate(tree, axis: str, n: int, shift: int = 1):
  """Device i's arrays go to device i + shift (mod n)."""
  shift %= n
  if shift == 0:
    return tree
  perm = [(i, (i + shift) % n) for i in range(n)]
  return jax.tree.map(lambda x: lax.ppermute(x, axis, perm), tree)


def empty_partial(q, acc, head_dim):
  """(o, lse) = (0, -inf) for the rows of q [B, T, H, D]: no key seen; o
  has the value head dim `head_dim`.

  Built with *_like from q: inside a user's shard_map, lax.switch/cond
  branches must agree on which mesh axes their outputs vary over.
  """
  lse_like = jnp.swapaxes(q[..., 0], 1, 2)  # [B, H, T]
  o = jnp.zeros_like(q, dtype=acc)
  if head_dim != q.shape[-1]:
    o = jnp.broadcast_to(o[..., :1], q.shape[:-1] + (head_dim,))
  return (o,
          jnp.full_like(lse_like, NEG_INF, dtype=acc))


def _span(x, start: int, stop: int, size: int, axis: int = 1):
  if x is None:
    return None
  return lax.slice_in_dim(x, start * size, stop * size, axis=axis)


def _pad_rows(x, q0: int, q1: int, m: int, size: int, axis: int, value):
  """Put a result for local chunks [q0, q1) at its place among m chunks."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (q0 * size, (m - q1) * size)
  return jnp.pad(x, widths, constant_values=value)


def _walk(steps, axis: str, n: int, compute, kv):
  """Run `compute` over the plan; returns (travel, home).

  kv travels with the ring (sent ahead before each compute). compute(cases,
  case_index, src, kv, travel, home) -> (travel, home), with case_index a
  traced int32 or None (only one case), src the (traced) device whose kv
  chunks these are, and travel/home None at the first step
  (which starts them, so nothing is added to zeros): `travel` travels with
  kv, updated by each compute (dK/dV), and is sent home at the end; `home`
  stays (the partial (o, lse), dQ).
  """
  me = lax.axis_index(axis)

  def case_index(table):
    return None if table is None else table[me]

  def source(shift):
    return (me - shift) % n

  # ("loop", steps) or ("one", step). The first step runs on its own: it
  # starts travel/home, which a loop carry needs to exist already.
  todo = []
  for run in ring_plan.runs(steps):
    if not todo:
      todo.append(("one", run[0]))
      run = run[1:]
    if len(run) >= MIN_LOOP:
      todo += [("loop", run[:-1]), ("one", run[-1])]
    else:
      todo += [("one", step) for step in run]

  travel = home = None
  for i, (kind, what) in enumerate(todo):
    if kind == "loop":
      cases = what[0].cases
      table = (None if len(cases) == 1 else
               jnp.asarray(np.array([s.table for s in what], np.int32)))

      def body(t, carry, cases=cases, table=table):
        kv, travel, home = carry
        nxt = rotate(kv, axis, n, 1)
        row = None if table is None else table[t]
        travel, home = compute(cases, case_index(row),
                               source(what[0].shift + t), kv, travel, home)
        return nxt, rotate(travel, axis, n, 1), home

      kv, travel, home = lax.fori_loop(0, len(what), body,
                                       (kv, travel, home))
      continue
    step, last = what, i + 1 == len(todo)
    if not last:
      nxt_step = todo[i + 1][1]
      nxt_shift = (nxt_step[0] if isinstance(nxt_step, list) else
                   nxt_step).shift
      delta = nxt_shift - step.shift
      nxt = rotate(kv, axis, n, delta)  # in flight during the compute
    table = (None if len(step.cases) == 1 else
             jnp.asarray(np.array(step.table, np.int32)))
    travel, home = compute(step.cases, case_index(table), source(step.shift),
                           kv, travel, home)
    if not last:
      kv, travel = nxt, rotate(travel, axis, n, delta)
  return rotate(travel, axis, n, -steps[-1].shift), home


def _walk_gathered(steps, axis: str, n: int, compute, kv):
  """`_walk` with the kv chunks all-gathered instead of passed around.

  Every device gathers all kv chunks once (the first step uses its own, so
  the gather can overlap that step), then runs the plan's steps on slices of
  the gathered chunks. What `_walk` sends home with its kv chunk (dK, dV)
  accumulates per source chunk and is summed over the devices by one
  reduce-scatter at the end. Memory: the full kv (and, in the backward, its
  fp32 gradient) on every device; communication: one all-gather (and one
  reduce-scatter) instead of n - 1 permutes.
  """
  me = lax.axis_index(axis)
  full = jax.tree.map(lambda x: lax.all_gather(x, axis), kv)  # [n, ...]
  acc = home = None
  for step in steps:
    src = (me - step.shift) % n
    kv_s = kv if step.shift == 0 else jax.tree.map(
        lambda x: lax.dynamic_index_in_dim(x, src, 0, keepdims=False), full)
    idx = (None if len(step.cases) == 1 else
           jnp.asarray(np.array(step.table, np.int32))[me])
    g, home = compute(step.cases, idx, src, kv_s, None, home)
    if g is None:
      continue
    if acc is None:
      acc = jax.tree.map(lambda x: jnp.zeros((n,) + x.shape, x.dtype), g)
    acc = jax.tree.map(
        lambda a, x: lax.dynamic_update_index_in_dim(
            a, lax.dynamic_index_in_dim(a, src, 0, keepdims=False) + x, src, 0),
        acc, g)
  travel = None if acc is None else jax.tree.map(
      lambda a: lax.psum_scatter(a, axis, scatter_dimension=0), acc)
  return travel, home


def _add(a, b):
  """a + b, leafwise; a None (nothing yet) gives b."""
  return b if a is None else jax.tree.map(jnp.add, a, b)


def ids_can_meet(q_seg, kv_seg):
  """Whether in some batch row [B, len] a query id may equal a key id: the
  [min, max] ranges of the row's ids overlap (exact for packed documents,
  whose ids are runs)."""
  lo_q, hi_q = jnp.min(q_seg, 1), jnp.max(q_seg, 1)
  lo_k, hi_k = jnp.min(kv_seg, 1), jnp.max(kv_seg, 1)
  return jnp.any((hi_q >= lo_k) & (hi_k >= lo_q))


def _unless_apart(q_seg, kv_seg, fn, empty):
  """fn() where the ids can meet, else empty() (both traced; one runs)."""
  if q_seg is None or q_seg.size == 0 or kv_seg.size == 0:
    return fn()
  return lax.cond(ids_can_meet(q_seg, kv_seg), fn, empty)


def _call_key(key, call, me, src, n: int, m: int, size: int):
  """The dropout key words of one kernel call (None without dropout): the
  request's words with the call's global row and column origin, the first
  positions of local q chunk call.q0 of this device and of local kv chunk
  call.k0 of device src (with dropout a call is one chunk pair,
  `ring_plan.calls`)."""
  if key is None:
    return None
  zigzag = m == 2
  rows = ring_plan.chunks_of(me, n, zigzag)[call.q0] * size
  cols = ring_plan.chunks_of(src, n, zigzag)[call.k0] * size
  return dropout.with_origin(key, row0=rows, col0=cols)


def _switch(cases, idx, fn, *args):
  if idx is None:
    return fn(cases[0], *args)
  return lax.switch(idx, [functools.partial(fn, c) for c in cases], *args)


def forward(be, steps, axis: str, n: int, q, k, v, q_seg, kv_seg, key=None,
            *, gather: bool = False):
  """Merged (o, lse) of the local q over the plan, in float32/64 (gather:
  all-gather the kv chunks instead of the ring, `_walk_gathered`). key:
  dropout's key words (core/dropout.py key_words, this device's batch and
  head origin) or None."""
  acc = softmax.accum_dtype(q.dtype)
  m = len(steps[0].cases[0])  # chunks per device
  size = q.shape[1] // m
  me = lax.axis_index(axis)
  dv = v.shape[-1]

  def one_case(case, src, q, kv, q_seg):
    k, v, kv_seg = kv
    res = None
    for c in ring_plan.calls(case):
      qs, ks = _span(q_seg, c.q0, c.q1, size), _span(kv_seg, c.k0, c.k1, size)
      q_c = _span(q, c.q0, c.q1, size)
      words = _call_key(key, c, me, src, n, m, size)
      run = lambda c=c, q_c=q_c, qs=qs, ks=ks, words=words: tuple(
          x.astype(acc) for x in be.forward(c.spec, q_c,
                                            _span(k, c.k0, c.k1, size),
                                            _span(v, c.k0, c.k1, size), qs,
                                            ks, dropout_key=words))
      o, lse = _unless_apart(qs, ks, run, lambda q_c=q_c: empty_partial(
          q_c, acc, dv))
      part = (_pad_rows(o.astype(acc), c.q0, c.q1, m, size, 1, 0.0),
              _pad_rows(lse.astype(acc), c.q0, c.q1, m, size, 2, NEG_INF))
      res = part if res is None else softmax.merge_partials(res, part)
    return empty_partial(q, acc, dv) if res is None else res

  def compute(cases, idx, src, kv, travel, res):
    part = _switch(cases, idx, one_case, src, q, kv, q_seg)
    return travel, part if res is None else softmax.merge_partials(res, part)

  walk = _walk_gathered if gather else _walk
  _, res = walk(steps, axis, n, compute, (k, v, kv_seg))
  return res


def backward(be, steps, axis: str, n: int, q, k, v, o, lse, do, delta, q_seg,
             kv_seg, key=None, *, gather: bool = False):
  """(dq, dk, dv) in float32/64 over the plan (key: as `forward`)."""
  acc = softmax.accum_dtype(q.dtype)
  m = len(steps[0].cases[0])
  size = q.shape[1] // m
  me = lax.axis_index(axis)

  def one_case(case, src, q, kv, o, lse, do, delta, q_seg):
    k, v, kv_seg = kv
    grads = None
    for c in ring_plan.calls(case):
      rows = lambda x, axis=1: _span(x, c.q0, c.q1, size, axis)
      cols = lambda x: _span(x, c.k0, c.k1, size)
      words = _call_key(key, c, me, src, n, m, size)
      run = lambda c=c, rows=rows, cols=cols, words=words: tuple(
          x.astype(acc) for x in be.backward(
              c.spec, rows(q), cols(k), cols(v), rows(o), rows(lse, 2),
              rows(do), rows(delta, 2), rows(q_seg), cols(kv_seg),
              dropout_key=words))
      zeros = lambda rows=rows, cols=cols: tuple(
          jnp.zeros_like(x, dtype=acc) for x in (rows(q), cols(k), cols(v)))
      g = _unless_apart(rows(q_seg), cols(kv_seg), run, zeros)
      grads = _add(grads, (
          _pad_rows(g[0].astype(acc), c.q0, c.q1, m, size, 1, 0.0),
          _pad_rows(g[1].astype(acc), c.k0, c.k1, m, size, 1, 0.0),
          _pad_rows(g[2].astype(acc), c.k0, c.k1, m, size, 1, 0.0)))
    if grads is None:  # *_like: see empty_partial
      grads = tuple(jnp.zeros_like(x, dtype=acc) for x in (q, k, v))
    return grads

  def compute(cases, idx, src, kv, dkv, dq):
    g = _switch(cases, idx, one_case, src, q, kv, o, lse, do, delta, q_seg)
    return _add(dkv, g[1:]), _add(dq, g[0])

  walk = _walk_gathered if gather else _walk
  (dk, dv), dq = walk(steps, axis, n, compute, (k, v, kv_seg))
  return dq, dk, dv
