"""The CUDA FP8 pre-pass's arithmetic in numpy float32, for bitwise tests.

quantize.py rotates with one float32 matrix product (its sums round in XLA's
order); the pre-pass (cuda/fp8/quantize.cu) runs the fast Walsh-Hadamard
transform, butterfly stages in the order of their strides 1, 2, ..., D/2,
each a + b / a - b rounded to float32, after x * signs and before * 1/sqrt(D)
(a float32 constant). This module does the same sums in the same order, so
the pre-pass's e4m3 bytes and descales must equal these bit for bit.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jax_flash._src.fp8 import scheme

F32 = np.float32
# The kernel's 1/sqrt(D) constants (exact powers of two at 64 and 256).
NORM = {64: F32(0.125), 128: F32(0.08838834764831845), 256: F32(0.0625)}


def rotate(x, signs):
  """x [..., D] (float32) -> x diag(signs) H / sqrt(D), float32 sums in
  stride order."""
  D = x.shape[-1]
  y = np.asarray(x, F32) * np.asarray(signs, F32)
  h = 1
  while h < D:
    y = y.reshape(*y.shape[:-1], D // (2 * h), 2, h)
    a, b = y[..., 0, :], y[..., 1, :]
    y = np.stack([a + b, a - b], axis=-2).reshape(*x.shape)
    h *= 2
  return y * NORM[D]


def quantize_blocks(x, block):
  """x [B, N, H, D] float32 -> (e4m3 [B, N, H, D], descale [B, H, nb])."""
  B, N, H, D = x.shape
  nb = scheme.num_blocks(N, block)
  xp = np.zeros((B, nb * block, H, D), F32)
  xp[:, :N] = x
  xb = xp.reshape(B, nb, block, H, D)
  amax = np.max(np.abs(xb), axis=(2, 4))  # [B, nb, H]
  nz = amax > 0
  safe = np.where(nz, amax, F32(1))
  m = F32(scheme.E4M3_MAX)
  descale = np.where(nz, safe / m, F32(1)).astype(F32)
  inv = np.where(nz, m / safe, F32(1)).astype(F32)
  y = np.clip(xb * inv[:, :, None, :, None], -m, m)
  x8 = y.astype(ml_dtypes.float8_e4m3fn).reshape(B, nb * block, H, D)[:, :N]
  return x8, descale.transpose(0, 2, 1)


def quantize_qk(q, k, seed):
  """(q8, q_descale, k8, k_descale) of 16-bit q, k as the pre-pass makes
  them (rotated when seed is not None)."""
  q, k = (np.asarray(np.asarray(x).astype(F32)) for x in (q, k))
  if seed is not None:
    signs = scheme.rotation_signs(q.shape[-1], seed)
    q, k = rotate(q, signs), rotate(k, signs)
  q8, qd = quantize_blocks(q, scheme.Q_BLOCK)
  k8, kd = quantize_blocks(k, scheme.k_block(k.shape[-1]))
  return q8, qd, k8, kd
