"""`Fp8Tensor` (a pre-quantised attention input) and `quantize_fp8`.

The quantisation of scheme.py (quantize.py's arithmetic) on the natural
layout [..., N, H, D], with the checks that name the bad argument.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._src.fp8 import quantize, scheme

KINDS = ("query", "key", "value")
IN_DTYPES = ("bfloat16", "float16", "float32")
GRANULARITIES = ("block", "tensor")

@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("data", "descale"),
                   meta_fields=("kind", "rotation_seed", "head_dim"))
@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
  """A pre-quantised attention input (e.g. one entry of an FP8 KV cache).

  A pytree: `data` and `descale` are its leaves (they go through jit, vmap,
  device_put, scans); `kind`, `rotation_seed` and `head_dim` are static.
  Build one with `quantize_fp8`; `fp8_attention` takes it in place of the
  16-bit array it was made from.

  Attributes:
    data: float8_e4m3fn [..., N, H, Dp], the natural layout (N = T for a
      query, S for a key/value; Dp = head_dim zero-padded to 64, 128 or 256,
      and rotated for query/key when rotation_seed is not None).
    descale: float32, what multiplies `data` back to the (rotated) values:
      query [..., H, ceil(N / 64)] (one per 64 rows), key [..., H, ceil(N /
      k)] (one per k = scheme.k_block(Dp) keys: 160, 224, 128 at Dp = 64,
      128, 256), value [..., H, Dp] (one per channel).
    kind: "query", "key" or "value".
    rotation_seed: seed of the Hadamard rotation (scheme.rotation_matrix)
      applied along head_dim before quantising, or None (not rotated). Always
      None for values. A query and a key must agree on it.
    head_dim: the original D before zero-padding (outputs are sliced to it,
      and the default scale is 1/sqrt(head_dim)).
  """

  data: jax.Array
  descale: jax.Array
  kind: str
  rotation_seed: int | None
  head_dim: int

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the array it stands for: [..., N, H, head_dim]."""
    return tuple(self.data.shape[:-1]) + (self.head_dim,)

  @property
  def ndim(self) -> int:
    return len(self.data.shape)

  def dequantize(self, dtype=jnp.float32):
    """data * descale, [..., N, H, Dp] (still rotated; for inspection and
    tests: rotating back is x R^T with R = scheme.rotation_matrix)."""
    x = self.data.astype(jnp.float32)
    d = self.descale.astype(jnp.float32)
    if self.kind == "value":
      d = d[..., None, :, :]  # [..., 1, H, Dp]
    else:
      block = descale_block(self.kind, x.shape[-1])
      n = x.shape[-3]
      d = jnp.repeat(d, block, axis=-1)[..., :n]  # [..., H, N]
      d = jnp.swapaxes(d, -1, -2)[..., None]  # [..., N, H, 1]
    return (x * d).astype(dtype)


def check_static_int(name, x):
  if not isinstance(x, numbers.Integral) or isinstance(x, bool):
    raise ValueError(f"{name} must be a Python int (a static value), got "
                     f"{x!r}")
  return int(x)


def check_bool(name, x):
  if not isinstance(x, (bool, np.bool_)):
    raise ValueError(f"{name} must be True or False, got {x!r}")
  return bool(x)


def pad_head_dim(x, dp: int):
  d = x.shape[-1]
  if d == dp:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dp - d)])


def fold(x, n_trailing: int):
  """[..., *trailing] -> [B, *trailing] (B = prod of the leading dims)."""
  lead = x.shape[:x.ndim - n_trailing]
  return x.reshape((math.prod(lead),) + x.shape[x.ndim - n_trailing:])


def quantize_fp8(x, *, kind: str, rotate: bool = True, seed: int = 0,
                 granularity: str = "block") -> Fp8Tensor:
  """Quantise an attention input to e4m3 the way `fp8_attention` does.

  Args:
    x: [..., N, H, D] bfloat16, float16 or float32 (leading batch dims
      allowed); D <= 256, zero-padded to 64, 128 or 256.
    kind: "query" (scales per 64 rows and head), "key" (per
      scheme.k_block(D) keys and head: 160, 224, 128 at the padded head dim
      64, 128, 256) or "value" (per head and head_dim channel over the
      sequence).
    rotate: multiply query/key by the Hadamard rotation of `seed` first,
      which spreads outliers over head_dim and cancels in q·k (values are
      never rotated: rotate is ignored for them).
    seed: the rotation's seed (a Python int). The query and the key of one
      fp8_attention call must use the same seed (fp8_attention's `seed`
      for the 16-bit ones).
    granularity: "block" (the scheme's scales, above) or "tensor": one scale
      for the whole tensor of this call (its global amax, broadcast into the
      same descale shapes, so the same kernel runs it): the per-tensor
      baseline of accuracy studies.

  Returns:
    An Fp8Tensor (data [..., N, H, Dp] e4m3 natural layout, descale
    float32): what fp8_attention takes as a pre-quantised input.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}, "
                     f"got {kind!r}")
  if granularity not in GRANULARITIES:
    raise ValueError(f"granularity must be 'block' or 'tensor', got "
                     f"{granularity!r}")
  rotate = check_bool("rotate", rotate)
  seed = check_static_int("seed", seed)
  if isinstance(x, Fp8Tensor) or not hasattr(x, "shape") or not hasattr(
      x, "dtype"):
    raise ValueError(f"x must be a bfloat16, float16 or float32 array, got "
                     f"{type(x).__name__}")
  dt = jnp.dtype(x.dtype).name
  if dt not in IN_DTYPES:
    raise ValueError(f"x has dtype {dt}; quantize_fp8 takes "
                     f"{', '.join(IN_DTYPES)}")
  if x.ndim < 3:
    raise ValueError(f"x must have rank >= 3 ([..., seq, heads, head_dim]); "
                     f"got shape {x.shape}")
  D = x.shape[-1]
  if D < 1:
    raise ValueError(f"head_dim must be >= 1, got {D}")
  dp = scheme.padded_head_dim(D)  # ValueError past 256
  lead = x.shape[:-3]
  x4 = pad_head_dim(fold(x, 3), dp).astype(jnp.float32)
  seed_used = seed if (rotate and kind != "value") else None
  if seed_used is not None:
    x4 = quantize.rotate(x4, seed_used)
  if granularity == "tensor":
    data, descale = _quantize_tensor(x4, kind)
  elif kind == "value":
    data, descale = quantize.quantize_channels(x4)
  else:
    data, descale = quantize.quantize_blocks(x4, descale_block(kind, dp))
  return Fp8Tensor(data=data.reshape(lead + data.shape[1:]),
                   descale=descale.reshape(lead + descale.shape[1:]),
                   kind=kind, rotation_seed=seed_used, head_dim=int(D))


def descale_block(kind: str, dp: int) -> int:
  """Rows per descale of a query or key at the padded head dim dp."""
  return scheme.Q_BLOCK if kind == "query" else scheme.k_block(dp)


def descale_shape(kind: str, n: int, heads: int, dp: int):
  if kind == "value":
    return (heads, dp)
  return (heads, scheme.num_blocks(n, descale_block(kind, dp)))


def _quantize_tensor(x, kind):
  """One scale for all of x [B, N, H, Dp] float32, in `kind`'s descale
  shape [B, H, nb] / [B, H, Dp]."""
  amax = jnp.max(jnp.abs(x), initial=0.0)
  descale, inv = quantize._scales(amax)
  data = quantize._to_e4m3(x, inv)
  B, N, H, dp = x.shape
  return data, jnp.broadcast_to(descale, (B,) + descale_shape(kind, N, H, dp))



def fold_input(x):
  """An input ([..., N, H, D] array or Fp8Tensor) with its leading batch dims
  folded into one."""
  if isinstance(x, Fp8Tensor):
    return dataclasses.replace(x, data=fold(x.data, 3),
                               descale=fold(x.descale, 2))
  return fold(x, 3)
