"""Flax integration: an `attention_fn` drop-in and self-attention modules.

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
on every backend (inside the CUDA kernels on a GPU).

`precision` and `force_fp32_for_softmax` are accepted and ignored: every
backend accumulates q·k and p·v and runs the softmax in float32 (float64 for
float64 inputs).

Self-attention modules (projections around `jax_flash.attention`, GQA,
segment ids, and `decode=True` serving with a KV cache that takes a whole
prompt in one call, then one token per call):

* linen: `jax_flash.flax.SelfAttention` (= `jax_flash.flax.linen.SelfAttention`),
  parameters laid out like `flax.linen.MultiHeadDotProductAttention`;
* nnx: `jax_flash.flax.nnx.SelfAttention`, constructor, `init_cache` and state
  laid out like `flax.nnx.MultiHeadAttention`.
"""

from __future__ import annotations

from jax_flash.flax._drop_in import attention_fn, make_attention_fn
from jax_flash.flax.linen import SelfAttention
from jax_flash.flax import nnx

__all__ = ["make_attention_fn", "attention_fn", "SelfAttention", "nnx"]
