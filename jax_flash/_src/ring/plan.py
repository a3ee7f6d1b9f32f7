"""The static plan of a ring: which steps, which kernel calls.

Which (device, step) pairs see anything is known at trace time: device j
holds query chunks at fixed global positions (contiguous: chunk j of n;
zigzag: chunks j and 2n-1-j of 2n), and at step s it holds the kv chunks of
device (j - s) mod n. So every (q chunk, kv chunk) pair at every step has a
static relative offset, hence a static `AttentionSpec` (`q_offset`), which
`masking.simplify` reduces to None (nothing visible), a spec without window
(fully visible), or a band. One plan serves every mask: without a window
every pair is fully visible (one case, one call per step); causal attention
has the diagonal at step 0 and per step one "kv chunk before me" and one
"kv chunk after me" case; a sliding window drops the steps no device needs.
All of this is plain Python on ints; ring/steps.py runs the plan.

  * `plan`: the steps in which some device sees a key, each with its
    distinct cases (a device's grid of pair specs) and a per-device table
    of which case it is in;
  * `runs`: consecutive steps with the same cases, so a long stretch of the
    ring (a wide window) becomes one loop instead of unrolled steps;
  * `calls`: a case's visible pairs grouped into as few kernel calls as the
    layout allows: the whole local block as one call when one spec on it
    masks every pair alike (causal at step 0 of the zigzag layout is plain
    causal in local order), else rows or columns of fully visible pairs
    (with dropout: one call per pair, at the pair's global origin).
"""

from __future__ import annotations

import dataclasses
import functools

from jax_flash._src.core import masking
from jax_flash._src.core.spec import AttentionSpec

# A case: for each local q chunk a, for each local kv chunk b, the spec of
# that block pair, or None when nothing in it is visible.
Case = tuple[tuple[AttentionSpec | None, ...], ...]


@dataclasses.dataclass(frozen=True)
class Step:
  shift: int  # device j holds the kv chunks of device (j - shift) mod n
  cases: tuple[Case, ...]  # the distinct cases of this step
  table: tuple[int, ...]  # device j's case is cases[table[j]]


@dataclasses.dataclass(frozen=True)
class Call:
  """One kernel call: local q chunks [q0, q1) against kv chunks [k0, k1)."""
  q0: int
  q1: int
  k0: int
  k1: int
  spec: AttentionSpec


def _simplify(spec: AttentionSpec) -> AttentionSpec | None:
  """`masking.simplify`, with the bottom-right offset spelled None, so a
  block aligned like the public API has the public API's spec."""
  spec = masking.simplify(spec)
  if spec is not None and spec.bottom_right:
    spec = dataclasses.replace(spec, q_offset=None)
  return spec


def _pair_of_block(block: AttentionSpec, a: int, b: int,
                   size: int) -> AttentionSpec | None:
  """The spec of pair (a, b) (chunks of `size`) inside a spec on m x m."""
  return _simplify(dataclasses.replace(
      block, q_len=size, kv_len=size,
      q_offset=block.kv_offset + (a - b) * size))


def _one_block(case: Case, size: int) -> AttentionSpec | None:
  """One spec on the whole local block that masks every pair as `case`
  does (as if the local chunks were contiguous), or None."""
  m = len(case)
  first = case[0][0]
  if first is None:
    return None
  block = dataclasses.replace(first, q_len=m * size, kv_len=m * size,
                              q_offset=first.kv_offset)
  if any(_pair_of_block(block, a, b, size) != case[a][b]
         for a in range(m) for b in range(m)):
    return None
  return _simplify(block)


def chunks_of(device: int, n: int, zigzag: bool) -> tuple[int, ...]:
  """Global chunk indices a device holds, in local order."""
  return (device, 2 * n - 1 - device) if zigzag else (device,)


@functools.lru_cache(maxsize=None)
def plan(spec: AttentionSpec, n: int, zigzag: bool) -> tuple[Step, ...]:
  """The useful steps for a local spec (q_len = kv_len = the local length,
  window in global positions with causal folded into window_right).
  Step 0 (the device's own kv) always sees its diagonal."""
  size = spec.q_len // (2 if zigzag else 1)

  @functools.lru_cache(maxsize=None)
  def pair(d: int):  # a q chunk d chunks after the kv chunk
    return _simplify(dataclasses.replace(
        spec, q_len=size, kv_len=size, causal=False, q_offset=d * size))

  steps = []
  for s in range(n):
    cases, table = [], []
    for j in range(n):
      src = (j - s) % n
      case = tuple(tuple(pair(qa - kb) for kb in chunks_of(src, n, zigzag))
                   for qa in chunks_of(j, n, zigzag))
      if case not in cases:
        cases.append(case)
      table.append(cases.index(case))
    if any(p is not None for c in cases for row in c for p in row):
      steps.append(Step(s, tuple(cases), tuple(table)))
  return tuple(steps)


def runs(steps: tuple[Step, ...]) -> list[list[Step]]:
  """Maximal groups of consecutive shifts with identical cases."""
  out: list[list[Step]] = []
  for step in steps:
    if (out and step.shift == out[-1][-1].shift + 1 and
        step.cases == out[-1][-1].cases):
      out[-1].append(step)
    else:
      out.append([step])
  return out


def _widen(spec: AttentionSpec, rows: int, cols: int) -> AttentionSpec:
  return dataclasses.replace(spec, q_len=spec.q_len * rows,
                             kv_len=spec.kv_len * cols)


@functools.lru_cache(maxsize=None)
def calls(case: Case) -> tuple[Call, ...]:
  """Kernel calls that cover the visible pairs of a case exactly once.

  A band needs its own offset, so it is one call per pair; fully visible
  pairs merge into one call over a whole row (one q chunk, all kv) or a
  whole column (all q, one kv chunk) when every pair in it is fully visible
  (local chunks are contiguous slices; their global positions need not be).
  With dropout every call is one pair: a call draws its mask at one global
  row and column origin, and local chunks need not be globally adjacent.
  """
  m = len(case)
  left = {(a, b): p for a, row in enumerate(case) for b, p in enumerate(row)
          if p is not None}
  full = lambda a, b: (a, b) in left and not left[a, b].has_window
  out = []
  merge = m > 1 and not any(p.has_dropout for p in left.values())
  if merge and left:
    block = _one_block(case, left[min(left)].q_len)
    if block is not None:
      return (Call(0, m, 0, m, block),)
  if merge:
    for a in range(m):
      if all(full(a, b) for b in range(m)):
        out.append(Call(a, a + 1, 0, m, _widen(left[a, 0], 1, m)))
        for b in range(m):
          del left[a, b]
    for b in range(m):
      if all(full(a, b) for a in range(m)):
        out.append(Call(0, m, b, b + 1, _widen(left[0, b], m, 1)))
        for a in range(m):
          del left[a, b]
  out += [Call(a, a + 1, b, b + 1, p) for (a, b), p in sorted(left.items())]
  return tuple(out)
