"""Pieces shared by the Pallas kernels: tiling, padding, the block loop,
matmuls, launch parameters and output poisoning.

Everything inside a kernel must lower through Pallas' Triton backend as well
as run in interpret mode, so the kernels stick to: 2-D `lax.dot_general`,
elementwise jnp, row reductions, `pl.ds` slices of refs with power-of-two
sizes, and `lax.fori_loop` (which the Triton lowering turns into `scf.for`,
the loop form Triton software-pipelines).
"""

from __future__ import annotations

import enum
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_flash._src.core import dropout as dropout_rng
from jax_flash._src.backends.pallas.config import KernelConfig
from jax_flash._src.core.spec import AttentionSpec

POISON_ENV = "JAX_FLASH_POISON_OUTPUTS"
MIN_BLOCK = 16  # Triton's tl.dot needs every matmul dim >= 16


def next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def fit_block(block: int, length: int) -> int:
  """The configured tile, shrunk for short sequences (power of two >= 16)."""
  return max(MIN_BLOCK, min(next_pow2(block), next_pow2(length)))


def padded_head_dim(head_dim: int) -> int:
  """Triton tensors need power-of-two dims: 96 -> 128 (zeros, sliced away)."""
  return max(MIN_BLOCK, next_pow2(head_dim))


def pad_to(x, sizes: dict[int, int]):
  """Zero-pad axes of x up to the given sizes; no copy when nothing to do."""
  widths = [(0, sizes.get(a, n) - n) for a, n in enumerate(x.shape)]
  if all(hi == 0 for _, hi in widths):
    return x
  return jnp.pad(x, widths)


def unpad(x, sizes: dict[int, int]):
  idx = tuple(slice(0, sizes[a]) if a in sizes else slice(None)
              for a in range(x.ndim))
  return x[idx]


class MaskMode(enum.Enum):
  """Which blocks of a loop need the visibility mask (decided statically)."""
  NONE = "none"    # no window, no segment ids, no padding: never
  EDGES = "edges"  # only blocks outside the fully visible interior
  ALL = "all"      # segment ids: visibility is data-dependent everywhere


def mask_mode(spec: AttentionSpec, q_len_padded: int,
              kv_len_padded: int) -> MaskMode:
  # Segment ids: the tile spans (`span_blocks`) give each tile its fully
  # visible blocks, so only the edges take the mask there too.
  if spec.has_segment_ids:
    return MaskMode.EDGES
  if (spec.has_window or q_len_padded != spec.q_len or
      kv_len_padded != spec.kv_len):
    return MaskMode.EDGES
  return MaskMode.NONE


def visit_blocks(first, last, full, body, carry, mode: MaskMode):
  """carry = body(idx, carry, masked) for idx in [first, last).

  With MaskMode.EDGES the loop is split in three so that the interior blocks
  `full` = [lo, hi) run without computing the mask; each piece is its own
  `fori_loop` (so Triton pipelines each one).
  """
  if mode is not MaskMode.EDGES:
    masked = mode is MaskMode.ALL
    return lax.fori_loop(first, last,
                         functools.partial(body, masked=masked), carry)
  lo = jnp.minimum(jnp.maximum(full[0], first), last)
  hi = jnp.minimum(jnp.maximum(full[1], lo), last)
  with_mask = functools.partial(body, masked=True)
  carry = lax.fori_loop(first, lo, with_mask, carry)
  carry = lax.fori_loop(lo, hi, functools.partial(body, masked=False), carry)
  return lax.fori_loop(hi, last, with_mask, carry)


def positions(start, size: int, axis: int):
  """Absolute indices start + [0, size) laid out along `axis` of a 2-D tile."""
  shape = (size, 1) if axis == 0 else (1, size)
  return start + lax.broadcasted_iota(jnp.int32, shape, axis)


# The key words' input, padded to a power of two (Triton's block shapes).
_KEY_BLOCK = 8


def with_dropout_key(args: list, in_specs: list, dropout_key):
  """(args, in_specs) with the dropout key words (k0, k1, batch0, head0,
  row0, col0: dropout.key_words) appended as one uint32 [8] input (zero
  padded) after the segment ids (unchanged without dropout)."""
  if dropout_key is None:
    return list(args), list(in_specs)
  words = [jnp.asarray(w, jnp.uint32).reshape(()) for w in dropout_key]
  words = jnp.stack(words + [jnp.uint32(0)] * (_KEY_BLOCK - len(words)))
  spec = pl.BlockSpec((_KEY_BLOCK,), lambda *_: (0,))
  return list(args) + [words], list(in_specs) + [spec]


def dropout_key(refs, spec):
  """The kernel's key words from its dropout input (with_dropout_key), or None."""
  if not spec.has_dropout:
    return None
  # Scalar loads from the ref (a slice of a loaded array is not a primitive
  # Triton lowers).
  words = refs[n_mask_refs(spec)]
  return tuple(words[i] for i in range(dropout_rng.N_WORDS))


def n_mask_refs(spec: AttentionSpec) -> int:
  """Mask inputs before the dropout key: segment ids (q, kv), with
  spec.has_shifts the shifts (q, kv), then the span blocks."""
  if not spec.has_segment_ids:
    return 0
  return 5 if spec.has_shifts else 3


def mask_refs(refs, spec: AttentionSpec):
  """(q_seg, kv_seg, q_shift, kv_shift, spans) refs (None when absent)."""
  if not spec.has_segment_ids:
    return (None,) * 5
  if spec.has_shifts:
    return tuple(refs[:5])
  return refs[0], refs[1], None, None, refs[2]


def mask_inputs(spec, segs, shifts, spans, seg_specs, span_spec):
  """(args, in_specs) of the mask inputs in `mask_refs` order: segs and
  shifts (each a (q, kv) pair, padded) with their BlockSpecs seg_specs."""
  if not spec.has_segment_ids:
    return [], []
  args, specs = list(segs), list(seg_specs)
  if spec.has_shifts:
    args += list(shifts)
    specs += list(seg_specs)
  return args + [spans], specs + [span_spec]


def span_blocks(spans, block: int, n_blocks: int, n_tiles: int):
  """Tile spans (tile_spans.py, one tile per kernel block) as block indices
  [B, 4, P] int32 (P = a power of two >= n_tiles, the kernel's tiles; tiles
  past the spans' end see nothing): the first and
  last + 1 blocks of `block` that meet [lo, hi), and the first and last + 1
  blocks inside [full_lo, full_hi)."""
  lo, hi, full_lo, full_hi = (spans[..., c] for c in range(4))
  out = jnp.stack([lo // block, -(-hi // block), -(-full_lo // block),
                   full_hi // block], axis=1)
  out = jnp.minimum(out, n_blocks).astype(jnp.int32)
  P = next_pow2(max(n_tiles, out.shape[-1]))
  return jnp.pad(out, ((0, 0), (0, 0), (0, P - out.shape[-1])))


def narrow(span_ref, tile, first, last, full):
  """[first, last) and the full range narrowed by the tile's span blocks."""
  if span_ref is None:
    return first, last, full
  lo, hi = span_ref[0, tile], span_ref[1, tile]
  first = jnp.maximum(first, lo)
  last = jnp.maximum(jnp.minimum(last, hi), first)
  return first, last, (span_ref[2, tile], span_ref[3, tile])


def dropout_keep(spec, key, batch, head, rows, cols):
  """The keep mask of a kernel tile (dropout.tile_keep) or None."""
  return dropout_rng.tile_keep(spec, key, batch, head, rows, cols)


def seen_only(mask, q_pos, q_len, axis: int, *blocks):
  """Key blocks [block_k, D] with the keys that no real query row of the tile
  sees set to 0 (mask: the tile's visibility, queries along `axis`; None:
  all visible). Such keys (past a length, in a segment no query has) may
  hold anything, NaN included, which a product with their probability 0
  would still carry into the output; a key some row sees holds the caller's
  data."""
  if mask is None:
    return blocks
  seen = jnp.max(jnp.where(mask & (q_pos < q_len), 1, 0), axis=axis) > 0
  return tuple(jnp.where(seen[:, None], x, jnp.zeros((), x.dtype))
               for x in blocks)


def seeing_only(mask, axis: int, *blocks):
  """Query blocks [block_q, D] with the rows that see no key of the tile set
  to 0 (mask: the tile's visibility, keys along `axis`; None: all visible).
  Such rows (outside every sequence, in a segment without keys) may hold
  anything, NaN included; their probabilities are 0, but their scores still
  meet the softcap's derivative and dS^T Q in the backward."""
  if mask is None:
    return blocks
  seeing = jnp.max(jnp.where(mask, 1, 0), axis=axis) > 0
  return tuple(jnp.where(seeing[:, None], x, jnp.zeros((), x.dtype))
               for x in blocks)


def block_start(idx, block: int):
  # The hint lets Triton prove alignment and vectorise the tile loads.
  return pl.multiple_of(idx * block, block)


def dot(a, b, acc_dtype, *, trans_a: bool = False, trans_b: bool = False):
  """2-D matmul in the input dtype with acc_dtype accumulation.

  float32 inputs ask for HIGHEST precision (IEEE on Triton, not TF32) so the
  float32 path is as accurate as the XLA backend's.
  """
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  precision = (lax.Precision.HIGHEST
               if jnp.dtype(a.dtype) in (jnp.float32, jnp.float64) else None)
  return lax.dot_general(a, b, dims, precision=precision,
                         preferred_element_type=acc_dtype)


def compiler_params(interpret: bool, cfg: KernelConfig):
  if interpret:
    return None
  # The Triton CompilerParams type is what selects the Triton lowering on GPU
  # (jax 0.11 otherwise may pick Mosaic GPU, which has no `dot` lowering).
  from jax.experimental.pallas import triton as pltriton
  return pltriton.CompilerParams(num_warps=cfg.num_warps,
                                 num_stages=cfg.num_stages)


def poison_requested() -> bool:
  return os.environ.get(POISON_ENV, "") not in ("", "0")


def with_poisoned_outputs(args: list, in_specs: list, out_specs: list,
                          out_shapes: list):
  """Append NaN-filled output buffers, aliased to the outputs.

  An element the kernel fails to write then stays NaN and the tests see it.
  Only done when JAX_FLASH_POISON_OUTPUTS is set (at trace time).
  Returns (args, in_specs, input_output_aliases).
  """
  if not poison_requested():
    return args, in_specs, {}
  first = len(args)
  poison = [jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shapes]
  aliases = {first + n: n for n in range(len(out_shapes))}
  return args + poison, in_specs + list(out_specs), aliases


def launch(kernel, *, name: str, grid, args, in_specs, out_specs, out_shapes,
           interpret: bool, cfg: KernelConfig):
  """pl.pallas_call with the shared plumbing (poisoning, Triton params)."""
  args, in_specs, aliases = with_poisoned_outputs(list(args), list(in_specs),
                                                  out_specs, out_shapes)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shapes,
      input_output_aliases=aliases,
      interpret=interpret,
      compiler_params=compiler_params(interpret, cfg),
      name=name,
  )(*args)


def sds(shape, dtype):
  return jax.ShapeDtypeStruct(tuple(shape), dtype)
