"""The canonical, hashable description of one attention request.

Every backend receives the same `AttentionSpec`. It is built once by the API
layer after validation, so backends never re-interpret user arguments.

Canonical array shapes seen by backends:
  q          [B, T, H, D]
  k          [B, S, H_kv, D]       (H % H_kv == 0)
  v          [B, S, H_kv, D_v]     (D_v = spec.v_head_dim)
  sinks      [B, H] float32        (only when spec.has_sinks; float64 for
                                    float64 inputs; forward only)
  q_segment  [B, T] int32          (only when spec.has_segment_ids)
  kv_segment [B, S] int32
  q_shift    [B, T] int32          (only when spec.has_shifts)
  kv_shift   [B, S] int32
  dropout_key (k0, k1, batch0, head0, row0, col0) uint32 scalars (only when
             spec.has_dropout; core/dropout.py key_words)
  o          [B, T, H, D_v]        (q.dtype)
  lse        [B, H, T] float32     natural-log logsumexp; -inf for fully masked
                                   rows; with sinks it includes the sink
"""

from __future__ import annotations

import dataclasses

UNBOUNDED = -1


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
  """How an FP8 request is quantised (fp8/scheme.py has the arithmetic).

  quantized: which of (q, k, v) arrive already quantised (`Fp8Tensor`);
  rotation_seed: the Hadamard rotation's sign seed (None: no rotation);
  logical_head_dim: the callers' head_dim (the spec's `head_dim` is the
  padded one the FP8 kernels compute with).
  """

  quantized: tuple[bool, bool, bool] = (False, False, False)
  rotation_seed: int | None = 0
  logical_head_dim: int = 1


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Static options of an attention call (everything except the arrays).

  Masking convention. Query row i sits at absolute position i + kv_offset
  in key coordinates; by default kv_offset = S - T, i.e. queries are aligned
  to the *end* of the keys ("bottom-right", as FlashAttention >= 2.1). Key j
  is visible from query i when
      window_left  == -1 or  j >= i + kv_offset - window_left
      window_right == -1 or  j <= i + kv_offset + window_right
  and, with segment ids, q_segment[i] == kv_segment[j]. With `has_shifts`
  each token carries a diagonal shift (packed sequences of unequal query and
  key lengths, `varlen_attention`): row i sits at i + kv_offset + q_shift[i],
  and q_shift[i] == kv_shift[j] whenever q_segment[i] == kv_segment[j] (one
  shift per sequence), so a key may use its own shift for the same test.
  `causal=True` is
  folded into window_right = 0 by the API layer; `causal` is kept for
  backends that specialise on it.

  `q_offset` overrides the bottom-right kv_offset with any integer. The public
  API never sets it: ring attention does, for a q block and a kv block whose
  global positions differ by a known amount (core/masking.py's block helpers
  and every JAX backend read `kv_offset`; the cuda backend re-expresses such
  a spec bottom-right, see `masking.bottom_right_view`).

  Learnable attention sinks (`has_sinks`): each row's softmax has one more
  term in its denominator, exp(sinks[b, h]), which takes no value (a key of
  value 0 that every row sees). The lse includes it, lse = log(exp(sink) +
  sum_j exp(s_j)), so P = exp(S - lse) and the backward's delta =
  rowsum(dO * O) - dLSE are unchanged; a row that sees no key gives o = 0,
  lse = sink. The sinks' gradient, -sum_t exp(sink - lse_t) delta_t, is the
  autodiff layer's (autodiff/sinks.py); backward kernels never see them.

  A value head dim (`value_head_dim`) other than q/k's: v [.., D_v] and o
  [.., D_v] (DeepSeek MLA: D = 192, D_v = 128).

  Backends refuse (`Unsupported`) the options they do not serve; served by:
  dropout (xla, pallas, cuda; with a block origin, `dropout_origin`: xla,
  pallas, and cuda for origins on 64-column chunks), FP8 (xla simulated,
  cuda), sinks (xla, pallas, cuda), a distinct value head dim (xla, pallas,
  and cuda for the (head_dim, value head_dim) pairs it has kernels for:
  kernel_table.HEAD_DIM_PAIRS, 192 / 128).
  """

  scale: float
  causal: bool = False
  window_left: int = UNBOUNDED
  window_right: int = UNBOUNDED
  softcap: float | None = None
  has_segment_ids: bool = False
  # Per-token diagonal shifts (see above); only with segment ids.
  has_shifts: bool = False
  # Shapes, so that backends can decide support without seeing arrays.
  batch: int = 1
  q_len: int = 1
  kv_len: int = 1
  num_heads: int = 1
  num_kv_heads: int = 1
  head_dim: int = 1
  dtype: str = "float32"
  # Backward option: fixed accumulation order where the backend offers one.
  deterministic: bool = False
  # Key position of query row 0 (see above); None = kv_len - q_len.
  q_offset: int | None = None
  # Attention dropout on the probabilities, O = (P * Z / (1 - rate)) V
  # (core/dropout.py draws Z); its key travels as an array operand. broadcast:
  # one mask for every batch element and head (Flax's broadcast_dropout).
  dropout_rate: float = 0.0
  dropout_broadcast: bool = False
  # 0, or the call is a block of a larger request (ring attention): its key
  # words' row and column origin (core/dropout.py key_words) may be nonzero,
  # so a backend must draw at those positions; the column origin is then a
  # multiple of dropout_origin (the ring's chunk length: the CUDA kernels
  # draw whole 64-column chunks and need it to be a multiple of 64).
  dropout_origin: int = 0
  # FP8 inputs (fp8_attention); None for 16/32/64-bit attention.
  fp8: Fp8Scheme | None = None
  # Head dim of v and o where it differs from q/k's; None = head_dim.
  value_head_dim: int | None = None
  # Learnable per-head sink logits (an extra forward operand, see above).
  has_sinks: bool = False
  # The q and kv segment ids are one layout (the API saw one array for both,
  # or varlen offsets given as one array with as many queries as keys): at
  # every position both ids are equal, except at tokens outside every
  # sequence, whose q and kv ids differ and match nothing; no shifts. Then a
  # token is seen iff its two ids agree (core/seen.py), with no search.
  segments_aligned: bool = False
  # 0, or the segment ids are a cu_seqlens layout of this many sequences
  # (varlen_attention): in each batch row the tokens of sequence s carry
  # id s, in runs of increasing id, and tokens outside every sequence a
  # negative id. Backends may then tile by sequence (the CUDA backend's
  # varlen kernel on sm90) instead of by position.
  varlen_seqs: int = 0
  # With varlen_seqs: whether some token may lie outside every sequence
  # (False when the offsets are known to start at 0 and cover both tensors).
  varlen_outside: bool = True
  # With varlen_seqs: whether the backward may tile by sequence too (the
  # choice is made when the forward is traced: custom_vjp traces the
  # backward later, outside the caller's context).
  varlen_backward: bool = False

  @property
  def has_window(self) -> bool:
    return self.window_left != UNBOUNDED or self.window_right != UNBOUNDED

  @property
  def has_dropout(self) -> bool:
    return self.dropout_rate > 0.0

  @staticmethod
  def value_head_dim_of(head_dim: int, v_head_dim: int) -> int | None:
    """The `value_head_dim` field for these head dims (None when equal)."""
    return None if v_head_dim == head_dim else v_head_dim

  @property
  def v_head_dim(self) -> int:
    return self.head_dim if self.value_head_dim is None else self.value_head_dim

  @property
  def kv_offset(self) -> int:
    """Position of query row 0 relative to key 0 (default: bottom-right)."""
    return self.kv_len - self.q_len if self.q_offset is None else self.q_offset

  @property
  def bottom_right(self) -> bool:
    """Whether the alignment is the public API's (what CUDA kernels take)."""
    return self.kv_offset == self.kv_len - self.q_len

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads

  def with_shapes(self, **kw) -> "AttentionSpec":
    return dataclasses.replace(self, **kw)
