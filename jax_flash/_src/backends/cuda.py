"""The "cuda" backend: hand-written kernels called through XLA FFI.

Python checks every request first (so users get a Python exception at trace
time) and sizes the workspaces the kernels need (extra FFI results, so the
handlers never allocate and stay CUDA-graph compatible). The kernels know
only the bottom-right alignment; specs with another one (ring attention's
blocks) run on prefixes through `bottom_right.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._src.core import bottom_right
from jax_flash._src.core import dropout as dropout_rng
from jax_flash._src.backends import ffi, kernel_table
from jax_flash._src.core import seen, tile_spans
from jax_flash._src.backends.registry import Unsupported, register
from jax_flash._src.core.spec import AttentionSpec

DTYPES = ("bfloat16", "float16")
# The kernels draw dropout's bytes for 64 columns at a time (philox.h
# Dropout): a call's column origin must be a multiple of it.
DROPOUT_COLUMN_CHUNK = 64
MAX_HEAD_DIM = kernel_table.max_head_dim("sm80")


def _round_up(x: int, m: int) -> int:
  return (x + m - 1) // m * m


def rounded_head_dim(d: int) -> int:
  """The sm80 bucket of d (the largest past it), the dq_accum pitch: the rule
  of cuda/include/jax_flash/head_dim.h (tests/test_block_info.py checks that
  they agree)."""
  return kernel_table.bucket("sm80", min(d, MAX_HEAD_DIM))


def dq_accum_pitch(d: int, dv: int) -> int:
  """The dq_accum row pitch of query/key head dim d with value head dim dv:
  rounded_head_dim(d) for one head dim, d itself for a head-dim pair (its
  kernels serve it exactly): head_dim.h's rounded_head_dim(d, dv)."""
  if d == dv:
    return rounded_head_dim(d)
  assert kernel_table.serves_pair("sm80", d, dv), (d, dv)
  return d


def _pairs(family: str) -> str:
  return ", ".join(f"({d}, {dv})" for d, dv in kernel_table.HEAD_DIM_PAIRS[family])


def sm90_bwd_semaphore_ints(batch: int, num_heads: int, seqlen_q: int) -> int:
  """Same rule as cuda/include/jax_flash/params.h: the sm90 deterministic
  backward's workspace, a dQ-order semaphore per (batch, q head, 64-row query
  block) plus its tile-claim counter (int32)."""
  return batch * num_heads * -(-seqlen_q // 64) + 1


def _compute_capability() -> tuple[int, int] | None:
  try:
    dev = jax.devices("gpu")[0]
  except RuntimeError:
    return None
  cc = getattr(dev, "compute_capability", None)
  if cc is None:
    return None
  major, minor = str(cc).split(".")
  return int(major), int(minor)


def packing_ints(batch: int, seqlen_q: int, seqlen_k: int,
                 has_shifts: bool) -> int:
  """Size (int32) of the packing buffer: the same rule as
  cuda/include/jax_flash/packing_layout.h (64-token groups, 8-int span
  entries, a [lo, hi) run per token, the shifts)."""
  groups = -(-seqlen_q // tile_spans.ROWS) + -(-seqlen_k // tile_spans.ROWS)
  n = batch * (8 * groups + 2 * (seqlen_q + seqlen_k))
  return n + (batch * (seqlen_q + seqlen_k) if has_shifts else 0)


def _segments(spec, q_seg, kv_seg, shifts):
  """(q_seg, kv_seg, packing) as the handlers take them: the packing buffer
  (the tile spans of the ids, each token's run, the diagonal shifts) comes
  from the tile-span pre-pass kernel, one launch per call."""
  if not spec.has_segment_ids:
    dummy = jnp.zeros((1,), jnp.int32)  # the handler ignores them
    return dummy, dummy, dummy
  q_seg, kv_seg = q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
  if shifts is None:
    q_shift = kv_shift = jnp.zeros((1,), jnp.int32)
  else:
    q_shift, kv_shift = (s.astype(jnp.int32) for s in shifts)
  B, T = q_seg.shape
  S = kv_seg.shape[1]
  packing = ffi.call(
      ffi.PACKING, jax.ShapeDtypeStruct(
          (packing_ints(B, T, S, spec.has_shifts),), jnp.int32),
      q_seg, kv_seg, q_shift, kv_shift,
      window_left=np.int32(spec.window_left),
      window_right=np.int32(spec.window_right),
      has_shifts=bool(spec.has_shifts))
  return q_seg, kv_seg, packing


class CudaBackend:
  name = "cuda"

  def check(self, spec: AttentionSpec, platform: str) -> None:
    if spec.fp8 is not None:
      # The FP8 requests (fp8_attention) have a kernel of their own.
      # (imported here: fp8/cuda.py imports this module)
      from jax_flash._src.fp8 import cuda as fp8_cuda
      fp8_cuda.check(spec, platform)
      return
    if spec.has_dropout and spec.dropout_origin % DROPOUT_COLUMN_CHUNK:
      raise Unsupported(
          f"implementation='cuda' draws dropout in {DROPOUT_COLUMN_CHUNK}-"
          f"column chunks: ring attention with dropout needs chunks of a "
          f"multiple of {DROPOUT_COLUMN_CHUNK} tokens per device (zigzag: "
          f"per half); got {spec.dropout_origin}. Other chunks run on "
          f"'xla' or 'pallas'")
    if (spec.v_head_dim != spec.head_dim and
        not kernel_table.serves_pair("sm80", spec.head_dim, spec.v_head_dim)):
      raise Unsupported(
          f"implementation='cuda' has kernels for a value head_dim other "
          f"than the query/key head_dim for the (head_dim, value head_dim) "
          f"pairs {_pairs('sm80')} only; got ({spec.head_dim}, "
          f"{spec.v_head_dim}) (implementation='pallas' or 'xla' serves it)")
    if platform not in ("gpu", "cuda"):
      raise Unsupported(f"implementation='cuda' needs an NVIDIA GPU; the "
                        f"platform is {platform!r}")
    if not ffi.available():
      raise Unsupported(f"implementation='cuda': {ffi.unavailable_reason()}; "
                        "reinstall with nvcc on PATH")
    cc = _compute_capability()
    if cc is not None and cc < (8, 0):
      raise Unsupported(f"implementation='cuda' needs compute capability >= "
                        f"8.0 (sm80+); this GPU is sm{cc[0]}{cc[1]}")
    if spec.dtype not in DTYPES:
      raise Unsupported(f"implementation='cuda' supports dtypes "
                        f"{', '.join(DTYPES)}; got {spec.dtype}")
    if not (1 <= spec.head_dim <= MAX_HEAD_DIM and spec.head_dim % 8 == 0):
      # 16-byte vector loads of each row need head_dim % 8 == 0.
      raise Unsupported(f"implementation='cuda' supports head_dim a multiple "
                        f"of 8 in 8..{MAX_HEAD_DIM}; got {spec.head_dim}")
    if spec.scale <= 0:
      raise Unsupported(f"implementation='cuda' needs scale > 0; got "
                        f"{spec.scale}")

  def forward(self, spec: AttentionSpec, q, k, v, q_seg=None, kv_seg=None,
              *, shifts=None, dropout_key=None, sinks=None):
    # Prefixes (bottom_right) keep row and column positions: the same mask.
    kernel = functools.partial(_forward, dropout_key=dropout_key,
                               sinks=sinks)
    o, lse = bottom_right.forward(kernel, spec, q, k, v, q_seg, kv_seg, shifts)
    if sinks is not None and not spec.bottom_right:
      # Rows past the prefix see no key: their LSE is the sink (the kernel
      # gives every row it computes a finite LSE when there are sinks).
      lse = jnp.where(jnp.isneginf(lse), sinks[:, :, None].astype(lse.dtype),
                      lse)
    return o, lse

  def backward(self, spec: AttentionSpec, q, k, v, o, lse, do, delta,
               q_seg=None, kv_seg=None, *, shifts=None, dropout_key=None):
    kernel = functools.partial(_backward, dropout_key=dropout_key)
    return bottom_right.backward(kernel, spec, q, k, v, o, lse, do, delta,
                                 q_seg, kv_seg, shifts)


def _dropout(spec: AttentionSpec, dropout_key):
  """(words, attributes) of the handlers' dropout operand: the key words
  (k0, k1, batch0, head0, row0, col0: core/dropout.py key_words) as uint32
  [6] and the byte threshold; a dummy operand and threshold 0 without
  dropout. The kernels' generator (philox.h Dropout) adds the origin to
  each position, the column origin in whole 64-column chunks (`check`
  refuses a spec.dropout_origin that is not a multiple of 64)."""
  if not spec.has_dropout:
    words = jnp.zeros((dropout_rng.N_WORDS,), jnp.uint32)
    return words, dict(dropout_threshold=np.int32(0), dropout_broadcast=False)
  assert dropout_key is not None and len(dropout_key) == dropout_rng.N_WORDS
  words = jnp.stack([jnp.asarray(w, jnp.uint32).reshape(())
                     for w in dropout_key])
  return words, dict(
      dropout_threshold=np.int32(dropout_rng.threshold(spec.dropout_rate)),
      dropout_broadcast=bool(spec.dropout_broadcast))


def _varlen_kernel_serves(spec: AttentionSpec) -> bool:
  """Whether the sm90 varlen forward takes this call (trace time): a
  cu_seqlens layout (spec.varlen_seqs, which varlen_attention sets only
  with the kernel switched on: ffi.varlen_kernel; the spec carries the
  choice, so a call traced later, e.g. by a partitioning rule, makes the
  same one), the sm90 family built and not excluded, an sm_90 GPU, a head
  dim it has (a bucket or an sm90 pair), no dropout."""
  if spec.varlen_seqs <= 0 or not spec.has_segment_ids or spec.has_dropout:
    return False
  if ffi.kernel_family() == 80:
    return False
  if "sm90" not in ffi.families() or _compute_capability() != (9, 0):
    return False
  if spec.v_head_dim != spec.head_dim:
    return kernel_table.serves_pair("sm90_fwd", spec.head_dim, spec.v_head_dim)
  return spec.head_dim <= kernel_table.max_head_dim("sm90_fwd")


def _varlen_bwd_kernel_serves(spec: AttentionSpec) -> bool:
  """Whether the sm90 varlen backward takes this call (trace time): where
  the varlen forward does, when switched on (spec.varlen_backward, from
  ffi.varlen_bwd_kernel when the forward was traced), for the buckets of
  its own family (v's head dim equal to q's), not deterministic (its dQ
  order is the packed kernels')."""
  if not spec.varlen_backward:
    return False
  if not _varlen_kernel_serves(spec) or spec.deterministic:
    return False
  if spec.v_head_dim != spec.head_dim:
    return False
  return spec.head_dim <= kernel_table.max_head_dim("sm90_bwd_varlen")


def varlen_offsets(seg, num_seqs: int):
  """cu_seqlens [B, num_seqs + 1] int32 of segment ids [B, T] in the
  layout of spec.varlen_seqs (sequence s = the run of id s; negative ids,
  and ids past the sequences, outside every one): a scatter-add of the run
  lengths and a prefix sum, from the first token inside. Whatever the ids,
  the offsets are non-decreasing and within [0, T]."""
  B, T = seg.shape
  inside = (seg >= 0) & (seg < num_seqs)
  ids = jnp.where(inside, seg, num_seqs)
  counts = jnp.zeros((B, num_seqs + 1), jnp.int32).at[
      jnp.arange(B)[:, None], ids].add(1)[:, :num_seqs]
  first = jnp.argmax(inside, axis=1).astype(jnp.int32)
  return first[:, None] + jnp.concatenate(
      [jnp.zeros((B, 1), jnp.int32), jnp.cumsum(counts, axis=1)], axis=1)


def _forward_varlen(spec: AttentionSpec, q, k, v, q_seg, kv_seg, sinks):
  """The per-sequence sm90 forward (jax_flash_fwd_varlen): tiles never
  straddle two sequences, rows and keys loaded at each sequence's offsets,
  so no unseen-token pass and no tile-span pre-pass. The offsets come back
  from the ids (varlen_offsets)."""
  B, T, H, _ = q.shape
  n = spec.varlen_seqs
  cu_q = varlen_offsets(q_seg.astype(jnp.int32), n)
  cu_k = cu_q if spec.segments_aligned else varlen_offsets(
      kv_seg.astype(jnp.int32), n)
  out_shapes = (jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype),
                jax.ShapeDtypeStruct((B, H, T), jnp.float32),
                jax.ShapeDtypeStruct((1,), jnp.int32))
  has_sinks = sinks is not None
  sinks = (sinks.astype(jnp.float32) if has_sinks else
           jnp.zeros((1,), jnp.float32))
  o, lse, _ = ffi.call(ffi.FWD_VARLEN, out_shapes, q, k, v, cu_q, cu_k, sinks,
                       scale=np.float32(spec.scale),
                       softcap=np.float32(spec.softcap or 0.0),
                       window_left=np.int32(spec.window_left),
                       window_right=np.int32(spec.window_right),
                       has_sinks=has_sinks,
                       may_have_outside=bool(spec.varlen_outside))
  return o, lse


def _forward(spec: AttentionSpec, q, k, v, q_seg, kv_seg, shifts=None,
             dropout_key=None, sinks=None):
  if _varlen_kernel_serves(spec):
    return _forward_varlen(spec, q, k, v, q_seg, kv_seg, sinks)
  B, T, H, _ = q.shape
  # A tile that is partly seen is loaded whole, and its masked products are
  # 0 * x: NaN or Inf in values no row sees would reach o (P V). Scores of
  # unseen keys or rows are replaced by -inf (the kernels' masks select, they
  # do not add), so the forward zeroes V alone: one pass over one tensor
  # instead of three when the ids are not known to agree at trace time. The
  # backward zeroes all three (dQ = dS K and dK = dS^T Q multiply them).
  _, _, v = seen.zero_unseen(spec, None, None, v, q_seg, kv_seg, shifts)
  q_seg, kv_seg, packing = _segments(spec, q_seg, kv_seg, shifts)
  words, dropout_attrs = _dropout(spec, dropout_key)
  # The third result is a workspace: the sm90 dynamic tile scheduler's
  # counter (a per-call buffer, so concurrent calls never share one) and,
  # with segment ids, the packed tile order [B, ceil(T / 64)] after it.
  order = B * -(-T // tile_spans.ROWS) if spec.has_segment_ids else 0
  out_shapes = (jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype),
                jax.ShapeDtypeStruct((B, H, T), jnp.float32),
                jax.ShapeDtypeStruct((1 + order,), jnp.int32))
  # Learnable sinks [B, H] (the kernels fold them into each row's
  # denominator and LSE: cuda/include/jax_flash/sinks.h); else a dummy.
  has_sinks = sinks is not None
  sinks = (sinks.astype(jnp.float32) if has_sinks else
           jnp.zeros((1,), jnp.float32))
  o, lse, _ = ffi.call(ffi.FWD, out_shapes, q, k, v, q_seg, kv_seg, packing,
                       words, sinks, has_sinks=has_sinks,
                       kernel_family=ffi.kernel_family(),
                       **dropout_attrs, **ffi.mask_attrs(spec))
  return o, lse


def _backward_varlen(spec: AttentionSpec, q, k, v, o, lse, do, delta, q_seg,
                     kv_seg):
  """The per-sequence sm90 backward (jax_flash_bwd_varlen): a CTA per
  (sequence, KV block of its own length, kv head), loads at the sequence's
  offsets, rows past its end zeroed in shared memory, so no unseen-token
  pass over q, k, v and no tile-span pre-pass."""
  B, T, H, D = q.shape
  n = spec.varlen_seqs
  cu_q = varlen_offsets(q_seg.astype(jnp.int32), n)
  cu_k = cu_q if spec.segments_aligned else varlen_offsets(
      kv_seg.astype(jnp.int32), n)
  f32 = jnp.float32
  dq_accum = (B * H * _round_up(T, 128) * dq_accum_pitch(D, v.shape[3]),)
  out_shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct(k.shape, k.dtype),
                jax.ShapeDtypeStruct(v.shape, v.dtype),
                jax.ShapeDtypeStruct(dq_accum, f32))
  dq, dk, dv, _ = ffi.call(ffi.BWD_VARLEN, out_shapes, q, k, v, o,
                           lse.astype(f32), do, delta.astype(f32), cu_q, cu_k,
                           scale=np.float32(spec.scale),
                           softcap=np.float32(spec.softcap or 0.0),
                           window_left=np.int32(spec.window_left),
                           window_right=np.int32(spec.window_right))
  return dq, dk, dv


def _backward(spec: AttentionSpec, q, k, v, o, lse, do, delta, q_seg,
              kv_seg, shifts=None, dropout_key=None):
  if _varlen_bwd_kernel_serves(spec):
    return _backward_varlen(spec, q, k, v, o, lse, do, delta, q_seg, kv_seg)
  B, T, H, D = q.shape
  S, H_kv, Dv = k.shape[1], k.shape[2], v.shape[3]
  q, k, v = seen.zero_unseen(spec, q, k, v, q_seg, kv_seg, shifts)
  q_seg, kv_seg, packing = _segments(spec, q_seg, kv_seg, shifts)
  words, dropout_attrs = _dropout(spec, dropout_key)
  d_round = dq_accum_pitch(D, Dv)
  f32 = jnp.float32
  dq_accum = (B * H * _round_up(T, 128) * d_round,)
  # GQA sums dK/dV over the q heads of a group; the kernel may use these.
  kv_rows = B * H_kv * _round_up(S, 128)
  dk_accum = (kv_rows * d_round,) if H != H_kv else (1,)
  dv_accum = (kv_rows * rounded_head_dim(Dv),) if H != H_kv else (1,)
  # Deterministic mode: the sm90 backward orders the dQ additions through
  # these semaphores (zeroed by the kernel's launcher; a per-call buffer, so
  # concurrent calls never share one). Else a 1-element placeholder.
  dq_semaphore = ((sm90_bwd_semaphore_ints(B, H, T),)
                  if spec.deterministic else (1,))
  out_shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct(k.shape, k.dtype),
                jax.ShapeDtypeStruct(v.shape, v.dtype),
                jax.ShapeDtypeStruct(dq_accum, f32),
                jax.ShapeDtypeStruct(dk_accum, f32),
                jax.ShapeDtypeStruct(dv_accum, f32),
                jax.ShapeDtypeStruct(dq_semaphore, jnp.int32))
  dq, dk, dv, *_ = ffi.call(ffi.BWD, out_shapes, q, k, v, o,
                            lse.astype(f32), do, delta.astype(f32), q_seg,
                            kv_seg, packing, words,
                            deterministic=bool(spec.deterministic),
                            kernel_family=ffi.kernel_family(),
                            **dropout_attrs, **ffi.mask_attrs(spec))
  return dq, dk, dv


register("cuda", CudaBackend)
