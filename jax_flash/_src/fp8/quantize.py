"""FP8 quantisation of attention inputs, in plain JAX (scheme.py's rules).

Arrays are batch-major [B, N, H, D] (N = T for queries, S for keys/values).
Every backend's FP8 path starts from these arrays (the CUDA pre-pass computes
the same values, cuda/fp8/quantize.cu), so the simulated reference and
the kernel see the same e4m3 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash._src.fp8 import scheme

E4M3 = jnp.float8_e4m3fn
_HI = jax.lax.Precision.HIGHEST


def rotate(x, seed: int):
  """x [..., D] times the rotation R of `seed` (float32)."""
  r = jnp.asarray(scheme.rotation_matrix(x.shape[-1], seed), jnp.float32)
  return jnp.einsum("...d,de->...e", x.astype(jnp.float32), r, precision=_HI)


def to_e4m3(y):
  """e4m3 of float32 y: clipped to +-448, rounded to nearest even."""
  m = scheme.E4M3_MAX
  return jnp.clip(y.astype(jnp.float32), -m, m).astype(E4M3)


def _to_e4m3(x, inv):
  return to_e4m3(x * inv)


def _scales(amax):
  """(descale, inv) of block maxima: amax / 448 and 448 / amax; 1 for 0.
  On the GPU, XLA's code for 448 / amax is not correctly rounded (the CUDA
  pre-pass's __fdiv_rn is), so an inverse there can be one ulp off and move a value
  that sits on an e4m3 rounding tie by one step (about 0.1% of the values of
  bf16 inputs); on the CPU the inverses agree bit for bit (the descales
  within an ulp: XLA multiplies by 1 / 448)."""
  amax = amax.astype(jnp.float32)
  nz = amax > 0
  safe = jnp.where(nz, amax, 1.0)
  descale = jnp.where(nz, safe / scheme.E4M3_MAX, 1.0)
  inv = jnp.where(nz, scheme.E4M3_MAX / safe, 1.0)
  return descale, inv


def quantize_blocks(x, block: int):
  """x [B, N, H, D] -> (e4m3 [B, N, H, D], descale [B, H, ceil(N / block)]
  float32): one scale per `block` consecutive rows of a head."""
  B, N, H, D = x.shape
  nb = scheme.num_blocks(N, block)
  x = x.astype(jnp.float32)
  xp = jnp.pad(x, ((0, 0), (0, nb * block - N), (0, 0), (0, 0)))
  xb = xp.reshape(B, nb, block, H, D)
  amax = jnp.max(jnp.abs(xb), axis=(2, 4))  # [B, nb, H]
  descale, inv = _scales(amax)
  x8 = _to_e4m3(xb, inv[:, :, None, :, None]).reshape(B, nb * block, H, D)
  return x8[:, :N], descale.transpose(0, 2, 1)


def quantize_channels(x):
  """x [B, S, H, D] -> (e4m3 [B, S, H, D], descale [B, H, D] float32): one
  scale per head and head_dim column over the whole sequence."""
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=1)  # [B, H, D]
  descale, inv = _scales(amax)
  return _to_e4m3(x, inv[:, None]), descale


def quantize_v_blocks(x, block: int | None = None):
  """V with one scale per block of keys (the alternative to per-channel
  scales that the accuracy study compares): quantize_blocks, by default
  with K's block (scheme.k_block of x's head dim)."""
  return quantize_blocks(x, scheme.k_block(x.shape[-1]) if block is None else block)


def quantize_qkv(q, k, v, *, seed: int | None):
  """The FP8 inputs of one call: rotated (seed not None) and block-scaled Q
  and K, per-channel V. Returns (q8, q_descale, k8, k_descale, v8,
  v_descale), V in [B, S, H_kv, D]."""
  if seed is not None:
    q, k = rotate(q, seed), rotate(k, seed)
  q8, qd = quantize_blocks(q, scheme.Q_BLOCK)
  k8, kd = quantize_blocks(k, scheme.k_block(k.shape[-1]))
  v8, vd = quantize_channels(v)
  return q8, qd, k8, kd, v8, vd
