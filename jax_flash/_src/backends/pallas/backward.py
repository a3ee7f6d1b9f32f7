"""Pallas backward kernels: dQ, and dK/dV, as two launches (no atomics).

Both recompute P = exp(S - LSE) from the saved natural-log LSE and use
delta = rowsum(dO * O) - dLSE, computed once by autodiff/derivatives.py.

* dQ: one program per (query block, batch, head), like the forward; loops over
  the visible KV blocks and accumulates dQ = sum dS K in fp32 registers.
* dK/dV: one program per (KV block, batch, kv head). For GQA/MQA it loops over
  the q heads of its group inside the kernel, so dK/dV are summed over the
  group in registers and written once (no [B,S,H,D] fp32 intermediate). It
  works on transposed tiles (keys on rows: S^T = K Q^T) so that P^T and dS^T
  feed the dV/dK matmuls without a register transpose, as the Triton
  fused-attention tutorial does.

Results are deterministic: every output tile is written by one program.
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


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
               spec: AttentionSpec, block_q: int, block_k: int,
               num_q_blocks: int, num_kv_blocks: int, mode: common.MaskMode,
               reverse: bool, acc_dtype):
  dq_ref = refs[-1]
  q_seg_ref, kv_seg_ref, q_shift_ref, _, span_ref = common.mask_refs(refs, spec)
  key = common.dropout_key(refs, spec)
  rate = spec.dropout_rate
  batch, head = pl.program_id(1), pl.program_id(2)  # (not inside loops: interpret mode)

  i = pl.program_id(0)
  if reverse:
    i = num_q_blocks - 1 - i
  q_start = i * block_q
  q, do = q_ref[...], do_ref[...]  # [block_q, D], [block_q, D_v]
  lse, delta = lse_ref[...], delta_ref[...]  # [block_q]
  q_pos = common.positions(q_start, block_q, axis=0)
  q_seg = None if q_seg_ref is None else q_seg_ref[...][:, None]
  q_shift = None if q_shift_ref is None else q_shift_ref[...][:, None]

  def kv_block(j, dq, masked):
    k_start = common.block_start(j, block_k)
    rows = pl.ds(k_start, block_k)
    mask = None
    if masked:
      k_pos = common.positions(k_start, block_k, axis=1)
      k_seg = None if kv_seg_ref is None else kv_seg_ref[rows][None, :]
      mask = masking.visible(spec, q_pos, k_pos, q_seg, k_seg, q_shift)
    k, v = common.seen_only(mask, q_pos, spec.q_len, 0, k_ref[rows, :],
                            v_ref[rows, :])
    (q_b,) = common.seeing_only(mask, 1, q)
    qk = common.dot(q_b, k, acc_dtype, trans_b=True)  # [block_q, block_k]
    s = softmax.scores_base2(spec, qk)
    p = softmax.probs_from_lse(s, lse, mask, base2=True)
    keep = common.dropout_keep(spec, key, batch, head, q_pos,
                               common.positions(k_start, block_k, axis=1))
    dp = dropout_rng.apply(common.dot(do, v, acc_dtype, trans_b=True), keep,
                           rate)
    ds = softmax.scores_grad(spec, qk, p * (dp - delta[:, None]))
    return dq + common.dot(ds.astype(k.dtype), k, acc_dtype)

  first, last = masking.kv_block_range(spec, q_start, block_q, block_k,
                                       num_kv_blocks)
  full = masking.kv_block_full_range(spec, q_start, block_q, block_k)
  first, last, full = common.narrow(span_ref, i, first, last, full)
  dq = jnp.zeros(q.shape, acc_dtype)
  dq = common.visit_blocks(first, last, full, kv_block, dq, mode)
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
                 spec: AttentionSpec, block_q: int, block_k: int, group: int,
                 num_q_blocks: int, mode: common.MaskMode, acc_dtype):
  dk_ref, dv_ref = refs[-2:]
  q_seg_ref, kv_seg_ref, q_shift_ref, _, span_ref = common.mask_refs(refs, spec)
  key = common.dropout_key(refs, spec)
  rate = spec.dropout_rate
  batch, kv_head = pl.program_id(1), pl.program_id(2)  # (not inside loops)

  k_start = pl.program_id(0) * block_k
  k, v = k_ref[...], v_ref[...]  # [block_k, D], [block_k, D_v]
  k_pos = common.positions(k_start, block_k, axis=0)
  k_seg = None if kv_seg_ref is None else kv_seg_ref[...][:, None]

  def q_block(g, i, carry, masked):
    dk, dv = carry
    q_start = common.block_start(i, block_q)
    rows = pl.ds(q_start, block_q)
    q, do = q_ref[rows, g, :], do_ref[rows, g, :]  # [block_q, D], [.., D_v]
    lse, delta = lse_ref[g, rows], delta_ref[g, rows]  # [block_q]
    mask_t = None
    k_b, v_b = k, v
    if masked:
      q_pos = common.positions(q_start, block_q, axis=1)
      q_seg = None if q_seg_ref is None else q_seg_ref[rows][None, :]
      q_shift = None if q_shift_ref is None else q_shift_ref[rows][None, :]
      mask_t = masking.visible(spec, q_pos, k_pos, q_seg, k_seg, q_shift)
      k_b, v_b = common.seen_only(mask_t, q_pos, spec.q_len, 1, k, v)
      (q,) = common.seeing_only(mask_t, 0, q)
    qk_t = common.dot(k_b, q, acc_dtype, trans_b=True)  # [block_k, block_q]
    s_t = softmax.scores_base2(spec, qk_t)
    p_t = softmax.probs_from_lse(s_t, lse, mask_t, base2=True,
                                 transposed=True)
    # Transposed tiles: rows are keys, columns queries (q head h G + g).
    keep_t = common.dropout_keep(spec, key, batch, kv_head * group + g,
                                 common.positions(q_start, block_q, axis=1),
                                 k_pos)
    dv = dv + common.dot(dropout_rng.apply(p_t, keep_t, rate).astype(do.dtype),
                         do, acc_dtype)
    dp_t = dropout_rng.apply(common.dot(v_b, do, acc_dtype, trans_b=True),
                             keep_t, rate)
    ds_t = softmax.scores_grad(spec, qk_t, p_t * (dp_t - delta[None, :]))
    dk = dk + common.dot(ds_t.astype(q.dtype), q, acc_dtype)
    return dk, dv

  first, last = masking.q_block_range(spec, k_start, block_k, block_q,
                                      num_q_blocks)
  full = masking.q_block_full_range(spec, k_start, block_k, block_q)
  first, last, full = common.narrow(span_ref, pl.program_id(0), first, last,
                                    full)

  def q_head(g, carry):
    return common.visit_blocks(first, last, full,
                               functools.partial(q_block, g), carry, mode)

  zeros = (jnp.zeros(k.shape, acc_dtype), jnp.zeros(v.shape, acc_dtype))
  if group == 1:
    dk, dv = q_head(0, zeros)
  else:
    dk, dv = lax.fori_loop(0, group, q_head, zeros)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(spec: AttentionSpec, q, k, v, o, lse, do, delta, q_seg, kv_seg,
             *, dq_cfg: KernelConfig, dkdv_cfg: KernelConfig,
             interpret: bool, shifts=None, dropout_key=None):
  """(dq, dk, dv) for canonical inputs; delta = rowsum(do*o) - dlse.
  shifts, dropout_key: as forward (the mask is drawn again)."""
  del o  # only needed through delta
  B, T, H, D = q.shape
  S, H_kv, Dv = k.shape[1], k.shape[2], v.shape[3]
  group = H // H_kv
  acc_dtype = softmax.accum_dtype(q.dtype)
  bq_dq, bk_dq = (common.fit_block(dq_cfg.block_q, T),
                  common.fit_block(dq_cfg.block_k, S))
  bq_kv, bk_kv = (common.fit_block(dkdv_cfg.block_q, T),
                  common.fit_block(dkdv_cfg.block_k, S))
  # One padding serves both kernels (block sizes are powers of two).
  Tp = common.round_up(T, max(bq_dq, bq_kv))
  Sp = common.round_up(S, max(bk_dq, bk_kv))
  Dp, Dvp = common.padded_head_dim(D), common.padded_head_dim(Dv)
  mode = common.mask_mode(spec, Tp, Sp)

  q, do = common.pad_to(q, {1: Tp, 3: Dp}), common.pad_to(do, {1: Tp, 3: Dvp})
  k, v = common.pad_to(k, {1: Sp, 3: Dp}), common.pad_to(v, {1: Sp, 3: Dvp})
  # Padded rows are masked, so their lse/delta values are never used.
  lse, delta = (common.pad_to(x.astype(acc_dtype), {2: Tp})
                for x in (lse, delta))
  segs = None
  if spec.has_segment_ids:
    pad = lambda pair: (common.pad_to(pair[0], {1: Tp}),
                        common.pad_to(pair[1], {1: Sp}))
    q_shift, kv_shift = shifts if shifts else (None, None)
    dq_spans = common.span_blocks(tile_spans.q_spans(
        spec, q_seg, kv_seg, q_shift, rows=bq_dq), bk_dq, Sp // bk_dq,
        Tp // bq_dq)
    kv_spans = common.span_blocks(tile_spans.kv_spans(
        spec, q_seg, kv_seg, kv_shift, rows=bk_kv), bq_kv, Tp // bq_kv,
        Sp // bk_kv)
    segs = (pad((q_seg, kv_seg)), pad(shifts) if shifts else None,
            dq_spans, kv_spans)

  dq = _dq(spec, q, k, v, do, lse, delta, segs, bq_dq, bk_dq, group, mode,
           acc_dtype, dq_cfg, interpret, dropout_key)
  dk, dv = _dkdv(spec, q, k, v, do, lse, delta, segs, bq_kv, bk_kv, group,
                 mode, acc_dtype, dkdv_cfg, interpret, dropout_key)
  return (common.unpad(dq, {1: T, 3: D}), common.unpad(dk, {1: S, 3: D}),
          common.unpad(dv, {1: S, 3: Dv}))


def _dq(spec, q, k, v, do, lse, delta, segs, bq, bk, group, mode, acc_dtype,
        cfg, interpret, dropout_key):
  B, Tp, H, Dp = q.shape
  Sp, Dvp = k.shape[1], v.shape[3]
  nq, nk = Tp // bq, Sp // bk
  reverse = spec.window_right != UNBOUNDED  # heaviest q blocks first

  def q_block(i):
    return nq - 1 - i if reverse else i

  def kv_head(h):
    return h if group == 1 else lax.div(h, np.int32(group))

  q_tile = pl.BlockSpec((None, bq, None, Dp),
                        lambda i, b, h: (b, q_block(i), h, 0))
  o_tile = pl.BlockSpec((None, bq, None, Dvp),
                        lambda i, b, h: (b, q_block(i), h, 0))
  kv_all = pl.BlockSpec((None, Sp, None, Dp),
                        lambda i, b, h: (b, 0, kv_head(h), 0))
  v_all = pl.BlockSpec((None, Sp, None, Dvp),
                       lambda i, b, h: (b, 0, kv_head(h), 0))
  row_tile = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, q_block(i)))
  in_specs = [q_tile, kv_all, v_all, o_tile, row_tile, row_tile]
  mask_args = []
  if segs:
    ids, shifts, spans, _ = segs
    mask_args, mask_specs = common.mask_inputs(
        spec, ids, shifts, spans,
        [pl.BlockSpec((None, bq), lambda i, b, h: (b, q_block(i))),
         pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0))],
        pl.BlockSpec((None,) + spans.shape[1:], lambda i, b, h: (b, 0, 0)))
    in_specs += mask_specs
  args, in_specs = common.with_dropout_key(
      [q, k, v, do, lse, delta, *mask_args], in_specs, dropout_key)
  kernel = functools.partial(
      _dq_kernel, spec=spec, block_q=bq, block_k=bk, num_q_blocks=nq,
      num_kv_blocks=nk, mode=mode, reverse=reverse, acc_dtype=acc_dtype)
  (dq,) = common.launch(
      kernel, name="jax_flash_bwd_dq", grid=(nq, B, H),
      args=args, in_specs=in_specs,
      out_specs=[q_tile], out_shapes=[common.sds(q.shape, q.dtype)],
      interpret=interpret, cfg=cfg)
  return dq


def _dkdv(spec, q, k, v, do, lse, delta, segs, bq, bk, group, mode,
          acc_dtype, cfg, interpret, dropout_key):
  B, Tp, H, Dp = q.shape
  Sp, H_kv, Dvp = k.shape[1], k.shape[2], v.shape[3]
  nq, nk = Tp // bq, Sp // bk

  kv_tile = pl.BlockSpec((None, bk, None, Dp), lambda j, b, h: (b, j, h, 0))
  v_tile = pl.BlockSpec((None, bk, None, Dvp), lambda j, b, h: (b, j, h, 0))
  # Q-side operands: the whole sequence of the `group` q heads of kv head h.
  q_group = pl.BlockSpec((None, Tp, group, Dp), lambda j, b, h: (b, 0, h, 0))
  do_group = pl.BlockSpec((None, Tp, group, Dvp),
                          lambda j, b, h: (b, 0, h, 0))
  rows_group = pl.BlockSpec((None, group, Tp), lambda j, b, h: (b, h, 0))
  in_specs = [q_group, kv_tile, v_tile, do_group, rows_group, rows_group]
  mask_args = []
  if segs:
    ids, shifts, _, spans = segs
    mask_args, mask_specs = common.mask_inputs(
        spec, ids, shifts, spans,
        [pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0)),
         pl.BlockSpec((None, bk), lambda j, b, h: (b, j))],
        pl.BlockSpec((None,) + spans.shape[1:], lambda j, b, h: (b, 0, 0)))
    in_specs += mask_specs
  args, in_specs = common.with_dropout_key(
      [q, k, v, do, lse, delta, *mask_args], in_specs, dropout_key)
  kernel = functools.partial(
      _dkdv_kernel, spec=spec, block_q=bq, block_k=bk, group=group,
      num_q_blocks=nq, mode=mode, acc_dtype=acc_dtype)
  dk, dv = common.launch(
      kernel, name="jax_flash_bwd_dkdv", grid=(nk, B, H_kv),
      args=args, in_specs=in_specs,
      out_specs=[kv_tile, v_tile],
      out_shapes=[common.sds(k.shape, k.dtype), common.sds(v.shape, v.dtype)],
      interpret=interpret, cfg=cfg)
  return dk, dv
