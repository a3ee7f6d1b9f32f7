"""float64 numpy reference: the truth every backend is measured against."""

from __future__ import annotations

import numpy as np


def mask(T, S, *, causal=False, window=None, q_seg=None, kv_seg=None):
  """[B or 1, T, S] boolean visibility, bottom-right aligned."""
  i = np.arange(T)[:, None] + (S - T)
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


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=None,
              segment_ids=None):
  """Returns (o [B,T,H,D], lse [B,H,T]) in float64. Empty rows: 0, -inf."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, D = q.shape
  S, Hk = k.shape[1], k.shape[2]
  scale = 1 / np.sqrt(D) if scale is None else scale
  k = np.repeat(k, H // Hk, axis=2)
  v = np.repeat(v, H // Hk, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, k) * scale
  if softcap is not None:
    s = softcap * np.tanh(s / softcap)
  q_seg = kv_seg = None
  if segment_ids is not None:
    q_seg, kv_seg = segment_ids
  m = mask(T, S, causal=causal, window=window, q_seg=q_seg, kv_seg=kv_seg)
  s = np.where(m[:, None], s, -np.inf)
  mx = s.max(-1, keepdims=True)
  mx = np.where(np.isfinite(mx), mx, 0)
  e = np.exp(s - mx)
  l = e.sum(-1, keepdims=True)
  p = np.where(l > 0, e / np.where(l > 0, l, 1), 0)
  o = np.einsum("bhts,bshd->bthd", p, v)
  with np.errstate(divide="ignore"):
    lse = np.where(l[..., 0] > 0, np.log(l[..., 0]) + mx[..., 0], -np.inf)
  return o, lse


def attention_vjp(q, k, v, do, *, dlse=None, **kw):
  """float64 gradients (dq, dk, dv) of sum(o*do) + sum(lse*dlse)."""
  q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
  B, T, H, D = q.shape
  S, Hk = k.shape[1], k.shape[2]
  G = H // Hk
  scale = kw.get("scale") or 1 / np.sqrt(D)
  softcap = kw.get("softcap")
  o, lse = attention(q, k, v, **kw)
  kr = np.repeat(k, G, axis=2)
  vr = np.repeat(v, G, axis=2)
  raw = np.einsum("bthd,bshd->bhts", q, kr) * scale
  s = softcap * np.tanh(raw / softcap) if softcap is not None else raw
  seg = kw.get("segment_ids")
  m = mask(T, S, causal=kw.get("causal", False), window=kw.get("window"),
           q_seg=None if seg is None else seg[0],
           kv_seg=None if seg is None else seg[1])[:, None]
  lse_safe = np.where(np.isfinite(lse), lse, 0)[..., None]
  p = np.where(m, np.exp(np.where(m, s, 0) - lse_safe), 0)
  dv = np.einsum("bhts,bthd->bshd", p, do)
  dp = np.einsum("bthd,bshd->bhts", do, vr)
  delta = np.einsum("bthd,bthd->bht", do, o)
  if dlse is not None:
    delta = delta - np.asarray(dlse, np.float64)
  ds = p * (dp - delta[..., None])
  if softcap is not None:
    ds = ds * (1 - np.tanh(raw / softcap) ** 2)
  ds = ds * scale
  dq = np.einsum("bhts,bshd->bthd", ds, kr)
  dk = np.einsum("bhts,bthd->bshd", ds, q)
  dk = dk.reshape(B, S, Hk, G, D).sum(3)
  dv = dv.reshape(B, S, Hk, G, D).sum(3)
  return dq, dk, dv
