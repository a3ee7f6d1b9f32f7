"""Flax integration: an `attention_fn` drop-in and a linen self-attention module.

Flax is an optional dependency: `import jax_flash` never imports it, this
module does (install with `pip install "jax_flash[flax]"`).

Drop-in for flax's multi-head attention (linen and nnx)::

    import flax.linen as nn
    import jax_flash.flax as jff

    mha = nn.MultiHeadDotProductAttention(
        num_heads=8, attention_fn=jff.make_attention_fn(causal=True))
    y = mha(x)                  # no `mask=`: causality comes from the factory

    from flax import nnx
    mha = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False,
                                 attention_fn=jff.attention_fn, rngs=nnx.Rngs(0))
    y = mha(x, is_causal=True)  # nnx's `is_causal` is honoured (T == S)

Flax already uses jax_flash's layout ([batch..., length, heads, head_dim]), so
no transposes are needed, and nnx's `num_kv_heads` (GQA) goes straight through.

What the drop-in cannot do, because a flash kernel never builds the
[T, S] attention matrix, raises an error at trace time instead of silently
computing something else:

* `mask=` arrays (incl. `nn.make_causal_mask` and the decode cache mask): use
  `make_attention_fn(causal=..., window=...)`, or `SelfAttention(...)` with
  `segment_ids` for packed sequences / padding;
* `bias=` arrays;
* `sow_weights=True` (the weights do not exist);
* custom/quantised einsums (`qk_attn_weights_einsum`, `einsum_dot_general`, ...).

Attention dropout (`dropout_rate > 0`, `deterministic=False`) is honoured,
`broadcast_dropout` included (one mask for every batch element and head, as
flax draws it), with jax_flash's own generator (the masks differ from flax's
`jax.random.bernoulli` ones; rates are realised in steps of 1/256); it runs
on the xla backend, or pallas with implementation="pallas".

`precision` and `force_fp32_for_softmax` are accepted and ignored: every
backend accumulates q·k and p·v and runs the softmax in float32 (float64 for
float64 inputs).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax.numpy as jnp
from flax import linen as nn

import jax_flash
from jax_flash._src.core.checks import static_bool

__all__ = ["make_attention_fn", "attention_fn", "SelfAttention"]

# Keyword arguments flax passes that we can honour by doing nothing: they only
# tune the precision of a computation that jax_flash already does in fp32, or
# (promote_dtype) how dtypes are promoted, which we do like flax does.
_IGNORED_KWARGS = ("force_fp32_for_softmax", "promote_dtype")


def make_attention_fn(*, causal: bool = False, scale: float | None = None,
                      window: tuple[int, int] | None = None,
                      softcap: float | None = None,
                      implementation: str | None = None,
                      deterministic_backward: bool = False) -> Callable:
  """Returns an `attention_fn` for flax's multi-head attention modules.

  The returned function has the signature of `flax.linen.dot_product_attention`
  (and accepts the extra keywords `flax.nnx.MultiHeadAttention` passes, such as
  `is_causal`) and calls `jax_flash.attention` with the options fixed here.

  Args:
    causal: causal masking. With query length T != key length S, queries are
      aligned to the end of the keys (bottom-right; see `jax_flash.attention`).
    scale: multiplier of q·k; default 1/sqrt(head_dim), as in flax.
    window: (left, right) sliding window, -1 = unbounded on that side.
    softcap: scores become softcap * tanh(scores / softcap).
    implementation: "cuda", "pallas", "xla" or None (best available).
    deterministic_backward: passed to `jax_flash.attention(deterministic=...)`
      (bitwise-reproducible gradients where a backend has the choice). Not to
      be confused with flax's `deterministic`, which switches dropout off.

  Returns:
    fn(query, key, value, bias=None, mask=None, ...) -> [batch..., T, H, D].
    It also takes `segment_ids=` and `sinks=` (see `jax_flash.attention`)
    when called directly; flax's modules never pass them (`SelfAttention`
    holds learnable sinks: `use_sinks=True`).
  """
  options = dict(causal=static_bool(causal, "causal"), scale=scale,
                 window=window, softcap=softcap,
                 implementation=implementation,
                 deterministic=static_bool(deterministic_backward,
                                           "deterministic_backward"))

  # Every keyword flax may pass is named explicitly: linen's
  # MultiHeadDotProductAttention filters its keywords by this signature, so a
  # bare **kwargs would make it silently drop `mask`, `dropout_rate`, ...
  def attention_fn(query, key, value, bias=None, mask=None,
                   broadcast_dropout: bool = True, dropout_rng=None,
                   dropout_rate: float = 0.0, deterministic: bool = False,
                   dtype=None, precision=None, module=None,
                   force_fp32_for_softmax: bool = False,
                   einsum_dot_general=None, qk_attn_weights_einsum=None,
                   attn_weights_value_einsum=None, is_causal: bool = False,
                   segment_ids=None, sinks=None, **kwargs):
    del precision, force_fp32_for_softmax
    if bias is not None:
      raise NotImplementedError(
          "jax_flash attention_fn: an attention `bias` is not supported (the "
          "[T, S] score matrix is never materialised). Use causal=, window= "
          "or softcap= of jax_flash.flax.make_attention_fn, or flax's stock "
          "dot_product_attention.")
    if mask is not None:
      raise NotImplementedError(
          "jax_flash attention_fn: a `mask` array is not supported (it cannot "
          "be inspected at trace time and a flash kernel never builds the "
          "[T, S] matrix it masks). Do not pass mask= (e.g. "
          "nn.make_causal_mask); configure the function instead: "
          "jax_flash.flax.make_attention_fn(causal=True, window=(left, "
          "right)), and use jax_flash.flax.SelfAttention(...)(x, "
          "segment_ids=ids) for packed sequences or padding. Autoregressive "
          "decoding (decode=True), which installs a cache mask, is not "
          "supported by this drop-in either.")
    dropout = {}
    if dropout_rate and not deterministic:
      if dropout_rng is None:
        raise ValueError(
            f"jax_flash attention_fn: dropout_rate={dropout_rate} with "
            "deterministic=False needs a dropout_rng (flax passes the module's "
            "'dropout' rng stream)")
      dropout = dict(dropout_rate=float(dropout_rate), dropout_rng=dropout_rng,
                     dropout_broadcast=bool(broadcast_dropout))
    if module is not None:
      raise NotImplementedError(
          "jax_flash attention_fn: sow_weights=True is not supported: flash "
          "attention never materialises the attention weights.")
    custom = {n: f for n, f in (
        ("einsum_dot_general", einsum_dot_general),
        ("qk_attn_weights_einsum", qk_attn_weights_einsum),
        ("attn_weights_value_einsum", attn_weights_value_einsum)) if f}
    if custom:
      raise NotImplementedError(
          f"jax_flash attention_fn: custom einsums ({', '.join(custom)}) are "
          "not supported; jax_flash computes q·k and p·v in its own kernels.")
    unknown = {n: v for n, v in kwargs.items()
               if n not in _IGNORED_KWARGS and v is not None and v is not False}
    if "input_positions" in unknown:
      raise NotImplementedError(
          "jax_flash attention_fn: `input_positions` (rotary embeddings in "
          "nnx's dot_product_attention_with_rope) is not supported; apply RoPE "
          "to the query/key projections before attention.")
    if unknown:
      raise NotImplementedError(
          f"jax_flash attention_fn: unsupported keyword argument(s) "
          f"{sorted(unknown)}.")

    query, key, value = _promote(query, key, value, dtype)
    opts = dict(options)
    if is_causal and not opts["causal"]:
      T, S = query.shape[-3], key.shape[-3]
      if T != S:
        raise NotImplementedError(
            f"jax_flash attention_fn: is_causal=True with query length {T} != "
            f"key length {S}: flax aligns this mask top-left, jax_flash "
            "bottom-right (queries at the end of the keys). Build the function "
            "with make_attention_fn(causal=True) to ask for bottom-right "
            "alignment explicitly.")
      opts["causal"] = True
    return jax_flash.attention(query, key, value, segment_ids=segment_ids,
                               sinks=sinks, **opts, **dropout)

  attention_fn.__name__ = "jax_flash_attention_fn"
  attention_fn.__qualname__ = "jax_flash_attention_fn"
  attention_fn.__doc__ = (
      "flax attention_fn backed by jax_flash.attention with "
      + ", ".join(f"{k}={v!r}" for k, v in options.items()))
  return attention_fn


def _promote(query, key, value, dtype):
  """As flax: cast to `dtype`, or else to the promoted (inexact) input type."""
  if dtype is None:
    dtype = jnp.result_type(query, key, value)
    if not jnp.issubdtype(dtype, jnp.inexact):
      dtype = jnp.result_type(dtype, jnp.float32)
  return tuple(jnp.asarray(x, dtype) for x in (query, key, value))


#: The plain drop-in: non-causal, default scale, best available backend.
#: nnx's `is_causal=True` still makes it causal (for T == S).
attention_fn = make_attention_fn()


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
      `decode=True`: `init` with an input of the full length [batch, max_len,
      features] creates the 'cache' collection (cached_key, cached_value
      [batch, max_len, num_kv_heads, head_dim], cache_index [batch] int32);
      each later call (with `mutable=["cache"]`) appends its T new tokens to
      the cache and attends to everything cached so far
      (`jax_flash.attention_with_kvcache`, aligned to each row's end).
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
  def __call__(self, x, segment_ids=None, *, return_lse: bool = False,
               deterministic: bool | None = None):
    """x: [batch..., T, features]; segment_ids: [batch..., T] ints or None.

    Tokens attend only to tokens with the same segment id (sequence packing;
    give padding its own id). Returns [batch..., T, out_features], or
    (out, lse [batch..., num_heads, T]) if return_lse.
    """
    features = x.shape[-1]
    if self.head_dim is not None:
      head_dim = self.head_dim
    else:
      qkv = self.qkv_features if self.qkv_features is not None else features
      if qkv % self.num_heads:
        raise ValueError(f"qkv_features ({qkv}) must be divisible by "
                         f"num_heads ({self.num_heads})")
      head_dim = qkv // self.num_heads
    kv_heads = self.num_kv_heads or self.num_heads
    if self.num_heads % kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                       f"num_kv_heads ({kv_heads})")
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init,
        bias_init=self.bias_init, use_bias=self.use_bias,
        precision=self.precision)
    q = dense(features=(self.num_heads, head_dim), name="query")(x)
    k = dense(features=(kv_heads, head_dim), name="key")(x)
    v_dim = self.value_head_dim or head_dim
    v = dense(features=(kv_heads, v_dim), name="value")(x)
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
      res = self._decode_step(q, k, v, segment_ids, return_lse, dropout,
                              sinks)
    else:
      res = jax_flash.attention(
          q, k, v, causal=self.causal, scale=self.scale, window=self.window,
          softcap=self.softcap, segment_ids=segment_ids, sinks=sinks,
          return_lse=return_lse, implementation=self.implementation,
          deterministic=self.deterministic_backward, **dropout)
    o, lse = res if return_lse else (res, None)
    out = nn.DenseGeneral(
        features=self.out_features or features, axis=(-2, -1),
        kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.bias_init, use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision,
        name="out")(o)
    return (out, lse) if return_lse else out

  def _decode_step(self, q, k, v, segment_ids, return_lse, dropout, sinks):
    """One decoding step against the 'cache' collection (see `decode`)."""
    if q.ndim != 4:
      raise ValueError(f"decode=True takes inputs [batch, T, features]; got "
                       f"queries of shape {q.shape}")
    if segment_ids is not None or dropout:
      raise ValueError("decode=True takes no segment_ids and no dropout")
    initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, k.shape,
                               k.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, v.shape,
                                 v.dtype)
    cache_index = self.variable("cache", "cache_index", jnp.zeros,
                                (q.shape[0],), jnp.int32)
    if not initialized:  # init: the input's length sizes the cache
      return jax_flash.attention(
          q, k, v, causal=self.causal, scale=self.scale, window=self.window,
          softcap=self.softcap, sinks=sinks, return_lse=return_lse,
          implementation=self.implementation)
    max_len = cached_key.value.shape[1]
    if q.shape[1] > max_len:
      raise ValueError(f"decode step of {q.shape[1]} tokens exceeds the "
                       f"cache length {max_len}")
    res = jax_flash.attention_with_kvcache(
        q, cached_key.value, cached_value.value, cache_index.value,
        k_new=k.astype(cached_key.value.dtype),
        v_new=v.astype(cached_value.value.dtype), causal=self.causal,
        scale=self.scale, window=self.window, softcap=self.softcap,
        sinks=sinks, return_lse=return_lse,
        implementation=self.implementation)
    cached_key.value, cached_value.value = res[-2], res[-1]
    cache_index.value = jnp.minimum(cache_index.value + q.shape[1], max_len)
    return (res[0], res[1]) if return_lse else res[0]
