"""The `attention_fn` drop-in for flax's multi-head attention (linen and nnx).

See the package docstring (`jax_flash.flax`) for what it honours and refuses.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

import jax_flash
from jax_flash._src.core.checks import static_bool

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
          "supported by this drop-in either: use jax_flash.flax.SelfAttention"
          "(decode=True) or jax_flash.flax.nnx.SelfAttention, which keep "
          "their own cache (and take a whole prompt in one call).")
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
                               sinks=sinks,
                               **opts, **dropout)

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
