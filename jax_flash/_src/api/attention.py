"""`jax_flash.attention`: argument checks, canonicalisation, backend choice.

Everything here runs at trace time on shapes and Python values, so a bad call
raises a Python exception naming the argument before anything is compiled
(the checks themselves are in core/checks.py, shared with `ring_attention`).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jax_flash._src.autodiff.differentiable import attention_fn
from jax_flash._src.backends import registry as backends
from jax_flash._src.compat import jax_nn_names
from jax_flash._src.core import dropout
from jax_flash._src.core import kv_lengths
from jax_flash._src.core.checks import (check_arrays, check_dropout,
                                        check_scale, check_segment_ids,
                                        check_sinks, check_softcap,
                                        static_bool,
                                        window_fields)
from jax_flash._src.core.spec import AttentionSpec
from jax_flash._src.sharding import partition as sharding


def attention(query, key, value, *jax_nn_args, causal: bool = False,
              scale: float | None = None,
              window: tuple[int, int] | None = None,
              softcap: float | None = None, segment_ids=None,
              kv_seq_lengths=None, sinks=None, dropout_rate: float = 0.0,
              dropout_rng=None, dropout_broadcast: bool = False,
              return_lse: bool = False, implementation: str | None = None,
              deterministic: bool = False, **jax_nn_kwargs):
  """Exact attention softmax(scale * q k^T + mask) v, computed blockwise.

  Args:
    query: [..., T, H, D] (leading dims are batch dims; at least one of T,H,D).
    key: [..., S, H_kv, D] with the same leading dims; H % H_kv == 0
      (GQA/MQA).
    value: [..., S, H_kv, D_v]; D_v may differ from D (DeepSeek MLA: D = 192,
      D_v = 128). The output has D_v.
    causal: mask keys after the query. With T != S queries are aligned to the
      end of the keys (bottom-right, as FlashAttention >= 2.1): query i may see
      keys j <= i + S - T. This is what decoding against a KV cache needs.
    scale: multiplier of q·k; default 1/sqrt(D).
    window: (left, right) sliding window around the aligned diagonal; -1 means
      unbounded on that side. Query i sees keys in
      [i + S - T - left, i + S - T + right]. Combined with `causal` (right=0).
    softcap: if set, scores become softcap * tanh(scores / softcap).
    segment_ids: (q_ids [..., T], kv_ids [..., S]) integer arrays, or one
      array [..., T] when T == S; attention only within equal ids (packing).
    kv_seq_lengths: integer array of the batch dims' shape: keys at positions
      >= length are padding (a preallocated KV cache). The queries are then
      the last T of the valid keys: causal/window align to the length, not S
      (core/kv_lengths.py). Not together with segment_ids.
    sinks: learnable attention sinks (gpt-oss; FlashAttention's
      `learnable_sink`): a float array [H], one logit per query head. Each
      row's softmax has exp(sinks[h]) in its denominator, and the sink takes
      no value: out = sum_j exp(s_j) v_j / (exp(sinks[h]) + sum_j exp(s_j)).
      Differentiable (computed in float32, float64 for float64 inputs).
      Every backend serves them; the LSE includes the sink.
    dropout_rate: attention dropout on the probabilities (a static float in
      [0, 1); rates are realised in steps of 1/256): out = (P * Z / (1 -
      rate)) V, the LSE from the undropped P. Needs dropout_rng.
    dropout_rng: a jax.random key. The mask is a pure function of the key
      and the global (batch, head, query, key) position, the same on every
      backend and mesh (core/dropout.py); vmap over keys gives each element its
      own mask, one key shared across a vmap the same one. Runs on every
      backend (inside the CUDA kernels: the default on a GPU); reverse-mode
      differentiable.
    dropout_broadcast: one dropout mask for every batch element and head
      (Flax's broadcast_dropout).
    return_lse: also return the natural-log logsumexp [..., H, T] (float32,
      float64 for float64 inputs; -inf for rows that see no key). With sinks
      it includes the sink: lse = log(exp(sinks[h]) + sum_j exp(s_j)), so a
      row that sees no key has lse = sinks[h].
    implementation: "cuda", "pallas", "xla", or None for the best available.
    deterministic: ask the backward for a fixed accumulation order (bitwise
      reproducible gradients) where the backend has a choice.

  Returns:
    out [..., T, H, D_v] in query.dtype, or (out, lse) if return_lse. Rows
    that see no key give zeros.

  jax.nn.dot_product_attention's argument names raise an error naming the
  equivalent here; jax_flash.dot_product_attention is the exact drop-in.
  """
  if jax_nn_args or jax_nn_kwargs or implementation == "cudnn":
    jax_nn_names.refuse(jax_nn_args, jax_nn_kwargs, implementation)
  q, k, v = query, key, value
  check_arrays(q, k, v)
  causal = static_bool(causal, "causal")
  return_lse = static_bool(return_lse, "return_lse")
  deterministic = static_bool(deterministic, "deterministic")
  dropout_broadcast = static_bool(dropout_broadcast, "dropout_broadcast")
  rate = check_dropout(dropout_rate, dropout_rng)
  batch_shape = q.shape[:-3]
  T, H, D = q.shape[-3:]
  S, H_kv = k.shape[-3], k.shape[-2]
  sinks = check_sinks(sinks, H, q.dtype)
  spec = AttentionSpec(
      scale=check_scale(scale, D),
      causal=bool(causal),
      **window_fields(window, causal),
      softcap=check_softcap(softcap),
      has_segment_ids=segment_ids is not None or kv_seq_lengths is not None,
      # math.prod, not np.prod: batch dims may be symbolic (jax.export).
      batch=math.prod(batch_shape),
      q_len=T, kv_len=S, num_heads=H, num_kv_heads=H_kv, head_dim=D,
      value_head_dim=AttentionSpec.value_head_dim_of(D, v.shape[-1]),
      dtype=jnp.dtype(q.dtype).name,
      deterministic=bool(deterministic),
      dropout_rate=rate, dropout_broadcast=rate > 0.0 and bool(
          dropout_broadcast), has_sinks=sinks is not None)
  if rate > 0.0 and kv_seq_lengths is not None:
    raise ValueError("dropout_rate with kv_seq_lengths is not supported; "
                     "give the padding as segment_ids instead")
  if kv_seq_lengths is None:
    segs = check_segment_ids(segment_ids, batch_shape, T, S)
    if segs and segs[0] is segs[1] and T == S:
      spec = dataclasses.replace(spec, segments_aligned=True)
  else:
    k, v, segs = kv_lengths.inputs(spec, k, v, kv_seq_lengths, segment_ids,
                                   batch_shape)
  if implementation is not None and not isinstance(implementation, str):
    raise ValueError(f"implementation must be a string or None, got "
                     f"{implementation!r}")
  # One backend, or one per lowering platform (jax.export from a CPU host).
  branches = backends.choose_per_platform(spec, implementation, _platform(q))
  key = ()  # dropout's key words: operands after the segment ids
  if spec.has_dropout:
    # On explicit mesh axes sharding.call gives each shard the words of its
    # own origin, so every mesh draws the mask of one device.
    key = dropout.key_words(dropout_rng)
  if no_rows(batch_shape + (H,)):
    return empty_result(q, return_lse, v.shape[-1])
  B = spec.batch
  fold = lambda x: x.reshape((B,) + x.shape[len(batch_shape):])
  args = [fold(q), fold(k), fold(v)] + per_batch_sinks(sinks, B)
  seg_args = [s.reshape(B, -1).astype(jnp.int32) for s in segs]
  o, lse = backends.run(branches, lambda b: lambda *a: sharding.call(
      lambda s: attention_fn(b.name, s), spec, *a), *args, *seg_args, *key)
  o = o.reshape(batch_shape + o.shape[1:])
  if not return_lse:
    return o
  return o, lse.reshape(batch_shape + lse.shape[1:])


def no_rows(dims) -> bool:
  """Whether a batch dim or the head count is 0: the outputs are empty.

  Kernels are not launched for empty grids (a CUDA launch with a zero grid
  dimension fails). Symbolic dims (export) are >= 1, so only ints count.
  """
  return any(isinstance(d, (int, np.integer)) and d == 0 for d in dims)


def per_batch_sinks(sinks, batch) -> list:
  """[] or [sinks [B, H]]: the kernels' operand, one row per batch element
  (so that vmap folds into the batch as for every other operand)."""
  if sinks is None:
    return []
  return [jnp.broadcast_to(sinks, (batch,) + sinks.shape)]


def empty_result(q, return_lse, value_head_dim=None):
  """Outputs of an empty request. They do not depend on the inputs, so
  their gradients are (empty) zeros, and no kernel runs forward or back."""
  T, H = q.shape[-3], q.shape[-2]
  dv = q.shape[-1] if value_head_dim is None else value_head_dim
  o = jnp.zeros(q.shape[:-1] + (dv,), q.dtype)
  if not return_lse:
    return o
  acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
  return o, jnp.full(q.shape[:-3] + (H, T), float("-inf"), acc)


def _platform(x) -> str:
  """Platform the computation will run on (the default backend under jit)."""
  try:
    devices = x.devices()  # concrete arrays
    return next(iter(devices)).platform
  except Exception:  # tracers and ShapeDtypeStructs
    return backends.default_platform()
