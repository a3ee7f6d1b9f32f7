"""`jax_flash.varlen_attention`: packed sequences given by cumulative lengths.

FlashAttention's varlen layout: the tokens of all sequences are concatenated,
q [total_q, H, D] and k, v [total_k, H_kv, D], and sequence s owns query rows
[cu_seqlens_q[s], cu_seqlens_q[s + 1]) and keys [cu_seqlens_k[s],
cu_seqlens_k[s + 1]). Each sequence attends only within itself; with causal or
a window its queries align to the end of its own keys (bottom-right per
sequence, as chunked prefill needs).

It runs as one packed attention call (batch 1) with segment ids made from the
offsets and, where a band applies, each token's diagonal shift (spec.py): the
kernels then skip every key block outside a tile's sequences (tile_spans.py),
so no tile is spent on padding or on another sequence's keys, and every
backend, transformation (jit, vmap, grad, jvp) and sharding rule of
`jax_flash.attention` applies unchanged.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._src.api import attention as api
from jax_flash._src.backends import ffi
from jax_flash._src.backends import registry as backends
from jax_flash._src.sharding import partition as sharding
from jax_flash._src.core.checks import (check_arrays, check_scale,
                                        check_sinks, check_softcap,
                                        static_bool, window_fields)
from jax_flash._src.core.spec import UNBOUNDED, AttentionSpec
from jax_flash._src.autodiff.differentiable import attention_fn

# Segment ids of tokens outside every sequence: distinct for queries and keys,
# so such a query sees nothing (o = 0, lse = -inf) and such a key is unseen.
Q_OUTSIDE, K_OUTSIDE = -1, -2


def _check_offsets(name, cu, total, max_len, max_name):
  if not hasattr(cu, "shape") or not hasattr(cu, "dtype"):
    raise ValueError(f"{name} must be an integer array [num_seqs + 1], got "
                     f"{type(cu).__name__}")
  if cu.ndim != 1 or cu.shape[0] < 1:
    raise ValueError(f"{name} must be 1-D [num_seqs + 1] (at least one "
                     f"entry); got shape {cu.shape}")
  if not jnp.issubdtype(cu.dtype, jnp.integer):
    raise ValueError(f"{name} must have an integer dtype; got {cu.dtype}")
  if (isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral)
      or max_len < 0):
    raise ValueError(f"{max_name} must be a Python int >= 0 (a static upper "
                     f"bound of the sequence lengths), got {max_len!r}")
  if isinstance(cu, jax.core.Tracer):
    return  # values known only at run time: see the docstring
  c = np.asarray(cu).astype(np.int64)
  if c[0] < 0 or np.any(np.diff(c) < 0):
    raise ValueError(f"{name} must be non-decreasing offsets starting at >= "
                     f"0; got {c.tolist()}")
  if c[-1] > total:
    raise ValueError(f"{name}[-1] = {int(c[-1])} exceeds the {total} tokens "
                     f"of the packed tensor")
  longest = int(np.max(np.diff(c), initial=0))
  if longest > max_len:
    raise ValueError(f"{max_name} = {max_len} is less than the longest "
                     f"sequence in {name} ({longest})")


def _tokens_of(cu, total, outside, per_seq=None):
  """Token -> (sequence index, per_seq[sequence]) [total] int32 each, as
  sums over the sequences of [total, num_seqs] membership (reductions XLA
  fuses into one kernel per side). Outside every sequence: (outside, 0)."""
  pos = jnp.arange(total, dtype=jnp.int32)[:, None]
  cu = cu.astype(jnp.int32)
  inside = (cu[None, :-1] <= pos) & (pos < cu[None, 1:])   # [total, n]
  n = cu.shape[0] - 1
  seq = jnp.sum(jnp.where(inside, jnp.arange(n, dtype=jnp.int32), 0), 1)
  seq = jnp.where(inside.any(1), seq, outside)
  if per_seq is None:
    return seq, None
  return seq, jnp.sum(jnp.where(inside, per_seq[None, :], 0), 1)


def _concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def packing_arrays(cu_q, cu_k, total_q, total_k, banded: bool):
  """(q_seg, kv_seg[, q_shift, kv_shift]) [1, total] int32 of the layout.

  Concrete offsets (known at trace time) give constants, computed here once,
  and ids that agree on every token (one offsets array, no token outside a
  sequence) as one array for both sides: the call is then the same program
  as `jax_flash.attention` with one segment-id array, whose
  unseen-token pass (core/seen.py: q_seg == kv_seg) XLA folds away. Traced
  offsets give a few small fused reductions, and with tokens outside every
  sequence possible, that pass stays (a copy of v in the CUDA forward; of q,
  k and v in its backward).

  Sequence s's rows align to its keys' end: row i sits at key position
  i + cu_k[s + 1] - cu_q[s + 1], i.e. a shift of that minus the packed
  tensors' own bottom-right offset (total_k - total_q). (With decreasing
  traced offsets a token may fall in several sequences: its id and shift are
  then sums, well defined and in range for every kernel, but meaningless.)
  """
  if _concrete(cu_q) and _concrete(cu_k):
    with jax.ensure_compile_time_eval():
      arrays = _packing_arrays(cu_q, cu_k, total_q, total_k, banded)
    arrays = tuple(np.asarray(a) for a in arrays)
    if np.array_equal(arrays[0], arrays[1]):
      arrays = (arrays[0], arrays[0]) + arrays[2:]
    return arrays
  return _packing_arrays(cu_q, cu_k, total_q, total_k, banded)


def _packing_arrays(cu_q, cu_k, total_q, total_k, banded):
  shift = None
  if banded:
    ends = cu_k[1:].astype(jnp.int32) - cu_q[1:].astype(jnp.int32)
    shift = ends - (total_k - total_q)
  q_seg, q_shift = _tokens_of(cu_q, total_q, Q_OUTSIDE, shift)
  kv_seg, kv_shift = _tokens_of(cu_k, total_k, K_OUTSIDE, shift)
  arrays = [q_seg[None], kv_seg[None]]
  if banded:
    arrays += [q_shift[None], kv_shift[None]]
  return tuple(arrays)


def _varlen_fields(cu_q, cu_k, total_q, total_k) -> dict:
  """The spec's varlen fields: with the per-sequence kernel on (the
  default; ffi.varlen_kernel, JAX_FLASH_VARLEN_KERNEL) the segment ids are marked
  as this layout of cu_q.shape[0] - 1 sequences, so that a backend may tile
  by sequence (the CUDA backend derives the offsets back from the ids on
  the device); tokens outside every sequence are ruled out when concrete
  offsets start at 0 and end at the tensors' ends. Off
  (JAX_FLASH_VARLEN_KERNEL=0): no fields, the program of segment ids."""
  if not ffi.varlen_kernel():
    return {}
  outside = True
  if _concrete(cu_q) and _concrete(cu_k):
    cq, ck = np.asarray(cu_q), np.asarray(cu_k)
    outside = not (cq[0] == 0 and cq[-1] == total_q and ck[0] == 0 and
                   ck[-1] == total_k)
  return dict(varlen_seqs=int(cu_q.shape[0]) - 1, varlen_outside=outside,
              varlen_backward=ffi.varlen_bwd_kernel())


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *,
                     max_seqlen_q: int, max_seqlen_k: int,
                     causal: bool = False, scale: float | None = None,
                     window: tuple[int, int] | None = None,
                     softcap: float | None = None, sinks=None,
                     return_lse: bool = False,
                     implementation: str | None = None,
                     deterministic: bool = False):
  """Attention over packed variable-length sequences (FlashAttention's varlen).

  Args:
    q: [total_q, H, D] the queries of all sequences, concatenated.
    k: [total_k, H_kv, D] (H % H_kv == 0: GQA/MQA); v: [total_k, H_kv, D_v]
      (D_v may differ from D; the output has D_v).
    cu_seqlens_q, cu_seqlens_k: int [num_seqs + 1] non-decreasing offsets:
      sequence s is q[cu_seqlens_q[s]:cu_seqlens_q[s + 1]] attending to
      k/v[cu_seqlens_k[s]:cu_seqlens_k[s + 1]]. Query and key lengths may
      differ per sequence; empty sequences are allowed.
    max_seqlen_q, max_seqlen_k: static upper bounds of the lengths
      (FlashAttention's arguments; checked when the offsets are concrete).
    causal: key j visible from query i of the same sequence iff j - start_k
      <= i - start_q + len_k - len_q (bottom-right aligned per sequence).
    scale, window, softcap, sinks, implementation, deterministic: as
      `jax_flash.attention`; the window is per sequence, around the same
      diagonal.
    return_lse: also return the natural-log logsumexp [H, total_q].

  Returns:
    out [total_q, H, D_v] (q.dtype), or (out, lse). Tokens outside every
    sequence (before cu_seqlens_q[0] or from cu_seqlens_q[-1] on) and queries
    of sequences without keys give zeros (lse -inf, or the sink's).

  Offsets that are traced (under jit) are not checked: decreasing offsets
  then give tokens that fall in several sequences a sum of their ids, which
  is well defined and reads nothing out of bounds, but is not a meaningful
  layout.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "ndim") or x.ndim != 3:
      raise ValueError(
          f"varlen_attention: {name} must be [total_tokens, heads, head_dim]"
          f"; got {getattr(x, 'shape', type(x).__name__)} (for batched "
          f"inputs use jax_flash.attention or vmap)")
  check_arrays(q[None], k[None], v[None])
  causal = static_bool(causal, "causal")
  return_lse = static_bool(return_lse, "return_lse")
  deterministic = static_bool(deterministic, "deterministic")
  Tq, H, D = q.shape
  Tk, H_kv = k.shape[0], k.shape[1]
  sinks = check_sinks(sinks, H, q.dtype)
  _check_offsets("cu_seqlens_q", cu_seqlens_q, Tq, max_seqlen_q,
                 "max_seqlen_q")
  _check_offsets("cu_seqlens_k", cu_seqlens_k, Tk, max_seqlen_k,
                 "max_seqlen_k")
  if cu_seqlens_q.shape != cu_seqlens_k.shape:
    raise ValueError(f"cu_seqlens_q {cu_seqlens_q.shape} and cu_seqlens_k "
                     f"{cu_seqlens_k.shape} must have the same length "
                     f"(num_seqs + 1)")
  band = window_fields(window, causal)
  banded = band["window_left"] != UNBOUNDED or band["window_right"] != UNBOUNDED
  # One offsets array for queries and keys (self-attention over a packing):
  # every sequence has as many queries as keys, so no token is shifted off
  # its diagonal, and each token's q and kv ids agree (spec.segments_aligned).
  aligned = cu_seqlens_q is cu_seqlens_k and Tq == Tk
  spec = AttentionSpec(
      **_varlen_fields(cu_seqlens_q, cu_seqlens_k, Tq, Tk),
      scale=check_scale(scale, D), causal=bool(causal), **band,
      softcap=check_softcap(softcap), has_segment_ids=True,
      has_shifts=banded and not aligned, segments_aligned=aligned,
      batch=1, q_len=Tq, kv_len=Tk, num_heads=H,
      num_kv_heads=H_kv, head_dim=D,
      value_head_dim=AttentionSpec.value_head_dim_of(D, v.shape[-1]),
      dtype=jnp.dtype(q.dtype).name,
      deterministic=bool(deterministic), has_sinks=sinks is not None)
  if implementation is not None and not isinstance(implementation, str):
    raise ValueError(f"implementation must be a string or None, got "
                     f"{implementation!r}")
  branches = backends.choose_per_platform(spec, implementation,
                                          api._platform(q))
  if api.no_rows((H,)):
    res = api.empty_result(q[None], return_lse, v.shape[-1])
    return (res[0][0], res[1][0]) if return_lse else res[0]
  packing = packing_arrays(cu_seqlens_q, cu_seqlens_k, Tq, Tk,
                           spec.has_shifts)
  o, lse = backends.run(
      branches, lambda b: lambda *a: sharding.call(
          lambda s: attention_fn(b.name, s), spec, *a),
      q[None], k[None], v[None], *api.per_batch_sinks(sinks, 1), *packing)
  return (o[0], lse[0]) if return_lse else o[0]
