"""The decoding kernels (decode/cuda.py) as a differentiable op.

The kernels have no backward: the op's gradients come from the reference
path, `attention(..., kv_seq_lengths=)` on each sequence's gathered keys
(sequences.py), recomputed in the backward. Sharding and vmap are
sharding/decode.py's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_flash._src.api import attention as api
from jax_flash._src.autodiff.differentiable import Kernels, differentiable
from jax_flash._src.decode import cuda as decode_cuda
from jax_flash._src.decode import sequences
from jax_flash._src.sharding import decode as decode_sharding


class KernelOptions(NamedTuple):
  """The static options of the kernel call (hashable: one op per options)."""
  scale: float
  softcap: float | None
  window_left: int
  window_right: int
  num_splits: int | None
  identity_rows: bool  # contiguous cache, row b = sequence b (sharding)


@functools.lru_cache(maxsize=None)
def decode_op(opts: KernelOptions, fp8: bool, sinks: bool):
  """fn(q, k_pages, v_pages, *rest) -> (o, lse): the decoding kernels, with
  gradients through the reference path.

  rest: (sinks [B, H] float32 with `sinks`, k_descale, v_descale with fp8,
  table, lengths). The sinks' gradient is the one of every op
  (autodiff/sinks.py, from o and lse); the backward holds them fixed.
  """

  def forward(q, k_pages, v_pages, *rest):
    return _call(opts, fp8, sinks, q, k_pages, v_pages, *rest)

  def attend_one(q, k, v, length, sink_logits):
    return api.attention(
        q, k, v, scale=opts.scale, softcap=opts.softcap,
        window=(opts.window_left, opts.window_right), kv_seq_lengths=length,
        sinks=sink_logits, return_lse=True)

  def attend(q, k, v, lengths, sink_logits):
    if sink_logits is None:
      return attend_one(q, k, v, lengths, None)
    # Each sequence with its own row of logits (a vmap folds into the batch).
    return jax.vmap(attend_one)(q, k, v, lengths, sink_logits)

  def backward(q, k_pages, v_pages, o, lse, do, dlse, *rest):
    del o, lse
    sink_logits = rest[0] if sinks else None
    rest = rest[1:] if sinks else rest
    if fp8:
      # d/dq on the dequantised cache (the cache itself is data, not a
      # parameter: no cotangent).
      k_descale, v_descale, table, lengths = rest
      lengths = _within_capacity(lengths, table, k_pages)
      deq = lambda x8, d: sequences.gather_dequantized(x8, d, table, q.dtype)
      k, v = deq(k_pages, k_descale), deq(v_pages, v_descale)
      _, vjp = jax.vjp(lambda q: attend(q, k, v, lengths, sink_logits), q)
      (dq,) = vjp((do, dlse))
      return dq, None, None
    table, lengths = rest
    lengths = _within_capacity(lengths, table, k_pages)
    _, vjp = jax.vjp(
        lambda q, k_pages, v_pages: attend(
            q, sequences.gather(k_pages, table),
            sequences.gather(v_pages, table), lengths, sink_logits),
        q, k_pages, v_pages)
    return vjp((do, dlse))

  return differentiable(Kernels(forward, backward, delta=False, sinks=sinks))


def _within_capacity(lengths, table, pages):
  """The lengths as the kernels read them: clamped to [0, the capacity of
  each sequence's pages] (attention_with_kvcache passes them unclamped)."""
  return jnp.clip(lengths, 0, table.shape[1] * pages.shape[1])


def _call(opts, fp8, sinks, q, *operands):
  """The kernels under sharding/decode.py's partitioning and vmap rule."""
  if sinks:  # the sinks go last there, after the per-sequence lengths
    operands = operands[:2] + operands[3:] + operands[2:3]

  def body(*args):
    extra = {}
    if sinks:
      *args, extra["sinks"] = args
    return decode_cuda.forward(
        *args, scale=opts.scale, softcap=opts.softcap,
        window_left=opts.window_left, window_right=opts.window_right,
        num_splits=opts.num_splits, **extra)

  H_kv = operands[0].shape[2]
  # attention_with_kvcache passes identity rows' table as a constant.
  return decode_sharding.decode_call(
      body, identity_rows=opts.identity_rows, rows=q.shape[0],
      group=q.shape[2] // H_kv,
      kv_heads=H_kv, fp8=fp8, sinks=sinks)(q, *operands)
