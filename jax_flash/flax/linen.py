"""`jax_flash.flax.SelfAttention`: a linen self-attention module on jax_flash.

Also exported as `jax_flash.flax.SelfAttention`; the nnx counterpart is
`jax_flash.flax.nnx.SelfAttention`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax.numpy as jnp
from flax import linen as nn

import jax_flash
from jax_flash.flax._self_attention import (attend, attend_with_cache,
                                            cache_shapes, check_decode_call,
                                            head_sizes)

__all__ = ["SelfAttention"]


class SelfAttention(nn.Module):
  """Multi-head self-attention (q/k/v/out projections) on `jax_flash.attention`.

  The parameters are laid out like `flax.linen.MultiHeadDotProductAttention`
  (sub-modules `query`, `key`, `value`, `out`), so with num_kv_heads ==
  num_heads the two modules share parameter trees.

  Attributes:
    num_heads: number of query heads.
    head_dim: size of each head; default qkv_features // num_heads.
    qkv_features: total query width num_heads * head_dim (if head_dim is not
      given); default the input width.
    num_kv_heads: key/value heads (GQA/MQA; must divide num_heads); default
      num_heads.
    value_head_dim: size of each value head, and so of each head's output
      (flax's modules have no such option); default head_dim. DeepSeek MLA
      uses head_dim 192 with value_head_dim 128.
    use_sinks: learnable attention sinks (`jax_flash.attention(sinks=)`):
      a parameter 'sinks' [num_heads], initialised by sinks_init (zeros by
      default), in param_dtype.
    out_features: output width; default the input width.
    causal, window, softcap, scale, implementation: as in
      `jax_flash.attention`.
    deterministic_backward: `jax_flash.attention(deterministic=...)`.
    dropout_rate: attention dropout on the probabilities (as flax's
      `dropout_rate`; drawn from the module's 'dropout' rng stream, off when
      `deterministic`); broadcast_dropout: one mask for every batch element
      and head, as flax.
    deterministic: switches dropout off (may also be given at call time).
    decode: autoregressive decoding with a KV cache, as flax's
      `decode=True`: `init` with an input of the cache's length [batch,
      max_len, features] creates the 'cache' collection (cached_key,
      cached_value [batch, max_len, num_kv_heads, head_dim], cache_index
      [batch] int32). Each later call (with `mutable=["cache"]`) takes a
      chunk of any length T: a whole prompt in one call (prefill), then one
      token per call. The chunk's keys and values are written at each row's
      index and the chunk attends to the cache and (with causal) causally
      to itself in one `jax_flash.attention_with_kvcache` call. Rows of one
      batch may hold different numbers of tokens: pass `lengths` with a
      right-padded chunk.
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: parameter dtype.
    use_bias: biases in the projections.
    kernel_init, bias_init, out_kernel_init: initialisers.
    precision: precision of the projections.
  """

  num_heads: int
  head_dim: int | None = None
  qkv_features: int | None = None
  num_kv_heads: int | None = None
  value_head_dim: int | None = None
  use_sinks: bool = False
  sinks_init: Callable = nn.initializers.zeros_init()
  out_features: int | None = None
  causal: bool = False
  window: tuple[int, int] | None = None
  softcap: float | None = None
  scale: float | None = None
  implementation: str | None = None
  deterministic_backward: bool = False
  dropout_rate: float = 0.0
  broadcast_dropout: bool = True
  deterministic: bool | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  use_bias: bool = True
  kernel_init: Callable = nn.linear.default_kernel_init
  bias_init: Callable = nn.initializers.zeros_init()
  out_kernel_init: Callable | None = None
  precision: Any = None
  decode: bool = False

  @nn.compact
  def __call__(self, x, segment_ids=None, *, lengths=None,
               return_lse: bool = False, deterministic: bool | None = None):
    """x: [batch..., T, features]; segment_ids: [batch..., T] ints or None.

    Tokens attend only to tokens with the same segment id (sequence packing;
    give padding its own id). With decode=True, x is [batch, T, features]
    and `lengths` (int [batch], optional) the valid tokens of each row of x,
    padded on the right: each row's cache index advances by its length, so
    its padding is overwritten by the next call (which must still fit the
    whole chunk in the cache), and the outputs at padded positions are
    meaningless. Returns [batch..., T, out_features], or (out, lse
    [batch..., num_heads, T]) if return_lse.
    """
    features = x.shape[-1]
    head_dim, kv_heads = head_sizes(
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
        head_dim=self.head_dim, qkv_features=self.qkv_features,
        features=features)
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init,
        bias_init=self.bias_init, use_bias=self.use_bias,
        precision=self.precision)
    q = dense(features=(self.num_heads, head_dim), name="query")(x)
    k = dense(features=(kv_heads, head_dim), name="key")(x)
    v = dense(features=(kv_heads, self.value_head_dim or head_dim),
              name="value")(x)
    sinks = None
    if self.use_sinks:
      sinks = self.param("sinks", self.sinks_init, (self.num_heads,),
                         self.param_dtype)
    dropout = {}
    if self.dropout_rate > 0.0:
      if not nn.merge_param("deterministic", self.deterministic,
                            deterministic):
        dropout = dict(dropout_rate=self.dropout_rate,
                       dropout_rng=self.make_rng("dropout"),
                       dropout_broadcast=self.broadcast_dropout)
    if self.decode:
      res = self._decode_step(q, k, v, segment_ids, lengths, return_lse,
                              dropout, sinks)
    else:
      res = attend(self, q, k, v, segment_ids=segment_ids, lengths=lengths,
                   sinks=sinks, return_lse=return_lse, dropout=dropout)
    o, lse = res if return_lse else (res, None)
    out = nn.DenseGeneral(
        features=self.out_features or features, axis=(-2, -1),
        kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.bias_init, use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision,
        name="out")(o)
    return (out, lse) if return_lse else out

  def _decode_step(self, q, k, v, segment_ids, lengths, return_lse,
                   dropout, sinks):
    """One call against the 'cache' collection (see `decode`)."""
    check_decode_call(q, segment_ids, dropout)
    initialized = self.has_variable("cache", "cached_key")
    key_shape, value_shape, index_shape = cache_shapes(*k.shape, v.shape[-1])
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key_shape,
                               k.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros,
                                 value_shape, v.dtype)
    cache_index = self.variable("cache", "cache_index", jnp.zeros,
                                index_shape, jnp.int32)
    if not initialized:  # init: the input's length sizes the cache
      return jax_flash.attention(
          q, k, v, causal=self.causal, scale=self.scale, window=self.window,
          softcap=self.softcap, sinks=sinks, return_lse=return_lse,
          implementation=self.implementation)
    res, cached_key.value, cached_value.value, cache_index.value = (
        attend_with_cache(
            q, k, v, cached_key.value, cached_value.value, cache_index.value,
            lengths=lengths, causal=self.causal, scale=self.scale,
            window=self.window, softcap=self.softcap, return_lse=return_lse,
            implementation=self.implementation, sinks=sinks))
    return res
