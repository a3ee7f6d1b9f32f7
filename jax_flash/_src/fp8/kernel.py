"""The FP8 forward on batch-major arrays: quantise, then the kernel.

Implementation "xla": quantize.py + `reference.forward`, all plain JAX (XLA
partitions it like any computation). Implementation "cuda": the CUDA pre-pass
`cuda.quantize` (three 16-bit inputs, where it serves; else quantize.py) and
the sm90 FP8 kernel `cuda.forward`, which takes Q, K and V in their natural
layouts; both opaque FFI calls, each wrapped in custom_partitioning over
batch/heads, so sharded inputs run shard-locally.

What the cuda calls receive: batch-major arrays, head dim zero-padded to
scheme.padded_head_dim, and an AttentionSpec whose batch/heads are the local
(per-shard, vmap-folded) ones, head_dim the padded head dim and dtype the
output dtype's name (scale from the original head dim).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_flash._src.backends.registry import Unsupported
from jax_flash._src.core import seen
from jax_flash._src.fp8 import cuda as fp8_cuda
from jax_flash._src.fp8 import quantize, reference, scheme
from jax_flash._src.fp8.checks import OUT_DTYPES
from jax_flash._src.fp8.tensor import KINDS
from jax_flash._src.sharding import partition as sharding


def _split_leaves(forms, args):
  """(parts, segs): per input its padded array or (data, descale)."""
  parts, i = [], 0
  for is_fp8 in forms:
    parts.append(tuple(args[i:i + 2]) if is_fp8 else args[i])
    i += 2 if is_fp8 else 1
  return parts, tuple(args[i:])


def kernel_call(impl, spec):
  """fn(*leaves, *segs) -> (o [B, T, H, Dp], lse [B, H, T]) on batch-major
  leaves: per input the padded array, or an Fp8Tensor's (data, descale)
  (which inputs are Fp8Tensors: spec.fp8.quantized)."""
  iq = 0
  ik = 2 if spec.fp8.quantized[0] else 1

  def call(*args):
    local = sharding.local_spec(spec, args[iq].shape, args[ik].shape)
    return _kernel_body(impl, local, *args)

  return call


def _quantize_inputs(parts, forms, seed):
  """(q8, qd, k8, kd, v8, vd) with v8 in the natural layout: the 16-bit
  inputs quantised by quantize.py, the Fp8Tensors' leaves as they are."""
  out = []
  for kind, x, is_fp8 in zip(KINDS, parts, forms):
    if is_fp8:
      out += list(x)
      continue
    if kind == "value":
      out += list(quantize.quantize_channels(x))
      continue
    if seed is not None:
      x = quantize.rotate(x, seed)
    block = scheme.Q_BLOCK if kind == "query" else scheme.k_block(x.shape[-1])
    out += list(quantize.quantize_blocks(x, block))
  return tuple(out)


def _cuda_prepass_serves(parts, seed) -> bool:
  """Whether cuda.quantize takes these inputs (it says so at trace time)."""
  if not all(jnp.dtype(x.dtype).name in OUT_DTYPES for x in parts):
    return False
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in parts]
  try:
    jax.eval_shape(lambda q, k, v: fp8_cuda.quantize(q, k, v, seed=seed),
                   *shapes)
  except Unsupported:
    return False
  return True


def _unseen_zeroed(spec, parts, forms, segs):
  """The 16-bit inputs with unseen tokens zeroed before quantisation
  (seen.zero_unseen): whatever such tokens hold then enters no block or
  channel scale and no product. Fp8Tensor inputs are taken as they are."""
  q_seg, kv_seg = segs if segs else (None, None)
  zeroed = seen.zero_unseen(spec, *(None if is_fp8 else x
                                    for x, is_fp8 in zip(parts, forms)),
                            q_seg, kv_seg)
  return [x if is_fp8 else z for x, z, is_fp8 in zip(parts, zeroed, forms)]


def _kernel_body(impl, local, *args):
  forms, seed = local.fp8.quantized, local.fp8.rotation_seed
  parts, segs = _split_leaves(forms, args)
  parts = _unseen_zeroed(local, parts, forms, segs)
  q_seg, kv_seg = segs if segs else (None, None)
  out_dtype = jnp.dtype(local.dtype)
  if impl == "xla":
    return reference.forward(local, *_quantize_inputs(parts, forms, seed),
                             q_seg, kv_seg, out_dtype)
  # cuda: the CUDA pre-pass for three 16-bit inputs where it serves, else
  # quantize.py (plain JAX: XLA partitions it); then the FP8 kernel. The
  # opaque calls are partitioned.
  if not any(forms) and _cuda_prepass_serves(parts, seed):
    quantized = _cuda_call("quantize", local, ("q", "kv", "kv"),
                           _PREPASS_OUT, seed=seed)(*parts)
  else:
    quantized = _quantize_inputs(parts, forms, seed)
  in_roles = _PREPASS_OUT + (("qseg", "kvseg") if segs else ())
  return _cuda_call("forward", local, in_roles, ("q", "lse"),
                    out_dtype=out_dtype.name)(*quantized, *segs)


# The pre-pass results' roles in the sharding rule (sharding/rule.py).
_PREPASS_OUT = ("q", "q_descale", "kv", "k_descale", "kv", "v_descale")


@functools.lru_cache(maxsize=None)
def _cuda_call(kind, spec, in_roles, out_roles, *, seed=None, out_dtype=None):
  """cuda.quantize or cuda.forward on batch-major arrays, each device
  running its batch/head shard (custom_partitioning: sharding.by_roles)."""
  if kind == "quantize":
    body = lambda local, q, k, v: tuple(fp8_cuda.quantize(q, k, v,
                                                          seed=seed))

  else:
    def body(local, q8, qd, k8, kd, v8, vd, *segs):
      q_seg, kv_seg = segs if segs else (None, None)
      return tuple(fp8_cuda.forward(local, q8, qd, k8, kd, v8, vd, q_seg,
                                    kv_seg, jnp.dtype(out_dtype)))
  ik = in_roles.index("kv")

  def local_body(*args):
    # Under a jit so that array constants of the body (the rotation signs)
    # stay inside it: custom_partitioning takes no consts.
    local = sharding.local_spec(spec, args[0].shape, args[ik].shape)
    return jax.jit(lambda *a: tuple(body(local, *a)))(*args)

  return sharding.by_roles(local_body, in_roles, out_roles,
                           group=spec.group_size, kv_heads=spec.num_kv_heads)

