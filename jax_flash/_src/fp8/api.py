"""`jax_flash.fp8_attention`, `jax_flash.quantize_fp8` and `Fp8Tensor`.

The FP8 (e4m3) attention forward of scheme.py. Everything here runs at trace
time on shapes and Python values, like `jax_flash.attention` (whose checks it
reuses), so a bad call raises a ValueError naming the argument before
anything is compiled.

Structure of one call (batch-major arrays after the leading batch dims are
folded into one):

    [explicit mesh axes: shard_map over batch/heads]         _shard_call
      custom_vjp: straight-through gradients                  _fp8_fn
        custom_vmap: vmapped axes fold into the batch         fold_into_batch
          quantise the 16-bit inputs + FP8 forward            _kernel_body

Implementation "xla": quantize.py + `reference.forward`, all plain JAX (XLA
partitions it like any computation). Implementation "cuda": the CUDA pre-pass
`cuda.quantize` (three 16-bit inputs, where it serves; else quantize.py and
quantize.v_kernel_layout) and the sm90 FP8 kernel `cuda.forward`; both opaque
FFI calls, each wrapped in custom_partitioning over batch/heads
(`_partitioned`), so sharded inputs run shard-locally.

What the cuda calls receive: batch-major arrays, head dim zero-padded to
scheme.padded_head_dim, and an AttentionSpec whose batch/heads are the local
(per-shard, vmap-folded) ones, head_dim the padded head dim and dtype the
output dtype's name (scale from the original head dim).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_flash._src.api import attention as attention_api
from jax_flash._src.sharding import partition as sharding
from jax_flash._src.backends.registry import Unsupported
from jax_flash._src.core.batching import fold_into_batch
from jax_flash._src.core.checks import (check_arrays, check_scale,
                                   check_segment_ids, check_softcap,
                                   window_fields)
from jax_flash._src.fp8 import cuda as fp8_cuda
from jax_flash._src.fp8 import quantize, reference, scheme
from jax_flash._src.core.spec import AttentionSpec

KINDS = ("query", "key", "value")
IN_DTYPES = ("bfloat16", "float16", "float32")
OUT_DTYPES = ("bfloat16", "float16")
GRANULARITIES = ("block", "tensor")
IMPLEMENTATIONS = ("cuda", "xla")

_E4M3 = jnp.dtype(jnp.float8_e4m3fn)


# ---------------------------------------------------------------------------
# Fp8Tensor and quantize_fp8
# ---------------------------------------------------------------------------


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
      128)] (one per 128 keys), value [..., H, Dp] (one per channel).
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
      block = scheme.Q_BLOCK if self.kind == "query" else scheme.K_BLOCK
      n = x.shape[-3]
      d = jnp.repeat(d, block, axis=-1)[..., :n]  # [..., H, N]
      d = jnp.swapaxes(d, -1, -2)[..., None]  # [..., N, H, 1]
    return (x * d).astype(dtype)


def _check_static_int(name, x):
  if not isinstance(x, numbers.Integral) or isinstance(x, bool):
    raise ValueError(f"{name} must be a Python int (a static value), got "
                     f"{x!r}")
  return int(x)


def _check_bool(name, x):
  if not isinstance(x, (bool, np.bool_)):
    raise ValueError(f"{name} must be True or False, got {x!r}")
  return bool(x)


def _pad_head_dim(x, dp: int):
  d = x.shape[-1]
  if d == dp:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dp - d)])


def _fold(x, n_trailing: int):
  """[..., *trailing] -> [B, *trailing] (B = prod of the leading dims)."""
  lead = x.shape[:x.ndim - n_trailing]
  return x.reshape((math.prod(lead),) + x.shape[x.ndim - n_trailing:])


def quantize_fp8(x, *, kind: str, rotate: bool = True, seed: int = 0,
                 granularity: str = "block") -> Fp8Tensor:
  """Quantise an attention input to e4m3 the way `fp8_attention` does.

  Args:
    x: [..., N, H, D] bfloat16, float16 or float32 (leading batch dims
      allowed); D <= 256, zero-padded to 64, 128 or 256.
    kind: "query" (scales per 64 rows and head), "key" (per 128 keys and
      head) or "value" (per head and head_dim channel over the sequence).
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
  rotate = _check_bool("rotate", rotate)
  seed = _check_static_int("seed", seed)
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
  x4 = _pad_head_dim(_fold(x, 3), dp).astype(jnp.float32)
  seed_used = seed if (rotate and kind != "value") else None
  if seed_used is not None:
    x4 = quantize.rotate(x4, seed_used)
  if granularity == "tensor":
    data, descale = _quantize_tensor(x4, kind)
  elif kind == "value":
    data, descale = quantize.quantize_channels(x4)
  else:
    block = scheme.Q_BLOCK if kind == "query" else scheme.K_BLOCK
    data, descale = quantize.quantize_blocks(x4, block)
  return Fp8Tensor(data=data.reshape(lead + data.shape[1:]),
                   descale=descale.reshape(lead + descale.shape[1:]),
                   kind=kind, rotation_seed=seed_used, head_dim=int(D))


def _descale_shape(kind: str, n: int, heads: int, dp: int):
  if kind == "value":
    return (heads, dp)
  block = scheme.Q_BLOCK if kind == "query" else scheme.K_BLOCK
  return (heads, scheme.num_blocks(n, block))


def _quantize_tensor(x, kind):
  """One scale for all of x [B, N, H, Dp] float32, in `kind`'s descale
  shape [B, H, nb] / [B, H, Dp]."""
  amax = jnp.max(jnp.abs(x), initial=0.0)
  descale, inv = quantize._scales(amax)
  data = quantize._to_e4m3(x, inv)
  B, N, H, dp = x.shape
  return data, jnp.broadcast_to(descale, (B,) + _descale_shape(kind, N, H, dp))


# ---------------------------------------------------------------------------
# fp8_attention
# ---------------------------------------------------------------------------


_NO_GRAD = (
    "fp8_attention: gradients need 16-bit inputs. {names} given as "
    "Fp8Tensor (pre-quantised), which has no high-precision values to "
    "differentiate at; pass bfloat16/float16/float32 arrays (the gradient is "
    "then that of exact attention at them), or stop_gradient the result")


def fp8_attention(query, key, value, *, causal: bool = False,
                  scale: float | None = None,
                  window: tuple[int, int] | None = None,
                  softcap: float | None = None, segment_ids=None,
                  return_lse: bool = False, rotate: bool = True,
                  seed: int = 0, implementation: str | None = None,
                  out_dtype=None):
  """Attention with e4m3 inputs and an e4m3 P (FlashAttention-3-style FP8).

  Inputs are quantised as jax_flash/_src/fp8/scheme.py says: Q and K rotated
  along head_dim by a random Hadamard matrix (which cancels in q·k and spreads
  outliers), scaled per block (Q: 64 rows, K: 128 keys, per head), V scaled
  per channel; softmax probabilities are rounded to e4m3 for the P·V product
  (their row sums are not). The masking options and their meaning are those
  of `jax_flash.attention`.

  Args:
    query: [..., T, H, D] bfloat16/float16/float32 (quantised here), or an
      Fp8Tensor of kind "query" (`quantize_fp8(q, kind="query")`).
    key, value: [..., S, H_kv, D] arrays, or Fp8Tensors of kind "key" /
      "value" (the pre-quantised form an FP8 KV cache keeps). Array inputs
      must share one dtype. H % H_kv == 0 (GQA/MQA). D <= 256; other head
      dims than 64/128/256 are zero-padded (exact) up to the next of them.
    causal, scale, window, softcap, segment_ids: as `jax_flash.attention`
      (bottom-right causal when T != S; scale defaults to 1/sqrt(D), D the
      original head dim).
    return_lse: also return the natural-log logsumexp [..., H, T] float32
      (-inf for rows that see no key).
    rotate: rotate the 16-bit query/key before quantising (default True).
    seed: the rotation's seed (Python int). A pre-quantised query or key
      must have been rotated with the same seed (or not at all, rotate=False)
      as the other: a mismatch raises a ValueError.
    implementation: "cuda" (the sm90 FP8 kernel), "xla" (the simulated
      kernel in plain JAX: the same arithmetic, reference.py) or None (cuda
      when it serves the request, else xla). "pallas" has no FP8 path and
      raises jax_flash.Unsupported, as does "cuda" where it cannot serve.
    out_dtype: bfloat16 or float16; default the 16-bit inputs' dtype
      (bfloat16 for float32 inputs or when every input is an Fp8Tensor).

  Returns:
    out [..., T, H, D] out_dtype, or (out, lse) with return_lse. Rows that
    see no key give zeros (and lse -inf).

  Gradients (straight-through): the FP8 forward's gradient is defined as
  that of exact attention at the unquantised inputs, i.e. `jax.grad` runs
  the backward of `jax_flash.attention` (same options, the inputs' own dtype;
  implementation "xla" for the xla path, the best available for cuda) at the
  high-precision query/key/value. Quantisation is treated as the identity.
  It needs the high-precision values, so differentiating a call that has an
  Fp8Tensor input raises a ValueError. Only reverse mode is defined
  (`jax.grad`, `jax.vjp`); `jax.jvp` is not (a custom_vjp).

  jit, vmap (vmapped axes fold into the batch: one kernel call) and
  batch/head sharding (each device runs its shard) work as for
  `jax_flash.attention`.
  """
  inputs = (query, key, value)
  for name, x in zip(KINDS, inputs):
    _check_input(name, x)
  check_arrays(*(_logical(x) for x in inputs))
  arrays = [x for x in inputs if not isinstance(x, Fp8Tensor)]
  forms = tuple(isinstance(x, Fp8Tensor) for x in inputs)
  dtypes = {jnp.dtype(x.dtype).name for x in arrays}
  if len(dtypes) > 1:
    raise ValueError(f"query, key and value arrays must have the same dtype; "
                     f"got {', '.join(sorted(dtypes))}")
  out_dt = _out_dtype(out_dtype, dtypes)
  rotate = _check_bool("rotate", rotate)
  seed = _check_static_int("seed", seed)
  rot_seed = _rotation_seed(query, key, rotate, seed)

  q_shape, k_shape = _logical(query).shape, _logical(key).shape
  batch_shape = q_shape[:-3]
  T, H, D = q_shape[-3:]
  S, H_kv = k_shape[-3], k_shape[-2]
  dp = scheme.padded_head_dim(D)
  for name, x in zip(KINDS, inputs):
    if isinstance(x, Fp8Tensor):
      _check_fp8_layout(name, x, dp)
  spec = AttentionSpec(
      scale=check_scale(scale, D),
      causal=bool(causal),
      **window_fields(window, causal),
      softcap=check_softcap(softcap),
      has_segment_ids=segment_ids is not None,
      batch=math.prod(batch_shape),
      q_len=T, kv_len=S, num_heads=H, num_kv_heads=H_kv,
      head_dim=dp,  # what the FP8 forward computes with
      dtype=out_dt.name)  # the output's
  segs = check_segment_ids(segment_ids, batch_shape, T, S)
  impl = _choose(spec, implementation, attention_api._platform(
      query.data if forms[0] else query))
  if attention_api.no_rows(batch_shape + (H,)):
    o = jnp.zeros(batch_shape + (T, H, D), out_dt)
    if not return_lse:
      return o
    return o, jnp.full(batch_shape + (H, T), float("-inf"), jnp.float32)

  folded = tuple(_fold_input(x) for x in inputs)
  segs = tuple(s.reshape(spec.batch, -1).astype(jnp.int32) for s in segs)
  bwd_impl = "xla" if impl == "xla" else None
  o, lse = _shard_call(
      lambda s: _fp8_fn(impl, s, forms, rot_seed, out_dt.name, D, bwd_impl),
      spec, folded, segs)
  o = o.reshape(batch_shape + o.shape[1:])
  if not return_lse:
    return o
  return o, lse.reshape(batch_shape + lse.shape[1:])


def _check_input(name, x):
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


def _logical(x):
  """The array an input stands for, as a ShapeDtypeStruct for check_arrays
  (one dtype for all: dtypes are checked separately)."""
  if isinstance(x, Fp8Tensor):
    if x.data.ndim < 3:
      return jax.ShapeDtypeStruct(tuple(x.data.shape), jnp.float32)
    return jax.ShapeDtypeStruct(x.shape, jnp.float32)
  return jax.ShapeDtypeStruct(tuple(x.shape), jnp.float32)


def _check_fp8_layout(name, x: Fp8Tensor, dp: int):
  if x.data.shape[-1] != dp:
    raise ValueError(
        f"{name}.data has head dim {x.data.shape[-1]}, but head_dim "
        f"{x.head_dim} pads to {dp}")
  n, heads = x.data.shape[-3], x.data.shape[-2]
  want = tuple(x.data.shape[:-3]) + _descale_shape(x.kind, n, heads, dp)
  if tuple(x.descale.shape) != want:
    raise ValueError(f"{name}.descale must have shape {want} for data of "
                     f"shape {tuple(x.data.shape)}, got "
                     f"{tuple(x.descale.shape)}")


def _out_dtype(out_dtype, in_dtypes):
  if out_dtype is None:
    (dt,) = in_dtypes or {"bfloat16"}
    return jnp.dtype(dt if dt in OUT_DTYPES else "bfloat16")
  try:
    dt = jnp.dtype(out_dtype)
  except TypeError:
    dt = None
  if dt is None or dt.name not in OUT_DTYPES:
    raise ValueError(f"out_dtype must be bfloat16, float16 or None, got "
                     f"{out_dtype!r}")
  return dt


def _describe_seed(x, rotate, seed):
  if isinstance(x, Fp8Tensor):
    return (f"was quantised with rotation_seed={x.rotation_seed}"
            if x.rotation_seed is not None else "was quantised unrotated")
  return (f"is rotated here with seed={seed}" if rotate else
          "is not rotated here (rotate=False)")


def _rotation_seed(query, key, rotate, seed):
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


def _choose(spec, implementation, platform) -> str:
  if implementation is None:
    try:
      fp8_cuda.check(spec, platform)
      return "cuda"
    except Unsupported:
      return "xla"
  if not isinstance(implementation, str):
    raise ValueError(f"implementation must be a string or None, got "
                     f"{implementation!r}")
  if implementation == "pallas":
    raise Unsupported(
        "fp8_attention: implementation='pallas' has no FP8 path; use "
        "implementation='xla' (the simulated FP8 kernel, plain JAX, runs "
        "everywhere) or 'cuda' (the sm90 FP8 kernel)")
  if implementation == "cuda":
    fp8_cuda.check(spec, platform)  # let the user see why it cannot run
    return "cuda"
  if implementation == "xla":
    return "xla"
  raise ValueError(f"implementation={implementation!r} is not known; "
                   f"fp8_attention supports 'cuda', 'xla' or None (best "
                   f"available)")


def _fold_input(x):
  if isinstance(x, Fp8Tensor):
    return dataclasses.replace(x, data=_fold(x.data, 3),
                               descale=_fold(x.descale, 2))
  return _fold(x, 3)


# ---------------------------------------------------------------------------
# The differentiable call and the kernel body
# ---------------------------------------------------------------------------


def _leaves(x, is_fp8: bool, dp: int):
  return [x.data, x.descale] if is_fp8 else [_pad_head_dim(x, dp)]


@functools.lru_cache(maxsize=None)
def _fp8_fn(impl: str, spec: AttentionSpec, forms: tuple[bool, ...],
            seed: int | None, out_dtype: str, head_dim: int,
            bwd_impl: str | None):
  """fn(q, k, v, *segs) -> (o [B, T, H, head_dim], lse [B, H, T]) on
  batch-major inputs (arrays [B, N, H, D] or Fp8Tensors), with the
  straight-through custom_vjp."""
  forward = fold_into_batch(_kernel_call(impl, spec, forms, seed, out_dtype))
  dp = spec.head_dim

  def primal(q, k, v, *segs):
    leaves = []
    for x, is_fp8 in zip((q, k, v), forms):
      leaves += _leaves(x, is_fp8, dp)
    o, lse = forward(*leaves, *segs)
    return o[..., :head_dim], lse

  @jax.custom_vjp
  def fp8(q, k, v, *segs):
    return primal(q, k, v, *segs)

  def fp8_fwd(q, k, v, *segs):
    return primal(q, k, v, *segs), (q, k, v, segs)

  def fp8_bwd(res, cotangents):
    q, k, v, segs = res
    if any(forms):
      names = " and ".join(n for n, f in zip(KINDS, forms) if f)
      raise ValueError(_NO_GRAD.format(names=names))
    do, dlse = cotangents
    exact = lambda q, k, v: attention_api.attention(
        q, k, v, causal=spec.causal, scale=spec.scale,
        window=((spec.window_left, spec.window_right) if spec.has_window
                else None),
        softcap=spec.softcap, segment_ids=tuple(segs) if segs else None,
        return_lse=True, implementation=bwd_impl)
    _, vjp = jax.vjp(exact, q, k, v)
    dq, dk, dv = vjp((do.astype(q.dtype), dlse.astype(jnp.float32)))
    return (dq, dk, dv) + tuple(None for _ in segs)

  fp8.defvjp(fp8_fwd, fp8_bwd)
  return fp8


def _split_leaves(forms, args):
  """(parts, segs): per input its padded array or (data, descale)."""
  parts, i = [], 0
  for is_fp8 in forms:
    parts.append(tuple(args[i:i + 2]) if is_fp8 else args[i])
    i += 2 if is_fp8 else 1
  return parts, tuple(args[i:])


def _kernel_call(impl, spec, forms, seed, out_dtype):
  """fn(*leaves, *segs) -> (o [B, T, H, Dp], lse [B, H, T]) on batch-major
  leaves: per input the padded array, or an Fp8Tensor's (data, descale)."""
  iq = 0
  ik = 2 if forms[0] else 1

  def call(*args):
    local = sharding.local_spec(spec, args[iq].shape, args[ik].shape)
    return _kernel_body(impl, local, forms, seed, out_dtype, *args)

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
    block = scheme.Q_BLOCK if kind == "query" else scheme.K_BLOCK
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


def _kernel_body(impl, local, forms, seed, out_dtype, *args):
  parts, segs = _split_leaves(forms, args)
  q_seg, kv_seg = segs if segs else (None, None)
  out_dtype = jnp.dtype(out_dtype)
  if impl == "xla":
    return reference.forward(local, *_quantize_inputs(parts, forms, seed),
                             q_seg, kv_seg, out_dtype)
  # cuda: the CUDA pre-pass for three 16-bit inputs where it serves, else
  # quantize.py (plain JAX: XLA partitions it) and V into the kernel's
  # layout; then the FP8 kernel. The opaque calls are partitioned.
  if not any(forms) and _cuda_prepass_serves(parts, seed):
    quantized = _cuda_call("quantize", local, ("q", "kv", "kv"),
                           _PREPASS_OUT, seed=seed)(*parts)
  else:
    q8, qd, k8, kd, v8, vd = _quantize_inputs(parts, forms, seed)
    quantized = (q8, qd, k8, kd, quantize.v_kernel_layout(v8), vd)
  in_roles = _PREPASS_OUT + (("qseg", "kvseg") if segs else ())
  return _cuda_call("forward", local, in_roles, ("q", "lse"),
                    out_dtype=out_dtype.name)(*quantized, *segs)


_PREPASS_OUT = ("q", "qd", "kv", "kd", "vt", "vd")


@functools.lru_cache(maxsize=None)
def _cuda_call(kind, spec, in_roles, out_roles, *, seed=None, out_dtype=None):
  """cuda.quantize or cuda.forward on batch-major arrays, each device
  running its batch/head shard (custom_partitioning)."""
  if kind == "quantize":
    body = lambda local, q, k, v: tuple(fp8_cuda.quantize(q, k, v,
                                                          seed=seed))

  else:
    def body(local, q8, qd, k8, kd, vt8, vd, *segs):
      q_seg, kv_seg = segs if segs else (None, None)
      return tuple(fp8_cuda.forward(local, q8, qd, k8, kd, vt8, vd, q_seg,
                                    kv_seg, jnp.dtype(out_dtype)))
  return _partitioned(spec, in_roles, out_roles, body)


# ---------------------------------------------------------------------------
# Sharding: custom_partitioning (Auto meshes) and shard_map (explicit axes)
# ---------------------------------------------------------------------------


# Dimensions of each role in the Shardy rule; H is the q-head factor that
# sharding.sharding_rule picks (n, (n g) or h). b and the heads shard;
# everything else is replicated (_REPLICATED). vt: V in the kernel layout.
_DIMS = {"q": "b t H e", "kv": "b s n e", "qd": "b H x", "kd": "b n y",
         "vt": "b n e z", "vd": "b n e", "lse": "b H t", "qseg": "b t",
         "kvseg": "b s"}
_REPLICATED = ("t", "s", "e", "x", "y", "z", "g")


def _role_spec(role, batch_axes, head_axes):
  if role in ("q", "kv"):
    return P(batch_axes, None, head_axes, None)
  if role in ("qseg", "kvseg"):
    return P(batch_axes, None)
  if role == "vt":
    return P(batch_axes, head_axes, None, None)
  return P(batch_axes, head_axes, None)  # descales, lse


def _heads_factor(spec, axis_sizes):
  """The q-head factor of sharding.sharding_rule: "n", "(n g)" or "h"."""
  rule, _ = sharding.sharding_rule("forward", spec.group_size, 0,
                                   spec.num_kv_heads, axis_sizes)
  lse = rule.split("->")[1].split(",")[1].strip()  # "b <heads> t"
  assert lse.startswith("b ") and lse.endswith(" t"), rule
  return lse[2:-2]


def sharding_rule(spec, in_roles, out_roles, axis_sizes=None):
  """(rule string, keyword arguments) of an FP8 call for def_partition."""
  heads = _heads_factor(spec, axis_sizes)
  dims = lambda r: _DIMS[r].replace("H", heads)
  rule = (", ".join(dims(r) for r in in_roles) + " -> " +
          ", ".join(dims(r) for r in out_roles))
  order = dict.fromkeys(rule.replace("(", " ").replace(")", " ").replace(
      ",", " ").split())
  kw = dict(need_replication_factors=tuple(f for f in order
                                           if f in _REPLICATED))
  if heads == "(n g)":
    kw["g"] = spec.group_size
  return rule, kw


def _partitioned(spec, in_roles, out_roles, body):
  """custom_partitioning of body(local_spec, *arrays) -> tuple of arrays,
  each device running its batch/head shard: sharding.partitioned for the
  FP8 calls' operands (descales and V's kernel layout shard with their
  heads). Batch and head axes come from the q and first kv operand."""
  iq, ik = in_roles.index("q"), in_roles.index("kv")

  def local_body(*args):
    # Under a jit so that array constants of the body (a rotation matrix,
    # a permutation) stay inside it: custom_partitioning takes no consts.
    local = sharding.local_spec(spec, args[iq].shape, args[ik].shape)
    return jax.jit(lambda *a: tuple(body(local, *a)))(*args)

  @custom_partitioning
  def fn(*args):
    return local_body(*args)

  def decide(mesh, arg_shapes):
    q, k = arg_shapes[iq], arg_shapes[ik]
    q_spec, k_spec = sharding._pspec(q, 4), sharding._pspec(k, 4)
    if q_spec is None or k_spec is None or any(
        getattr(x.sharding, "mesh", None) != mesh for x in (q, k)):
      return None, None  # not NamedShardings over `mesh`: replicate
    return sharding.plan(mesh, q_spec, k_spec, q.shape[0], q.shape[2],
                         k.shape[2])

  def shardings(mesh, rs, batch_axes, head_axes):
    return tuple(NamedSharding(mesh, _role_spec(r, batch_axes, head_axes))
                 for r in rs)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    mesh = sharding.mesh_or_replica(mesh, arg_shapes)
    return shardings(mesh, out_roles, *decide(mesh, arg_shapes))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    mesh = sharding.mesh_or_replica(mesh, arg_shapes)
    axes = decide(mesh, arg_shapes)

    return (mesh, local_body, shardings(mesh, out_roles, *axes),
            shardings(mesh, in_roles, *axes))

  def rule(mesh, operand_types, result_types):
    del operand_types, result_types
    empty = mesh is None or getattr(mesh, "empty", False)
    return sharding_rule(spec, in_roles, out_roles,
                         None if empty else tuple(mesh.shape.values()))

  fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule)
  return fn


def _shard_call(fn_for_spec, spec, inputs, segs):
  """fn_for_spec(local_spec)(q, k, v, *segs), per batch/head shard (shard_map)
  when the query is sharded over explicit mesh axes (as sharding.call, for
  inputs that may be Fp8Tensors)."""
  lead = inputs[0].data if isinstance(inputs[0], Fp8Tensor) else inputs[0]
  found = sharding._explicit_spec(lead)
  if found is None:
    return fn_for_spec(spec)(*inputs, *segs)
  mesh, q_spec = found
  batch_axes, head_axes = sharding.plan(mesh, q_spec, q_spec, spec.batch,
                                        spec.num_heads, spec.num_kv_heads)
  n_batch = sharding._axis_size(mesh, batch_axes)
  n_heads = sharding._axis_size(mesh, head_axes)
  if n_batch == 1 and n_heads == 1:
    return fn_for_spec(spec)(*inputs, *segs)
  x_spec = _role_spec("q", batch_axes, head_axes)
  d_spec = _role_spec("qd", batch_axes, head_axes)
  seg_spec = _role_spec("qseg", batch_axes, head_axes)
  reshard = jax.sharding.reshard
  in_specs, args = [], []
  for x in inputs:
    if isinstance(x, Fp8Tensor):
      in_specs.append(dataclasses.replace(x, data=x_spec, descale=d_spec))
      args.append(dataclasses.replace(x, data=reshard(x.data, x_spec),
                                      descale=reshard(x.descale, d_spec)))
    else:
      in_specs.append(x_spec)
      args.append(reshard(x, x_spec))
  args += [reshard(s, seg_spec) for s in segs]
  in_specs += [seg_spec] * len(segs)
  local = dataclasses.replace(spec, batch=spec.batch // n_batch,
                              num_heads=spec.num_heads // n_heads,
                              num_kv_heads=spec.num_kv_heads // n_heads)
  per_shard = jax.shard_map(fn_for_spec(local), mesh=mesh,
                            in_specs=tuple(in_specs),
                            out_specs=(x_spec, d_spec), check_vma=False)
  return per_shard(*args)
