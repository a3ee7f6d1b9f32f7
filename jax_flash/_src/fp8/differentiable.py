"""The FP8 forward as a differentiable op: straight-through gradients.

The gradient of the FP8 forward is defined as that of exact attention at the
unquantised inputs (`jax_flash.attention`'s backward at the high-precision
query/key/value): quantisation is treated as the identity. Fp8Tensor inputs
have no high-precision values, so their gradient raises a ValueError. Built
by the one autodiff wrapper (autodiff/differentiable.py) as a first-order op
whose backward takes the raw cotangents (do, dlse).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_flash._src.api import attention as attention_api
from jax_flash._src.autodiff.differentiable import Kernels, differentiable
from jax_flash._src.core.batching import fold_into_batch
from jax_flash._src.core.spec import AttentionSpec
from jax_flash._src.fp8.kernel import kernel_call
from jax_flash._src.fp8.tensor import KINDS, pad_head_dim

_NO_GRAD = (
    "fp8_attention: gradients need 16-bit inputs. {names} given as "
    "Fp8Tensor (pre-quantised), which has no high-precision values to "
    "differentiate at; pass bfloat16/float16/float32 arrays (the gradient is "
    "then that of exact attention at them), or stop_gradient the result")


def _leaves(x, is_fp8: bool, dp: int):
  return [x.data, x.descale] if is_fp8 else [pad_head_dim(x, dp)]


@functools.lru_cache(maxsize=None)
def fp8_fn(impl: str, spec: AttentionSpec):
  """fn(q, k, v, *segs) -> (o [B, T, H, head_dim], lse [B, H, T]) on
  batch-major inputs (arrays [B, N, H, D] or Fp8Tensors, as spec.fp8 says),
  differentiable with the straight-through gradient."""
  forms = spec.fp8.quantized
  head_dim = spec.fp8.logical_head_dim
  forward = fold_into_batch(kernel_call(impl, spec))
  dp = spec.head_dim
  # The exact attention whose gradient is taken: the same implementation
  # for xla, the best available for cuda.
  exact_impl = "xla" if impl == "xla" else None

  def primal(q, k, v, *segs):
    leaves = []
    for x, is_fp8 in zip((q, k, v), forms):
      leaves += _leaves(x, is_fp8, dp)
    o, lse = forward(*leaves, *segs)
    return o[..., :head_dim], lse

  def straight_through(q, k, v, o, lse, do, dlse, *segs):
    del o, lse
    if any(forms):
      names = " and ".join(n for n, f in zip(KINDS, forms) if f)
      raise ValueError(_NO_GRAD.format(names=names))
    exact = lambda q, k, v: attention_api.attention(
        q, k, v, causal=spec.causal, scale=spec.scale,
        window=((spec.window_left, spec.window_right) if spec.has_window
                else None),
        softcap=spec.softcap, segment_ids=tuple(segs) if segs else None,
        return_lse=True, implementation=exact_impl)
    _, vjp = jax.vjp(exact, q, k, v)
    return vjp((do.astype(q.dtype), dlse.astype(jnp.float32)))

  return differentiable(Kernels(primal, straight_through, delta=False))
