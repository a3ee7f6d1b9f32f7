"""Which keys a tile of query rows can see, from the segment ids: block skipping.

With segment ids, visibility is data: a kernel cannot tell from positions
alone which key blocks a tile of rows may see. This pre-pass (a few fused XLA
reductions over the ids, no T x S matrix) summarises it per tile of `rows`
query rows as four key indices

    lo <= full_lo <= full_hi <= hi      (or full_lo = full_hi = 0: none full)

meaning: no row of the tile sees a key outside [lo, hi), and every real row
of the tile sees every key in [full_lo, full_hi). Kernels visit only the key
blocks that meet [lo, hi) and skip the element mask on blocks inside
[full_lo, full_hi). `kv_spans` is the transpose (per tile of keys, which query
rows), for backward kernels that loop over queries.

The summary is exact for packed sequences, whatever the order of the ids: the
keys whose id lies between the tile's smallest and largest id bound [lo, hi),
and a tile of one id whose keys form one run is full between the band's
limits. Ids in any other arrangement (interleaved, repeated runs) still give a
correct, looser [lo, hi) and no full keys: those tiles take the element mask
everywhere, as without the pre-pass. Positions enter through the window (or
causal) band, with each token's diagonal shift (spec.py) for packed sequences
of unequal query and key lengths.

Cost: one pass over [B, T / rows, S] comparisons (fused into reductions,
nothing materialised), i.e. 1/rows of a score matrix per batch element, once
per call and shared by every head. The xla and pallas backends use these
spans at their own tile sizes; the cuda backend computes the same values (and
more: per-token intervals for its masks) in one CUDA launch,
cuda/packing/tile_spans.cu, which tests/test_varlen.py checks against this.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_flash._src.core.spec import UNBOUNDED, AttentionSpec

ROWS = 64  # the kernels' tiles are multiples of this (cuda/include/jax_flash/mask_info.h)


def _groups(x, rows, fill):
  """[B, L] -> [B, ceil(L / rows), rows], padded with `fill`."""
  B, L = x.shape
  n = -(-L // rows)
  return jnp.pad(x, ((0, 0), (0, n * rows - L)),
                 constant_values=fill).reshape(B, n, rows)


def _summary(own_seg, other_seg, pos, band_lo, band_hi, rows):
  """Spans [B, G, 4] int32 of the groups of `own_seg` over `other_seg`.

  pos [B, L_own]: each token's diagonal in the other axis' coordinates;
  token t may see other index u only if pos[t] - band_lo <= u <= pos[t] +
  band_hi (band sides None = unbounded), and only with an equal id.
  """
  big = jnp.iinfo(jnp.int32).max
  small = jnp.iinfo(jnp.int32).min
  L_other = other_seg.shape[1]
  smin = _groups(own_seg, rows, big).min(-1)            # [B, G]
  smax = _groups(own_seg, rows, small).max(-1)
  pmin = _groups(pos, rows, big).min(-1)
  pmax = _groups(pos, rows, small).max(-1)
  idx = jnp.arange(L_other, dtype=jnp.int32)
  other = other_seg[:, None, :]                          # [B, 1, L_other]
  hit = (other >= smin[..., None]) & (other <= smax[..., None])
  seg_lo = jnp.where(hit, idx, L_other).min(-1)
  seg_hi = jnp.where(hit, idx + 1, 0).max(-1)
  count = hit.sum(-1, dtype=jnp.int32)
  one_run = (smin == smax) & (count == seg_hi - seg_lo)

  lo, hi = seg_lo, seg_hi
  full_lo, full_hi = seg_lo, seg_hi
  if band_lo is not None:
    lo = jnp.maximum(lo, pmin - band_lo)
    full_lo = jnp.maximum(full_lo, pmax - band_lo)
  if band_hi is not None:
    hi = jnp.minimum(hi, pmax + band_hi + 1)
    full_hi = jnp.minimum(full_hi, pmin + band_hi + 1)
  lo = jnp.clip(lo, 0, L_other)
  hi = jnp.clip(hi, 0, L_other)
  empty = hi <= lo
  lo, hi = jnp.where(empty, 0, lo), jnp.where(empty, 0, hi)
  full_lo = jnp.clip(full_lo, lo, hi)
  full_hi = jnp.clip(full_hi, lo, hi)
  no_full = ~one_run | (full_hi <= full_lo)
  full_lo = jnp.where(no_full, 0, full_lo)
  full_hi = jnp.where(no_full, 0, full_hi)
  return jnp.stack([lo, hi, full_lo, full_hi], -1).astype(jnp.int32)


def _side(w):
  return None if w == UNBOUNDED else w


def q_spans(spec: AttentionSpec, q_seg, kv_seg, q_shift=None, rows=ROWS):
  """[B, ceil(T / rows), 4] int32: per tile of query rows, the keys (lo, hi,
  full_lo, full_hi) as in the module docstring."""
  T = q_seg.shape[1]
  pos = jnp.arange(T, dtype=jnp.int32)[None, :] + spec.kv_offset
  if q_shift is not None:
    pos = pos + q_shift
  pos = jnp.broadcast_to(pos, q_seg.shape)
  # Row i sees key j iff pos_i - left <= j <= pos_i + right.
  return _summary(q_seg, kv_seg, pos, _side(spec.window_left),
                  _side(spec.window_right), rows)


def kv_spans(spec: AttentionSpec, q_seg, kv_seg, kv_shift=None, rows=ROWS):
  """[B, ceil(S / rows), 4] int32: per tile of keys, the query rows (lo, hi,
  full_lo, full_hi) that see them."""
  S = kv_seg.shape[1]
  pos = jnp.arange(S, dtype=jnp.int32)[None, :] - spec.kv_offset
  if kv_shift is not None:
    pos = pos - kv_shift
  pos = jnp.broadcast_to(pos, kv_seg.shape)
  # Key j is seen by row i iff pos_j - right <= i <= pos_j + left.
  return _summary(kv_seg, q_seg, pos, _side(spec.window_right),
                  _side(spec.window_left), rows)
