"""float64 numpy reference: the truth every backend is measured against."""

from __future__ import annotations

import numpy as np


def mask(T, S, *, causal=False, window=None, q_seg=None, kv_seg=None,
         offset=None, visibility=None):
  """[B or 1, T, S] boolean visibility, bottom-right aligned unless
  `offset` (the key position of query row 0, AttentionSpec.q_offset);
  `visibility` [B or 1, T, S], if given, is the answer (varlen_mask)."""
  if visibility is not None:
    return np.asarray(visibility, bool)
  i = np.arange(T)[:, None] + (S - T if offset is None else offset)
  j = np.arange(S)[None, :]
  ok = np.ones((T, S), bool)
  left, right = window if window is not None else (-1, -1)
  if causal:
    right = 0 if right == -1 else min(right, 0)
  if left != -1:
    ok &= j >= i - left
  if right != -1:
    ok &= j <= i + right
  ok = ok[None]
  if q_seg is not None:
    ok = ok & (np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :])
  return ok


def varlen_mask(cu_q, cu_k, total_q, total_k, *, causal=False, window=None):
  """[1, total_q, total_k] visibility of packed sequences (varlen_attention):
  within each sequence, bottom-right aligned to its own keys."""
  ok = np.zeros((1, total_q, total_k), bool)
  for s in range(len(cu_q) - 1):
    qa, qb, ka, kb = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s],
                                        cu_k[s + 1]))
    if qb > qa and kb > ka:
      ok[:, qa:qb, ka:kb] = mask(qb - qa, kb - ka, causal=causal,
                                 window=window)
  return ok


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=None,
              segment_ids=None, offset=None, visibility=None, keep=None,
              sinks=None):
  """Returns (o [B,T,H,D_v], lse [B,H,T]) in float64. Empty rows: 0, -inf
  (with sinks [H]: 0, the sink; the sink is one more logit per row, of
  value 0, and the lse includes it). keep: attention dropout's mask times
  1 / (1 - rate), [B or 1, H or 1, T, S]: o = (P * keep) V, the lse of the
  undropped P."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, D = q.shape
  S, Hk = k.shape[1], k.shape[2]
  scale = 1 / np.sqrt(D) if scale is None else scale
  k = np.repeat(k, H // Hk, axis=2)
  v = np.repeat(v, H // Hk, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, k, optimize=True) * scale
  if softcap is not None:
    s = softcap * np.tanh(s / softcap)
  q_seg = kv_seg = None
  if segment_ids is not None:
    q_seg, kv_seg = segment_ids
  m = mask(T, S, causal=causal, window=window, q_seg=q_seg, kv_seg=kv_seg,
           offset=offset, visibility=visibility)
  s = np.where(m[:, None], s, -np.inf)
  mx = s.max(-1, keepdims=True)
  if sinks is not None:
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                           mx.shape)
    mx = np.maximum(mx, sink)
  mx = np.where(np.isfinite(mx), mx, 0)
  e = np.exp(s - mx)
  l = e.sum(-1, keepdims=True)
  if sinks is not None:
    l = l + np.exp(sink - mx)
  p = np.where(l > 0, e / np.where(l > 0, l, 1), 0)
  if keep is not None:
    p = p * np.asarray(keep, np.float64)
  o = np.einsum("bhts,bshd->bthd", p, v, optimize=True)
  with np.errstate(divide="ignore"):
    lse = np.where(l[..., 0] > 0, np.log(l[..., 0]) + mx[..., 0], -np.inf)
  return o, lse


def attention_vjp(q, k, v, do, *, dlse=None, output_dtype=None, **kw):
  """float64 gradients (dq, dk, dv) of sum(o*do) + sum(lse*dlse); with
  sinks= also their gradient [H]: (dq, dk, dv, dsinks).

  output_dtype: round o to it (a numpy/ml_dtypes dtype) before forming
  delta = rowsum(do * o) - dlse, as a flash backward does, which has only
  the stored output (the float64 math with that one rounding)."""
  q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
  B, T, H, D = q.shape
  S, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
  G = H // Hk
  scale = kw.get("scale") or 1 / np.sqrt(D)
  softcap = kw.get("softcap")
  o, lse = attention(q, k, v, **kw)
  kr = np.repeat(k, G, axis=2)
  vr = np.repeat(v, G, axis=2)
  raw = np.einsum("bthd,bshd->bhts", q, kr, optimize=True) * scale
  s = softcap * np.tanh(raw / softcap) if softcap is not None else raw
  seg = kw.get("segment_ids")
  m = mask(T, S, causal=kw.get("causal", False), window=kw.get("window"),
           q_seg=None if seg is None else seg[0],
           kv_seg=None if seg is None else seg[1],
           offset=kw.get("offset"), visibility=kw.get("visibility"))[:, None]
  lse_safe = np.where(np.isfinite(lse), lse, 0)[..., None]
  p = np.where(m, np.exp(np.where(m, s, 0) - lse_safe), 0)
  keep = kw.get("keep")
  keep = 1.0 if keep is None else np.asarray(keep, np.float64)
  dv = np.einsum("bhts,bthd->bshd", p * keep, do, optimize=True)
  dp = np.einsum("bthd,bshd->bhts", do, vr, optimize=True) * keep
  o_used = o if output_dtype is None else o.astype(output_dtype).astype(
      np.float64)
  delta = np.einsum("bthd,bthd->bht", do, o_used, optimize=True)
  if dlse is not None:
    delta = delta - np.asarray(dlse, np.float64)
  ds = p * (dp - delta[..., None])
  if softcap is not None:
    ds = ds * (1 - np.tanh(raw / softcap) ** 2)
  ds = ds * scale
  dq = np.einsum("bhts,bshd->bthd", ds, kr, optimize=True)
  dk = np.einsum("bhts,bthd->bshd", ds, q, optimize=True)
  dk = dk.reshape(B, S, Hk, G, D).sum(3)
  dv = dv.reshape(B, S, Hk, G, Dv).sum(3)
  if kw.get("sinks") is None:
    return dq, dk, dv
  # d lse / d sink = p_sink, d o / d sink = -p_sink o: -sum p_sink delta.
  sinks = np.asarray(kw["sinks"], np.float64)
  p_sink = np.where(np.isfinite(lse), np.exp(sinks[None, :, None] - lse_safe[
      ..., 0]), 0)
  return dq, dk, dv, -(p_sink * delta).sum((0, 2))


# ---------------------------------------------------------------------------
# Helpers for the test suite (jax imported lazily so the numpy reference above
# stays importable on its own).
# ---------------------------------------------------------------------------

import contextlib  # noqa: E402


@contextlib.contextmanager
def enable_x64():
  """float64 on for the duration of the block, on jax 0.11 and 0.12.

  jax >= 0.9 has the config State `jax.enable_x64` (a context manager when
  called); older versions had `jax.experimental.enable_x64()`; the last resort
  flips the global flag and restores it.
  """
  import jax
  state = getattr(jax, "enable_x64", None)
  if state is not None and hasattr(state, "value"):
    with state(True):
      yield
    return
  experimental = getattr(getattr(jax, "experimental", None), "enable_x64",
                         None)
  if experimental is not None:
    with experimental():
      yield
    return
  old = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", old)


def _round_cotangent(x, dtype):
  """Identity whose backward rounds the cotangent to `dtype` (and back).

  The optimization barrier keeps XLA:GPU from dropping the convert pair as
  excess precision (`xla_allow_excess_precision`, on by default), which
  left the GPU baseline's dS in float32 (measured on the H200: benchmarks/NOTES.md, 2026-11-30)."""
  import jax

  @jax.custom_vjp
  def ident(x):
    return x

  ident.defvjp(lambda x: (x, None),
               lambda _, g: (jax.lax.optimization_barrier(
                   g.astype(dtype)).astype(g.dtype),))
  return ident(x)


def dense_attention_jax(q, k, v, *, causal=False, scale=None, window=None,
                        softcap=None, segment_ids=None, offset=None,
                        visibility=None, keep=None, sinks=None):
  """Dense attention in the input dtype, the way plain XLA code computes it.

  The "same-dtype XLA attention" of the error criterion: q·k^T in the input
  dtype with float32 accumulation (float64 for float64 inputs), softcap, mask
  and softmax in float32, P cast to the input dtype, P·V with float32
  accumulation, output cast to the input dtype. Gradients by jax.vjp, with one
  addition: the cotangent of the scores (dS) is rounded to the input dtype
  before the dQ/dK matmuls, as a bf16 autograd program (and every
  FlashAttention kernel) does; plain JAX autodiff would keep dS in float32 and
  so be more accurate than any kernel that feeds dS to a bf16 tensor core.
  Canonical shapes: q [B,T,H,D], k [B,S,Hk,D], v [B,S,Hk,D_v], segment_ids
  (q_seg [B,T], kv_seg [B,S]) or None; keep: dropout's scaled mask as
  `attention`'s; sinks [H] float32/64 or None (one more logit per row, of
  value 0, differentiable).
  Returns (o [B,T,H,D] in q.dtype, lse [B,H,T] float32/64). Differentiable;
  fully masked rows give o = 0, lse = -inf and finite (zero) gradients.
  """
  import jax
  import jax.numpy as jnp
  dt = jnp.dtype(q.dtype)
  acc = jnp.float64 if dt == jnp.float64 else jnp.float32
  B, T, H, D = q.shape
  S, Hk = k.shape[1], k.shape[2]
  scale = 1.0 / np.sqrt(D) if scale is None else scale
  k = jnp.repeat(k, H // Hk, axis=2)
  v = jnp.repeat(v, H // Hk, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=acc)
  s = _round_cotangent(s, dt) * jnp.asarray(scale, acc)
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  q_seg = kv_seg = None
  if segment_ids is not None:
    q_seg, kv_seg = (np.asarray(x) for x in segment_ids)
  m = jnp.asarray(mask(T, S, causal=causal, window=window, q_seg=q_seg,
                       kv_seg=kv_seg, offset=offset,
                       visibility=visibility))[:, None]
  s = jnp.where(m, s, -jnp.inf)
  mx = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  if sinks is not None:
    sink = jnp.broadcast_to(sinks.astype(acc)[None, :, None, None], mx.shape)
    mx = jnp.maximum(mx, jax.lax.stop_gradient(sink))
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  e = jnp.exp(s - mx)
  l = jnp.sum(e, axis=-1, keepdims=True)
  if sinks is not None:
    l = l + jnp.exp(sink - mx)
  nonempty = l > 0
  p = e / jnp.where(nonempty, l, 1.0)
  if keep is not None:
    p = p * jnp.asarray(keep, acc)
  o = jnp.einsum("bhts,bshd->bthd", p.astype(dt), v, preferred_element_type=acc)
  lse = jnp.where(nonempty, jnp.log(jnp.where(nonempty, l, 1.0)) + mx,
                  -jnp.inf)[..., 0]
  return o.astype(dt), lse


def max_abs_err(x, ref):
  """max |x - ref| in float64 over entries where ref is finite (0 if none)."""
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  fin = np.isfinite(ref)
  if not fin.any():
    return 0.0
  return float(np.max(np.abs(x[fin] - ref[fin])))


def assert_close_to_reference(name, actual, ref64, baseline, *, factor=2.0,
                              atol=1e-5):
  """The project's error criterion (DESIGN.md, from FlashAttention-3's tests).

      max|actual - ref64| <= factor * max|baseline - ref64| + atol

  err is the max absolute error against the float64 reference `ref64`
  (computed from the same, already-rounded inputs); `baseline` is the
  same-dtype dense XLA attention (`dense_attention_jax`). Max-abs rather than
  relative-norm because it catches a single wrong element (a bad mask edge, a
  stale tile) that a norm would average away. Non-finite reference entries
  (lse = -inf of fully masked rows) must be matched exactly, and `actual` must
  be finite wherever the reference is.
  """
  actual = np.asarray(actual, np.float64)
  ref64 = np.asarray(ref64, np.float64)
  baseline = np.asarray(baseline, np.float64)
  assert actual.shape == ref64.shape, (
      f"{name}: shape {actual.shape} != reference {ref64.shape}")
  fin = np.isfinite(ref64)
  bad = ~fin & (actual != ref64)
  assert not bad.any(), (
      f"{name}: {bad.sum()} entries should be {ref64[bad][:4]} (non-finite "
      f"reference), got {actual[bad][:4]} at {np.argwhere(bad)[:4].tolist()}")
  assert np.isfinite(actual[fin]).all(), (
      f"{name}: non-finite values at "
      f"{np.argwhere(fin & ~np.isfinite(actual))[:8].tolist()}")
  err = max_abs_err(actual, ref64)
  err_base = max_abs_err(baseline, ref64)
  bound = factor * err_base + atol
  if err > bound:
    diff = np.where(fin, np.abs(actual - ref64), 0)
    where = np.unravel_index(np.argmax(diff), diff.shape)
    raise AssertionError(
        f"{name}: max abs err {err:.3e} > {factor:g} * baseline err "
        f"{err_base:.3e} + {atol:g} = {bound:.3e}; worst at index "
        f"{tuple(int(i) for i in where)}: got {actual[where]!r}, reference "
        f"{ref64[where]!r}, baseline {baseline[where]!r}")
