"""jax.nn.dot_product_attention's math, chunked over query rows.

`dot_product_attention` uses this path for what the blockwise backends
cannot express: a dense `bias` or boolean `mask` array, windows whose band
leaves out the diagonal (negative sides), a traced `scale`, head dims or
dtypes the backends do not take. It follows jax.nn's definition step by step
(masked logits become a large negative number, not -inf, so a row that sees
no key averages all values; padded query rows are zeroed), with one
difference in precision: the softmax runs in the logits dtype (float64 for
float64 inputs) where jax.nn rounds it to float32.

Memory: the logits of one chunk of query rows [B, N, rows, S] at a time
(`lax.map` over chunks, each rematerialised in the backward by
`jax.checkpoint`), plus the bias/mask arrays themselves. Gradients, also
w.r.t. `bias`, and forward-mode derivatives come from JAX's autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Logits elements [B, N, rows, S] of one chunk (64 MiB in float32).
CHUNK_ELEMENTS = 1 << 24


def large_negative(dtype):
  """jax.nn's masking value: -0.7 * max, capped to float32's range."""
  dtype_max = min(float(jnp.finfo(dtype).max),
                  float(jnp.finfo(np.float32).max))
  return jnp.asarray(-0.7 * dtype_max, dtype=dtype)


def logits_dtype(dtype):
  return jnp.promote_types(dtype, np.float32)


def _precision(dtype):
  # float32/64 get true float32/64 products (no TF32 on GPU); low-precision
  # inputs multiply natively and accumulate in float32.
  return (lax.Precision.HIGHEST
          if jnp.dtype(dtype) in (jnp.float32, jnp.float64) else None)


def positional_mask(q_pos, S, is_causal, window):
  """[rows, S] visibility by position, top-left aligned as jax.nn aligns."""
  k_pos = jnp.arange(S)[None, :]
  q_pos = q_pos[:, None]
  ok = jnp.ones((q_pos.shape[0], S), bool)
  if is_causal:
    ok = ok & (k_pos <= q_pos)
  if window is not None:
    left, right = window
    ok = ok & (q_pos <= k_pos + left) & (q_pos >= k_pos - right)
  return ok


def _rows(q, k, v, bias, mask, q_pos, *, scale, is_causal, window, q_len,
          kv_len, return_residual, sinks):
  """Attention of query rows q [B, rows, N, H] at positions q_pos [rows];
  sinks [N] or None: one more logit per row, of value 0."""
  B, R, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  lt = logits_dtype(q.dtype)
  logits = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, R, K, N // K, H), k,
                      preferred_element_type=lt,
                      precision=_precision(q.dtype)).reshape(B, N, R, S)
  logits = logits * jnp.asarray(scale, lt)
  if bias is not None:
    logits = (logits + bias).astype(lt)
  ok = positional_mask(q_pos, S, is_causal, window)[None, None]
  if mask is not None:
    ok = ok & mask
  if q_len is not None:  # padded query rows see no key (then are zeroed)
    ok = ok & (q_pos[None, :] < q_len[:, None])[:, None, :, None]
  if kv_len is not None:
    ok = ok & (jnp.arange(S) < kv_len[:, None])[:, None, None, :]
  logits = jnp.where(ok, logits, large_negative(lt))
  if sinks is not None:
    sink = jnp.broadcast_to(sinks.astype(lt)[None, :, None, None],
                            (B, N, R, 1))
    logits = jnp.concatenate([logits, sink], axis=-1)
  probs = jax.nn.softmax(logits, axis=-1)[..., :S].astype(v.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.reshape(B, K, N // K, R, S), v,
                   preferred_element_type=lt, precision=_precision(v.dtype))
  out = out.reshape(B, R, N, v.shape[-1])
  lse = jax.nn.logsumexp(logits, axis=-1) if return_residual else None
  return out.astype(q.dtype), lse  # lse [B, N, R]


def _row_block(B, N, T, S) -> int:
  rows = max(1, CHUNK_ELEMENTS // max(1, B * N * S))
  if rows >= T:
    return T
  return max(8, rows // 8 * 8) if rows >= 8 else rows


def _pad_rows(x, axis, n, value):
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n)
  return jnp.pad(x, widths, constant_values=value)


def _chunks(x, axis, nb, rb):
  """Split `axis` (length nb * rb) into a leading chunk axis."""
  shape = x.shape[:axis] + (nb, rb) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def attention(q, k, v, bias, mask, *, scale, is_causal, window, q_len, kv_len,
              return_residual, sinks=None):
  """q [B, T, N, H], k/v [B, S, K, H]; bias/mask 4-d, broadcastable to
  [B, N, T, S]; q_len/kv_len int32 [B] or None; sinks [N] or None. Returns
  (out, lse [B, N, T] or None) with jax.nn's values (including masked and
  padded rows)."""
  B, T, N, H = q.shape
  S = k.shape[1]
  kw = dict(scale=scale, is_causal=is_causal, window=window, q_len=q_len,
            kv_len=kv_len, return_residual=return_residual, sinks=sinks)
  rb = _row_block(B, N, T, S)
  if rb >= T:
    out, lse = _rows(q, k, v, bias, mask, jnp.arange(T), **kw)
  else:
    nb = -(-T // rb)
    pad = nb * rb - T
    # Row-dependent operands are split into chunks; row-broadcast ones
    # (size 1 along T) are shared by every chunk.
    xs = {"q": _chunks(_pad_rows(q, 1, pad, 0), 1, nb, rb),
          "pos": jnp.arange(nb * rb).reshape(nb, rb)}
    shared = {}
    for name, x, fill in (("bias", bias, 0), ("mask", mask, True)):
      if x is None:
        shared[name] = None
      elif x.shape[2] == 1:
        shared[name] = x
      else:
        xs[name] = _chunks(_pad_rows(x, 2, pad, fill), 2, nb, rb)

    @jax.checkpoint
    def one_chunk(c):
      b = c["bias"] if "bias" in c else shared["bias"]
      m = c["mask"] if "mask" in c else shared["mask"]
      return _rows(c["q"], k, v, b, m, c["pos"], **kw)

    out, lse = lax.map(one_chunk, xs)
    out = jnp.moveaxis(out, 0, 1).reshape(B, nb * rb, N, v.shape[-1])
    out = out[:, :T]
    if lse is not None:
      lse = jnp.moveaxis(lse, 0, 2).reshape(B, N, nb * rb)[:, :, :T]
  if q_len is not None:
    q_ok = jnp.arange(T)[None, :] < q_len[:, None]
    out = out * q_ok[:, :, None, None].astype(out.dtype)
  return out, lse
