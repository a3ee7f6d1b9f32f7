"""The FP8 path's CUDA calls: the quantisation pre-pass and the sm90 FP8
forward kernel, through XLA FFI (cuda/ffi/fp8_handlers.cc)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash._src.backends import cuda as cuda_backend
from jax_flash._src.backends import ffi, kernel_table
from jax_flash._src.backends.registry import Unsupported
from jax_flash._src.fp8 import scheme

QUANTIZE = ffi.FP8_QUANTIZE
FORWARD = ffi.FP8_FWD
OUT_DTYPES = ("bfloat16", "float16")
E4M3 = jnp.float8_e4m3fn


def check(spec, platform: str) -> None:
  """Raises Unsupported (saying why) unless the sm90 FP8 kernel serves `spec`."""
  if platform not in ("gpu", "cuda"):
    raise Unsupported(f"the CUDA FP8 kernel needs an NVIDIA GPU; the platform "
                      f"is {platform!r}")
  if not ffi.available():
    raise Unsupported(f"the CUDA FP8 kernel: {ffi.unavailable_reason()}")
  if "sm90" not in ffi.families():
    raise Unsupported("the CUDA FP8 kernel needs a build with the sm90 family "
                      "(nvcc >= 12.3, JAX_FLASH_CUDA_ARCHS including 90)")
  cc = cuda_backend._compute_capability()
  if cc is not None and cc != (9, 0):
    raise Unsupported(f"the CUDA FP8 kernel runs on sm90 (H100/H200) only; this "
                      f"GPU is sm{cc[0]}{cc[1]}")
  if spec.head_dim > 256:
    raise Unsupported(f"the CUDA FP8 kernel supports head_dim <= 256; got "
                      f"{spec.head_dim}")
  if spec.scale <= 0:
    raise Unsupported(f"the CUDA FP8 kernel needs scale > 0; got {spec.scale}")
  if not spec.bottom_right:
    raise Unsupported("the CUDA FP8 kernel takes the bottom-right alignment "
                      "only")


# The pre-pass's workspace (cuda/fp8/quantize.h): per (batch, kv head) the
# partial channel maxima of V over v_chunks(S) chunks of keys.
V_CHUNK_KEYS = 512
V_MAX_CHUNKS = 32


def v_chunks(s: int) -> int:
  """Chunks of keys per (batch, kv head) in the pre-pass's V maxima:
  min(ceil(s / 512), 32)."""
  return min(scheme.num_blocks(s, V_CHUNK_KEYS), V_MAX_CHUNKS)


def quantize(q, k, v, *, seed):
  """CUDA pre-pass: the values of quantize.quantize_qkv(q, k, v, seed=seed),
  (q8, q_descale, k8, k_descale, v8, v_descale), every e4m3 array in its
  input's layout. q, k, v: bf16/fp16 [B, N, H, D] with D in
  scheme.HEAD_DIMS."""
  if not ffi.available() or "sm90" not in ffi.families():
    raise Unsupported("the CUDA FP8 pre-pass needs the sm90 build")
  if q.dtype not in (jnp.bfloat16, jnp.float16) or not (
      q.dtype == k.dtype == v.dtype):
    raise Unsupported("the CUDA FP8 pre-pass takes bf16/fp16 q, k, v of one "
                      "dtype")
  B, T, H, D = q.shape
  S, Hk = k.shape[1], k.shape[2]
  if D not in scheme.HEAD_DIMS:
    raise Unsupported(f"the CUDA FP8 pre-pass takes head_dim in "
                      f"{scheme.HEAD_DIMS}; got {D}")
  f32 = jnp.float32
  signs = jnp.asarray(scheme.rotation_signs(D, 0 if seed is None else seed))
  out_shapes = (
      jax.ShapeDtypeStruct(q.shape, E4M3),
      jax.ShapeDtypeStruct((B, H, scheme.num_blocks(T, scheme.Q_BLOCK)), f32),
      jax.ShapeDtypeStruct(k.shape, E4M3),
      jax.ShapeDtypeStruct((B, Hk, scheme.num_blocks(S, scheme.k_block(D))),
                           f32),
      jax.ShapeDtypeStruct(v.shape, E4M3),
      jax.ShapeDtypeStruct((B, Hk, D), f32),
      jax.ShapeDtypeStruct((max(B * Hk * v_chunks(S) * D, 1),), f32))
  *outs, _ = ffi.call(QUANTIZE, out_shapes, q, k, v, signs,
                      rotate=seed is not None)
  return tuple(outs)


def forward(spec, q8, q_descale, k8, k_descale, v8, v_descale, q_seg, kv_seg,
            out_dtype):
  """(o [B, T, H, Dp] out_dtype, lse [B, H, T] float32) from the kernel
  inputs (scheme.py): q8 [B, T, H, Dp], k8 and v8 [B, S, H_kv, Dp] e4m3,
  descales float32 q [B, H, ceil(T/64)], k [B, H_kv, ceil(S/k)] (k =
  scheme.k_block(Dp)), v [B, H_kv, Dp]. Dp (scheme.padded_head_dim: 64, 128 or 256) is one of the
  kernel's head dims (kernel_table "sm90_fp8")."""
  if jnp.dtype(out_dtype).name not in OUT_DTYPES:
    raise Unsupported(f"the CUDA FP8 kernel writes {', '.join(OUT_DTYPES)}; "
                      f"got {jnp.dtype(out_dtype).name}")
  B, T, H, D = q8.shape
  if kernel_table.bucket("sm90_fp8", D) != D:
    raise Unsupported(f"the CUDA FP8 kernel runs head dims "
                      f"{kernel_table.HEAD_DIMS['sm90_fp8']}; got {D}")
  if spec.has_segment_ids:
    segs = (q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32))
  else:
    segs = (jnp.zeros((1,), jnp.int32),) * 2
  out_shapes = (jax.ShapeDtypeStruct((B, T, H, D), out_dtype),
                jax.ShapeDtypeStruct((B, H, T), jnp.float32),
                jax.ShapeDtypeStruct((1,), jnp.int32))
  o, lse, _ = ffi.call(FORWARD, out_shapes, q8, k8, v8,
                       q_descale.astype(jnp.float32),
                       k_descale.astype(jnp.float32),
                       v_descale.astype(jnp.float32), *segs,
                       **ffi.mask_attrs(spec, shifts=False))
  return o, lse

