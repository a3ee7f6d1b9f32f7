"""The checks of `fp8_attention`'s arguments and its implementation choice.

All at trace time on shapes and Python values, so a bad call raises a
ValueError naming the argument before anything is compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash._src.backends import registry
from jax_flash._src.fp8.tensor import IN_DTYPES, Fp8Tensor, descale_shape

OUT_DTYPES = ("bfloat16", "float16")
IMPLEMENTATIONS = ("cuda", "xla")

_E4M3 = jnp.dtype(jnp.float8_e4m3fn)


def check_input(name, x):
  if isinstance(x, Fp8Tensor):
    if x.kind != name:
      raise ValueError(
          f"{name} is an Fp8Tensor of kind {x.kind!r}; {name} needs kind "
          f"{name!r} (quantize_fp8(x, kind={name!r}): each kind has its own "
          "scales)")
    if not hasattr(x.data, "dtype") or jnp.dtype(x.data.dtype) != _E4M3:
      raise ValueError(f"{name}.data must be a float8_e4m3fn array, got "
                       f"{getattr(x.data, 'dtype', type(x.data).__name__)}")
    if not hasattr(x.descale, "dtype") or jnp.dtype(
        x.descale.dtype) != jnp.float32:
      raise ValueError(f"{name}.descale must be a float32 array, got "
                       f"{getattr(x.descale, 'dtype', type(x.descale))}")
    if name == "value" and x.rotation_seed is not None:
      raise ValueError("value is an Fp8Tensor with a rotation_seed; values "
                       "are never rotated (rotation_seed must be None)")
    return
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{name} must be an array or an Fp8Tensor, got "
                     f"{type(x).__name__}")
  dt = jnp.dtype(x.dtype).name
  if dt not in IN_DTYPES:
    raise ValueError(
        f"{name} has dtype {dt}; fp8_attention takes {', '.join(IN_DTYPES)} "
        f"arrays (quantised inside) or an Fp8Tensor (quantize_fp8(x, "
        f"kind={name!r}))")


def logical(x):
  """The array an input stands for, as a ShapeDtypeStruct for check_arrays
  (one dtype for all: dtypes are checked separately)."""
  if isinstance(x, Fp8Tensor):
    if x.data.ndim < 3:
      return jax.ShapeDtypeStruct(tuple(x.data.shape), jnp.float32)
    return jax.ShapeDtypeStruct(x.shape, jnp.float32)
  return jax.ShapeDtypeStruct(tuple(x.shape), jnp.float32)


def check_fp8_layout(name, x: Fp8Tensor, dp: int):
  if x.data.shape[-1] != dp:
    raise ValueError(
        f"{name}.data has head dim {x.data.shape[-1]}, but head_dim "
        f"{x.head_dim} pads to {dp}")
  n, heads = x.data.shape[-3], x.data.shape[-2]
  want = tuple(x.data.shape[:-3]) + descale_shape(x.kind, n, heads, dp)
  if tuple(x.descale.shape) != want:
    raise ValueError(f"{name}.descale must have shape {want} for data of "
                     f"shape {tuple(x.data.shape)}, got "
                     f"{tuple(x.descale.shape)}")


def check_out_dtype(out_dtype, in_dtypes):
  if out_dtype is None:
    (dt,) = in_dtypes or {"bfloat16"}
    return jnp.dtype(dt if dt in OUT_DTYPES else "bfloat16")
  try:
    dt = jnp.dtype(out_dtype)
  except TypeError:
    dt = None
  if dt is None or dt.name not in OUT_DTYPES:
    got = dt.name if dt is not None else repr(out_dtype)
    raise ValueError(f"out_dtype={got} is not supported; use bfloat16 or "
                     f"float16 (or None for the inputs' 16-bit dtype)")
  return dt


def _describe_seed(x, rotate, seed):
  if isinstance(x, Fp8Tensor):
    return (f"was quantised with rotation_seed={x.rotation_seed}"
            if x.rotation_seed is not None else "was quantised unrotated")
  return (f"is rotated here with seed={seed}" if rotate else
          "is not rotated here (rotate=False)")


def rotation_seed(query, key, rotate, seed):
  """The common rotation seed of query and key (None: unrotated)."""
  own = lambda x: (x.rotation_seed if isinstance(x, Fp8Tensor) else
                   (seed if rotate else None))
  q_seed, k_seed = own(query), own(key)
  if q_seed != k_seed:
    fix = next((f"seed={x.rotation_seed}" if x.rotation_seed is not None
                else "rotate=False") for x in (key, query)
               if isinstance(x, Fp8Tensor))
    raise ValueError(
        f"query and key must be rotated alike (the rotation cancels in q·k "
        f"only then): the key {_describe_seed(key, rotate, seed)}, the query "
        f"{_describe_seed(query, rotate, seed)}; quantise both with the same "
        f"seed (here: pass {fix})")
  return q_seed


def choose(spec, implementation, platform) -> str:
  """The implementation that runs `spec` (an FP8 spec): the one chooser
  (backends.registry.choose: pallas refuses FP8, cuda serves it where the
  sm90 FP8 kernel runs, xla everywhere), after fp8_attention's own checks of
  the name."""
  if implementation is not None:
    if not isinstance(implementation, str):
      raise ValueError(f"implementation must be a string or None, got "
                       f"{implementation!r}")
    if implementation not in IMPLEMENTATIONS + ("pallas",):
      raise ValueError(f"implementation={implementation!r} is not known; "
                       f"fp8_attention supports 'cuda', 'xla' or None (best "
                       f"available)")
  if spec.has_sinks or spec.v_head_dim != spec.head_dim:
    raise registry.Unsupported(
        "fp8_attention has no attention sinks and no value head_dim other "
        "than the query/key head_dim; use jax_flash.attention for these")
  return registry.choose(spec, implementation, platform).name
