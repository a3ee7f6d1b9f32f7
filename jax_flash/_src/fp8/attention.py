"""`jax_flash.fp8_attention`: the entry, its checks and its batch folding.

The FP8 (e4m3) attention forward of scheme.py. Everything here runs at trace
time on shapes and Python values, like `jax_flash.attention` (whose checks it
reuses), so a bad call raises a ValueError naming the argument before
anything is compiled.

Structure of one call (batch-major arrays after the leading batch dims are
folded into one):

    [explicit mesh axes: shard_map over batch/heads]    sharding.call
      straight-through gradients (autodiff wrapper)      differentiable.fp8_fn
        custom_vmap: vmapped axes fold into the batch    fold_into_batch
          quantise the 16-bit inputs + FP8 forward       kernel.kernel_body
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jax_flash._src.api import attention as attention_api
from jax_flash._src.core.checks import (check_arrays, check_scale, static_bool,
                                        check_segment_ids, check_softcap,
                                        window_fields)
from jax_flash._src.core.spec import AttentionSpec, Fp8Scheme
from jax_flash._src.fp8 import scheme
from jax_flash._src.fp8.checks import (check_fp8_layout, check_input,
                                       check_out_dtype, choose, logical,
                                       rotation_seed)
from jax_flash._src.fp8.differentiable import fp8_fn
from jax_flash._src.sharding import partition as sharding
from jax_flash._src.fp8.tensor import (KINDS, Fp8Tensor, check_bool,
                                       check_static_int, fold_input)


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
  outliers), scaled per block (Q: 64 rows, K: 160, 224 or 128 keys at the
  padded head dim 64, 128 or 256, per head), V scaled per channel; softmax
  probabilities are rounded to e4m3 for the P·V product (their row sums are
  not). The masking options and their meaning are those
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
    check_input(name, x)
  check_arrays(*(logical(x) for x in inputs))
  if logical(value).shape[-1] != logical(query).shape[-1]:
    raise ValueError(
        f"fp8_attention needs the value head_dim equal to the query/key "
        f"head_dim; got {logical(value).shape[-1]} and "
        f"{logical(query).shape[-1]} (jax_flash.attention serves a distinct "
        f"value head_dim)")
  arrays = [x for x in inputs if not isinstance(x, Fp8Tensor)]
  forms = tuple(isinstance(x, Fp8Tensor) for x in inputs)
  dtypes = {jnp.dtype(x.dtype).name for x in arrays}
  if len(dtypes) > 1:
    raise ValueError(f"query, key and value arrays must have the same dtype; "
                     f"got {', '.join(sorted(dtypes))}")
  out_dt = check_out_dtype(out_dtype, dtypes)
  causal = static_bool(causal, "causal")
  return_lse = static_bool(return_lse, "return_lse")
  rotate = check_bool("rotate", rotate)
  seed = check_static_int("seed", seed)
  rot_seed = rotation_seed(query, key, rotate, seed)

  q_shape, k_shape = logical(query).shape, logical(key).shape
  batch_shape = q_shape[:-3]
  T, H, D = q_shape[-3:]
  S, H_kv = k_shape[-3], k_shape[-2]
  dp = scheme.padded_head_dim(D)
  for name, x in zip(KINDS, inputs):
    if isinstance(x, Fp8Tensor):
      check_fp8_layout(name, x, dp)
  spec = AttentionSpec(
      scale=check_scale(scale, D),
      causal=bool(causal),
      **window_fields(window, causal),
      softcap=check_softcap(softcap),
      has_segment_ids=segment_ids is not None,
      batch=math.prod(batch_shape),
      q_len=T, kv_len=S, num_heads=H, num_kv_heads=H_kv,
      head_dim=dp,  # what the FP8 forward computes with
      dtype=out_dt.name,  # the output's
      fp8=Fp8Scheme(quantized=forms, rotation_seed=rot_seed,
                    logical_head_dim=D))
  segs = check_segment_ids(segment_ids, batch_shape, T, S)
  impl = choose(spec, implementation, attention_api._platform(
      query.data if forms[0] else query))
  if attention_api.no_rows(batch_shape + (H,)):
    o = jnp.zeros(batch_shape + (T, H, D), out_dt)
    if not return_lse:
      return o
    return o, jnp.full(batch_shape + (H, T), float("-inf"), jnp.float32)

  folded = tuple(fold_input(x) for x in inputs)
  segs = tuple(s.reshape(spec.batch, -1).astype(jnp.int32) for s in segs)
  o, lse = sharding.call(
      lambda s: fp8_fn(impl, s), spec, *folded, *segs, roles=_roles(folded, len(segs)))
  o = o.reshape(batch_shape + o.shape[1:])
  if not return_lse:
    return o
  return o, lse.reshape(batch_shape + lse.shape[1:])


_DESCALE_ROLES = {"query": "q_descale", "key": "k_descale",
                  "value": "v_descale"}


def _roles(inputs, n_segs):
  """The sharding roles of the folded inputs (an Fp8Tensor: a pytree of
  roles) and the segment ids (sharding/rule.py)."""
  roles = []
  for kind, x in zip(KINDS, inputs):
    data = "q" if kind == "query" else "kv"
    roles.append(dataclasses.replace(x, data=data,
                                     descale=_DESCALE_ROLES[kind])
                 if isinstance(x, Fp8Tensor) else data)
  return tuple(roles) + ("qseg", "kvseg")[:n_segs]
