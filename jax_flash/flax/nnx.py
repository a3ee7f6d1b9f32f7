"""`jax_flash.flax.nnx.SelfAttention`: an nnx self-attention module on jax_flash.

Its constructor, `init_cache` and state (`query`, `key`, `value`, `out`
LinearGeneral layers; `cached_key`, `cached_value`, `cache_index` caches)
follow `flax.nnx.MultiHeadAttention`, so the parameters of one load into the
other (`nnx.update(ours, nnx.state(theirs, nnx.Param))`). The linen
counterpart is `jax_flash.flax.SelfAttention`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import default_kernel_init

from jax_flash.flax._self_attention import (attend, attend_with_cache,
                                            cache_shapes, check_decode_call,
                                            head_sizes)

__all__ = ["SelfAttention"]


class SelfAttention(nnx.Module):
  """Multi-head self-attention (q/k/v/out projections) on `jax_flash.attention`.

  Args (as `flax.nnx.MultiHeadAttention`'s where they share a name):
    num_heads: number of query heads.
    in_features: input width.
    qkv_features: total query width num_heads * head_dim (if head_dim is not
      given); default in_features.
    out_features: output width; default in_features.
    num_kv_heads: key/value heads (GQA/MQA; must divide num_heads); default
      num_heads.
    head_dim: size of each head; default qkv_features // num_heads.
    value_head_dim: size of each value head, and so of each head's output
      (flax's modules have no such option); default head_dim.
    use_sinks: learnable attention sinks (`jax_flash.attention(sinks=)`):
      an `nnx.Param` 'sinks' [num_heads], initialised by sinks_init (zeros
      by default), in param_dtype.
    causal, window, softcap, scale, implementation: as in
      `jax_flash.attention`.
    deterministic_backward: `jax_flash.attention(deterministic=...)`.
    dropout_rate, broadcast_dropout, deterministic: attention dropout, as
      flax's (the 'dropout' stream of `rngs`, forked at construction or given
      at call time; jax_flash's own generator).
    decode: autoregressive decoding against the cache made by `init_cache`
      (may also be given at call time). A call takes a chunk of any length
      T: a whole prompt in one call (prefill), then one token per call. The
      chunk's keys and values are written at each row's `cache_index` and
      the chunk attends to the cache and (with causal) causally to itself in
      one `jax_flash.attention_with_kvcache` call. Rows of one batch may hold
      different numbers of tokens: pass `lengths` with a right-padded chunk.
    dtype, param_dtype, precision, use_bias, kernel_init, out_kernel_init,
      bias_init, out_bias_init: of the projections, as flax's.
    rngs: parameter initialisation (and the dropout stream).
  """

  def __init__(self, num_heads: int, in_features: int,
               qkv_features: int | None = None,
               out_features: int | None = None,
               num_kv_heads: int | None = None, *,
               head_dim: int | None = None,
               value_head_dim: int | None = None, use_sinks: bool = False,
               sinks_init: Callable = nnx.initializers.zeros_init(),
               causal: bool = False,
               window: tuple[int, int] | None = None,
               softcap: float | None = None, scale: float | None = None,
               implementation: str | None = None,
               deterministic_backward: bool = False,
               dropout_rate: float = 0.0, broadcast_dropout: bool = True,
               deterministic: bool | None = None, decode: bool = False,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               precision: Any = None, use_bias: bool = True,
               kernel_init: Callable = default_kernel_init,
               out_kernel_init: Callable | None = None,
               bias_init: Callable = nnx.initializers.zeros_init(),
               out_bias_init: Callable | None = None, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.in_features = in_features
    self.head_dim, self.num_kv_heads = head_sizes(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        qkv_features=qkv_features, features=in_features)
    self.causal, self.window, self.softcap = causal, window, softcap
    self.scale, self.implementation = scale, implementation
    self.deterministic_backward = deterministic_backward
    self.dropout_rate, self.broadcast_dropout = dropout_rate, broadcast_dropout
    self.deterministic, self.decode = deterministic, decode
    linear = functools.partial(
        nnx.LinearGeneral, dtype=dtype, param_dtype=param_dtype,
        precision=precision, use_bias=use_bias, rngs=rngs)
    self.value_head_dim = value_head_dim or self.head_dim
    heads = lambda n, d: dict(out_features=(n, d), kernel_init=kernel_init,
                              bias_init=bias_init)
    self.query = linear(in_features, **heads(num_heads, self.head_dim))
    self.key = linear(in_features, **heads(self.num_kv_heads, self.head_dim))
    self.value = linear(in_features,
                        **heads(self.num_kv_heads, self.value_head_dim))
    self.sinks = (nnx.Param(sinks_init(rngs.params(), (num_heads,),
                                       param_dtype)) if use_sinks else None)
    self.out = linear(
        (num_heads, self.value_head_dim), out_features or in_features,
        axis=(-2, -1), kernel_init=out_kernel_init or kernel_init,
        bias_init=out_bias_init or bias_init)
    self.rngs = rngs.dropout.fork() if dropout_rate > 0 else None
    self.cached_key = nnx.data(None)
    self.cached_value = nnx.data(None)
    self.cache_index = nnx.data(None)

  def init_cache(self, input_shape, dtype: Any = jnp.float32):
    """Makes an empty cache for `decode=True`: input_shape is [batch,
    max_len, features] (max_len: the prompt and every token to generate).
    cached_key/cached_value are [batch, max_len, num_kv_heads, head_dim
    (value_head_dim)] of `dtype`; cache_index [batch] int32 counts the tokens
    each row holds."""
    if len(input_shape) != 3:
      raise ValueError(f"init_cache: input_shape must be [batch, max_len, "
                       f"features]; got {tuple(input_shape)}")
    key_shape, value_shape, index_shape = cache_shapes(
        input_shape[0], input_shape[1], self.num_kv_heads, self.head_dim,
        self.value_head_dim)
    self.cached_key = nnx.Cache(jnp.zeros(key_shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(value_shape, dtype))
    self.cache_index = nnx.Cache(jnp.zeros(index_shape, jnp.int32))

  def __call__(self, x, segment_ids=None, *, lengths=None,
               return_lse: bool = False, deterministic: bool | None = None,
               rngs: nnx.Rngs | nnx.RngStream | None = None,
               decode: bool | None = None):
    """x: [batch..., T, in_features]; segment_ids: [batch..., T] ints or None.

    Tokens attend only to tokens with the same segment id (sequence packing;
    give padding its own id). With decode, x is [batch, T, in_features] and
    `lengths` (int [batch], optional) the valid tokens of each row of x,
    padded on the right: each row's cache index advances by its length, so
    its padding is overwritten by the next call (which must still fit the
    whole chunk in the cache), and the outputs at padded positions are
    meaningless. Returns [batch..., T, out_features], or (out, lse
    [batch..., num_heads, T]) if return_lse.
    """
    if x.shape[-1] != self.in_features:
      raise ValueError(f"x has {x.shape[-1]} features; the module expects "
                       f"in_features={self.in_features}")
    q, k, v = self.query(x), self.key(x), self.value(x)
    sinks = None if self.sinks is None else self.sinks[...]
    dropout = self._dropout(deterministic, rngs)
    decode = self.decode if decode is None else decode
    if decode:
      check_decode_call(q, segment_ids, dropout)
      if self.cached_key is None:
        raise ValueError("decode=True: the cache is not initialised; call "
                         "init_cache(input_shape) first")
      res, self.cached_key[...], self.cached_value[...], \
          self.cache_index[...] = attend_with_cache(
              q, k, v, self.cached_key[...], self.cached_value[...],
              self.cache_index[...], lengths=lengths, causal=self.causal,
              scale=self.scale, window=self.window, softcap=self.softcap,
              return_lse=return_lse, implementation=self.implementation,
              sinks=sinks)
    else:
      res = attend(self, q, k, v, segment_ids=segment_ids, lengths=lengths,
                   sinks=sinks, return_lse=return_lse, dropout=dropout)
    o, lse = res if return_lse else (res, None)
    out = self.out(o)
    return (out, lse) if return_lse else out

  def _dropout(self, deterministic, rngs) -> dict:
    """jax_flash.attention's dropout arguments for this call (flax's rules:
    the call's `deterministic` and `rngs` before the module's)."""
    if self.dropout_rate <= 0.0:
      return {}
    if deterministic is None:
      deterministic = self.deterministic
    if deterministic is None:
      raise ValueError("dropout_rate > 0 needs `deterministic`, given to "
                       "the constructor or the call")
    if deterministic:
      return {}
    stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs
    stream = self.rngs if stream is None else stream
    if stream is None:
      raise ValueError("dropout needs an rng: pass rngs= to the call")
    return dict(dropout_rate=self.dropout_rate, dropout_rng=stream(),
                dropout_broadcast=self.broadcast_dropout)
