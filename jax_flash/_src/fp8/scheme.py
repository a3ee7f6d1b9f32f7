"""The FP8 (e4m3) attention scheme: the contract between the quantiser, the
simulated reference and the sm90 kernel. Every constant and layout rule lives
here once.

Quantisation (quantize.py):
* Rotation: Q and K are multiplied along head_dim by R = diag(signs) H / sqrt(D)
  (H the Sylvester Hadamard matrix, signs random +-1 from a seed). R is
  orthogonal, so (Q R)(K R)^T = Q K^T: the rotation cancels in the scores while
  spreading each outlier over all D coordinates ("incoherent processing").
* Scales: Q per block of Q_BLOCK rows, K per block of k_block(D) keys, per head
  (descale = amax / E4M3_MAX of the rotated block); V per channel (per head and
  head_dim column, over the whole sequence). x8 = e4m3(clip(x * (E4M3_MAX /
  amax))), round to nearest even; an all-zero block has descale 1.
  k_block(D) is the sm90 FP8 kernel's KV tile at the padded head dim D, so
  each KV block of the kernel has one K descale, folded into its softmax
  scale; Q_BLOCK is one consumer warpgroup's rows. V per channel is applied to O in the epilogue (free).

Attention (reference.py = the kernel's arithmetic): KV blocks of k_block(D) keys,
visited from the last to the first; S = Q8 K8^T in fp32; the running row max
m in log2 units; P = 2^(S * scale_log2 * dq * dk - m + P_OFFSET_LOG2) so that P
uses e4m3's range (up to 2^8 = 256 < 448); P8 = e4m3(P); the row sum l of the
unrounded P; O = (sum P8 V8) * dv / l; LSE = ln2 * (m - P_OFFSET_LOG2 +
log2 l).

Kernel layouts: q8 [B, T, H, D], k8 and v8 [B, S, H_kv, D], e4m3 in the
layouts of the 16-bit inputs (the CUDA pre-pass writes them so, and so does
quantize.py). The kernel transposes V in shared memory for the PV product;
the order of the keys there is its own business.
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
Q_BLOCK = 64
# Keys per K descale at each padded head dim: the sm90 FP8 kernel's KV tile
# there (FlashAttention-3's FP8 tiles). The C++ side is
# cuda/include/jax_flash/fp8_scheme.h (the kernel's policy asserts it takes
# these tiles; tests/test_fp8_blocks.py checks that the two sides agree).
K_BLOCKS = {64: 160, 128: 224, 256: 128}
P_OFFSET_LOG2 = 8.0
HEAD_DIMS = (64, 128, 256)  # Hadamard sizes; other head dims are zero-padded


def padded_head_dim(d: int) -> int:
  """The head dim the FP8 path computes with (zero-padded up to it)."""
  for h in HEAD_DIMS:
    if d <= h:
      return h
  raise ValueError(f"FP8 attention supports head_dim <= {HEAD_DIMS[-1]}; "
                   f"got {d}")


def k_block(head_dim: int) -> int:
  """Keys per K descale (and per KV block of the kernel and the
  simulation) for head_dim, padded first (padded_head_dim)."""
  return K_BLOCKS[padded_head_dim(head_dim)]


def num_blocks(n: int, block: int) -> int:
  return -(-n // block)


def hadamard(d: int) -> np.ndarray:
  """Sylvester Hadamard matrix of order d (a power of two), entries +-1."""
  h = np.ones((1, 1))
  while h.shape[0] < d:
    h = np.block([[h, h], [h, -h]])
  assert h.shape[0] == d, d
  return h


def rotation_signs(d: int, seed: int) -> np.ndarray:
  """The random +-1 diagonal of the rotation (float32, length d)."""
  rng = np.random.default_rng(np.random.SeedSequence([0x6A78, int(seed)]))
  return np.where(rng.integers(0, 2, size=d) == 1, 1.0, -1.0).astype(np.float32)


def rotation_matrix(d: int, seed: int) -> np.ndarray:
  """R = diag(signs) H / sqrt(d), float64 (orthogonal: R R^T = I)."""
  return rotation_signs(d, seed)[:, None].astype(np.float64) * hadamard(d) / np.sqrt(d)
