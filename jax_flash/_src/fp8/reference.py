"""Simulated FP8 attention: the sm90 FP8 kernel's arithmetic in plain JAX.

`forward` computes, on the e4m3 inputs of quantize.py, exactly what the
kernel computes (scheme.py is the contract): the same KV blocks, visited in
the same order, the same scores, the same e4m3 rounding of P, the same
accumulators and epilogue. It is the `implementation="xla"` path of
`fp8_attention` and the yardstick the CUDA kernel is tested against; what
differs on the GPU is only the kernel's approximate exp2 and the FP8 tensor
cores' accumulation order.

Per KV block j (scheme.k_block(Dp) keys starting at key 0, Dp the padded
head dim; from the last block that can hold a visible key down to the
first):

    S     = q8 . k8                          float32 (exact products)
    true  = S * scale * dq[row block] * dk[j]
    (softcap: true = softcap * tanh(true / softcap))
    s     = true * log2(e)                   masked keys: -inf
    m'    = max(m, max_j s)                  running max, log2 units
    p     = 2^(s - m' + P_OFFSET_LOG2)       <= 2^8 = 256: inside e4m3's range
    l     = 2^(m - m') l + sum p             the UNROUNDED p
    O     = 2^(m - m') O + e4m3(p) . v8      float32

and at the end O * dv[channel] / l, lse = ln2 (m - P_OFFSET_LOG2 + log2 l).
Blocks that hold no visible key change nothing (p = 0, m' = m, factor 1), so
skipping them (the kernel's causal/window sparsity) gives the same numbers;
visiting all rows' blocks together in one descending pass does too.

Memory: one [B, H, T, k_block] score block per step, never T x S.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jax_flash._src.core import masking
from jax_flash._src.fp8 import quantize, scheme
from jax_flash._src.core.spec import UNBOUNDED, AttentionSpec

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")
_HI = lax.Precision.HIGHEST


def kv_block_range(spec: AttentionSpec, block: int,
                   num_kv_blocks: int) -> tuple[int, int]:
  """[first, last) of the `block`-key blocks that any query row can see:
  masking.kv_block_range for the whole query, on Python ints (a static trip
  count, and no jnp at trace time: this also runs inside shard_map)."""
  clip = lambda x: min(max(x, 0), num_kv_blocks)
  first, last = 0, num_kv_blocks
  if spec.window_right != UNBOUNDED:
    hi = spec.q_len - 1 + spec.kv_offset + spec.window_right  # last visible
    last = clip(hi // block + 1)
  if spec.window_left != UNBOUNDED:
    first = clip((spec.kv_offset - spec.window_left) // block)
  return first, max(last, first)


def _kv_blocks(x, block, num_blocks):
  """[B, S, Hk, D] -> [nk, B, Hk, block, D] float32, zero keys past S."""
  B, S, Hk, D = x.shape
  x = jnp.pad(x.astype(jnp.float32),
              ((0, 0), (0, num_blocks * block - S), (0, 0), (0, 0)))
  return x.reshape(B, num_blocks, block, Hk, D).transpose(1, 0, 3, 2, 4)


def forward(spec: AttentionSpec, q8, q_descale, k8, k_descale, v8, v_descale,
            q_seg, kv_seg, out_dtype):
  """FP8 attention forward, bit-for-bit the kernel's arithmetic but exp2.

  Args:
    spec: the AttentionSpec of the call (scale, masking, shapes; head_dim
      and dtype are not read: the arrays' head dim is the padded one).
    q8: [B, T, H, Dp] float8_e4m3fn (rotated, scaled per Q_BLOCK rows).
    q_descale: [B, H, ceil(T / Q_BLOCK)] float32.
    k8: [B, S, H_kv, Dp] float8_e4m3fn (rotated, scaled per k_block(Dp) keys).
    k_descale: [B, H_kv, ceil(S / k_block(Dp))] float32.
    v8: [B, S, H_kv, Dp] float8_e4m3fn (the natural layout, as the kernel
      takes it), scaled per channel.
    v_descale: [B, H_kv, Dp] float32.
    q_seg, kv_seg: [B, T], [B, S] int32, or None (no segment ids).
    out_dtype: dtype of o.

  Returns:
    (o [B, T, H, Dp] out_dtype, lse [B, H, T] float32 natural log). Rows that
    see no key: o = 0, lse = -inf.
  """
  B, T, H, Dp = q8.shape
  S, Hk = k8.shape[1], k8.shape[2]
  G = H // Hk
  f32 = jnp.float32
  bk = scheme.k_block(Dp)
  nk = scheme.num_blocks(S, bk)
  first, last = kv_block_range(spec, bk, nk)

  # Query rows grouped by their kv head: [B, Hk, G, T, Dp]; q head h = hk G + g.
  q = q8.astype(f32).reshape(B, T, Hk, G, Dp).transpose(0, 2, 3, 1, 4)
  qd = jnp.repeat(q_descale.astype(f32), scheme.Q_BLOCK, axis=-1)[..., :T]
  qd = qd.reshape(B, Hk, G, T)
  kb, vb = _kv_blocks(k8, bk, nk), _kv_blocks(v8, bk, nk)
  kd = k_descale.astype(f32).transpose(2, 0, 1)  # [nk, B, Hk]
  q_pos = lax.broadcasted_iota(jnp.int32, (T, 1), 0)
  with_segs = q_seg is not None
  if with_segs:
    ksb = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, nk * bk - S)))
    ksb = ksb.reshape(B, nk, bk).transpose(1, 0, 2)  # [nk, B, bk]
    qs = q_seg.astype(jnp.int32)[:, None, None, :, None]
  else:
    ksb = jnp.zeros((nk, 1, 1), jnp.int32)  # unused

  if spec.softcap is None:
    row_mult = (spec.scale * LOG2E) * qd  # [B, Hk, G, T]
  else:
    row_mult = (spec.scale / spec.softcap) * qd

  def step(state, xs):
    m, l, acc = state
    j, k_blk, v_blk, dk, ks_blk = xs
    s = jnp.einsum("bhgtd,bhkd->bhgtk", q, k_blk, precision=_HI,
                   preferred_element_type=f32)
    mult = (row_mult * dk[:, :, None, None])[..., None]
    if spec.softcap is None:
      s = s * mult
    else:
      s = (spec.softcap * LOG2E) * jnp.tanh(s * mult)
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    mask = masking.visible(spec, q_pos, k_pos,
                           qs if with_segs else None,
                           ks_blk[:, None, None, None, :] if with_segs
                           else None)
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # no -inf - -inf
    p = jnp.exp2(s - m_safe[..., None] + scheme.P_OFFSET_LOG2)
    alpha = jnp.exp2(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=-1)
    p8 = quantize.to_e4m3(p).astype(f32)  # round to nearest even; p <= 256
    pv = jnp.einsum("bhgtk,bhkd->bhgtd", p8, v_blk, precision=_HI,
                    preferred_element_type=f32)
    acc = alpha[..., None] * acc + pv
    return (m_new, l, acc), None

  # Last visible block first, as the kernel visits them.
  rev = lambda x: x[first:last][::-1]
  js = jnp.arange(first, last, dtype=jnp.int32)[::-1]
  state = (jnp.full((B, Hk, G, T), NEG_INF, f32), jnp.zeros((B, Hk, G, T), f32),
           jnp.zeros((B, Hk, G, T, Dp), f32))
  (m, l, acc), _ = lax.scan(step, state,
                            (js, rev(kb), rev(vb), rev(kd), rev(ksb)))

  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o = acc * v_descale.astype(f32)[:, :, None, None, :] / l_safe[..., None]
  o = jnp.where(empty[..., None], 0.0, o)
  lse = LN2 * (m - scheme.P_OFFSET_LOG2 + jnp.log2(l_safe))
  lse = jnp.where(empty, NEG_INF, lse)
  o = o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dp).astype(out_dtype)
  return o, lse.reshape(B, H, T)
