"""Pallas forward kernel: one program per (query block, batch, head).

Each program keeps its query tile [block_q, D] resident, walks only the KV
blocks that can be visible (`masking.kv_block_range`), folds each block into
the online-softmax state (`softmax.update`, base 2), and writes O and the
natural-log LSE once at the end. The mask is computed only on edge blocks;
interior blocks of a causal/window band skip it.

Grid order (q block, batch, head) puts the q block on Triton's fastest grid
axis, so neighbouring programs share the same K/V in L2. With a bounded right
window (causal) the q blocks run last-first: they have the most KV blocks, and
starting them first shortens the tail of the launch.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jax_flash._src.core import dropout as dropout_rng
from jax_flash._src.core import masking
from jax_flash._src.core import softmax
from jax_flash._src.core import tile_spans
from jax_flash._src.backends.pallas import common
from jax_flash._src.backends.pallas.config import KernelConfig
from jax_flash._src.core.spec import UNBOUNDED, AttentionSpec


def _kernel(q_ref, k_ref, v_ref, *refs, spec: AttentionSpec, block_q: int,
            block_k: int, num_q_blocks: int, num_kv_blocks: int,
            mode: common.MaskMode, reverse: bool, acc_dtype):
  o_ref, lse_ref = refs[-2:]  # inputs may also hold aliased poison buffers
  if spec.has_sinks:  # the sink logit of every row, before the mask inputs
    sink_ref, refs = refs[0], refs[1:]
  q_seg_ref, kv_seg_ref, q_shift_ref, _, span_ref = common.mask_refs(refs, spec)
  # Dropout: the generator's key words follow the segment ids.
  key = common.dropout_key(refs, spec)
  batch, head = pl.program_id(1), pl.program_id(2)  # (not inside loops: interpret mode)

  i = pl.program_id(0)
  if reverse:
    i = num_q_blocks - 1 - i
  q_start = i * block_q
  q = q_ref[...]  # [block_q, D]
  q_pos = common.positions(q_start, block_q, axis=0)
  q_seg = None if q_seg_ref is None else q_seg_ref[...][:, None]
  q_shift = None if q_shift_ref is None else q_shift_ref[...][:, None]

  def kv_block(j, state, masked):
    k_start = common.block_start(j, block_k)
    rows = pl.ds(k_start, block_k)
    mask = None
    if masked:
      k_pos = common.positions(k_start, block_k, axis=1)
      k_seg = None if kv_seg_ref is None else kv_seg_ref[rows][None, :]
      mask = masking.visible(spec, q_pos, k_pos, q_seg, k_seg, q_shift)
    k, v = common.seen_only(mask, q_pos, spec.q_len, 0, k_ref[rows, :],
                            v_ref[rows, :])
    s = softmax.scores_base2(spec, common.dot(q, k, acc_dtype, trans_b=True))
    keep = common.dropout_keep(spec, key, batch, head, q_pos,
                               common.positions(k_start, block_k, axis=1))
    rate = spec.dropout_rate
    pv = lambda p: common.dot(dropout_rng.apply(p, keep, rate).astype(v.dtype),
                              v, acc_dtype)
    return softmax.update(state, s, mask, pv, base2=True)

  first, last = masking.kv_block_range(spec, q_start, block_q, block_k,
                                       num_kv_blocks)
  full = masking.kv_block_full_range(spec, q_start, block_q, block_k)
  first, last, full = common.narrow(span_ref, i, first, last, full)
  state = softmax.init_state((block_q,), (block_q, v_ref.shape[-1]),
                             acc_dtype)
  if spec.has_sinks:
    state = softmax.with_sink(state, sink_ref[...], base2=True)
  state = common.visit_blocks(first, last, full, kv_block, state, mode)
  o, lse = softmax.finalize(state, base2=True)
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse.astype(lse_ref.dtype)


def forward(spec: AttentionSpec, q, k, v, q_seg, kv_seg, *,
            cfg: KernelConfig, interpret: bool, shifts=None,
            dropout_key=None, sinks=None):
  """(o [B,T,H,D_v], lse [B,H,T]) for canonical inputs (see spec.py).
  shifts: None or (q_shift, kv_shift) with spec.has_shifts; dropout_key:
  None or the key words (core/dropout.py key_words) with spec.has_dropout; sinks: None or [B, H] with
  spec.has_sinks, as xla.forward."""
  B, T, H, D = q.shape
  S, H_kv, Dv = k.shape[1], k.shape[2], v.shape[3]
  group = H // H_kv
  acc_dtype = softmax.accum_dtype(q.dtype)
  bq, bk = common.fit_block(cfg.block_q, T), common.fit_block(cfg.block_k, S)
  Tp, Sp = common.round_up(T, bq), common.round_up(S, bk)
  Dp, Dvp = common.padded_head_dim(D), common.padded_head_dim(Dv)
  nq, nk = Tp // bq, Sp // bk
  reverse = spec.window_right != UNBOUNDED

  def q_block(i):
    return nq - 1 - i if reverse else i

  def kv_head(h):
    return h if group == 1 else lax.div(h, np.int32(group))

  args = [common.pad_to(q, {1: Tp, 3: Dp}),
          common.pad_to(k, {1: Sp, 3: Dp}),
          common.pad_to(v, {1: Sp, 3: Dvp})]
  q_tile = pl.BlockSpec((None, bq, None, Dp),
                        lambda i, b, h: (b, q_block(i), h, 0))
  o_tile = pl.BlockSpec((None, bq, None, Dvp),
                        lambda i, b, h: (b, q_block(i), h, 0))
  # K/V: the whole (padded) sequence of one kv head; the kernel slices it.
  kv_all = pl.BlockSpec((None, Sp, None, Dp),
                        lambda i, b, h: (b, 0, kv_head(h), 0))
  v_all = pl.BlockSpec((None, Sp, None, Dvp),
                       lambda i, b, h: (b, 0, kv_head(h), 0))
  row_tile = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, q_block(i)))
  in_specs = [q_tile, kv_all, v_all]
  if spec.has_sinks:
    # Per row, like the lse: a tile load the Triton lowering handles as any
    # other (a scalar per (batch, head) would need a gather).
    args.append(jnp.broadcast_to(sinks.astype(acc_dtype)[..., None],
                                 (B, H, Tp)))
    in_specs.append(row_tile)
  if spec.has_segment_ids:
    pad = lambda pair: (common.pad_to(pair[0], {1: Tp}),
                        common.pad_to(pair[1], {1: Sp}))
    spans = common.span_blocks(tile_spans.q_spans(
        spec, q_seg, kv_seg, shifts[0] if shifts else None, rows=bq), bk, nk,
        nq)
    more, more_specs = common.mask_inputs(
        spec, pad((q_seg, kv_seg)), pad(shifts) if shifts else None, spans,
        [pl.BlockSpec((None, bq), lambda i, b, h: (b, q_block(i))),
         pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0))],
        pl.BlockSpec((None,) + spans.shape[1:], lambda i, b, h: (b, 0, 0)))
    args += more
    in_specs += more_specs
  args, in_specs = common.with_dropout_key(args, in_specs, dropout_key)
  out_specs = [o_tile, row_tile]
  out_shapes = [common.sds((B, Tp, H, Dvp), q.dtype),
                common.sds((B, H, Tp), acc_dtype)]

  kernel = functools.partial(
      _kernel, spec=spec, block_q=bq, block_k=bk, num_q_blocks=nq,
      num_kv_blocks=nk, mode=common.mask_mode(spec, Tp, Sp), reverse=reverse,
      acc_dtype=acc_dtype)
  o, lse = common.launch(kernel, name="jax_flash_fwd", grid=(nq, B, H),
                         args=args, in_specs=in_specs, out_specs=out_specs,
                         out_shapes=out_shapes, interpret=interpret, cfg=cfg)
  return common.unpad(o, {1: T, 3: Dv}), common.unpad(lse, {2: T})
