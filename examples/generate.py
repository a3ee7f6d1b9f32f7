"""Greedy generation with a KV cache: jax_flash's decode path against Flax's.

A small decoder-only language model (pre-LayerNorm blocks, learned positions)
is built twice from one parameter tree: with `jax_flash.flax.SelfAttention(
decode=True)` (the cache is updated by `jax_flash.attention_with_kvcache`)
and with flax's own `nn.MultiHeadDotProductAttention(decode=True)`. Both
generate greedily from the same prompt, one token per step inside a jitted
`lax.scan`; the script checks that

  * the two decoders give the same logits along the same tokens (and the
    logits of one cache-free causal forward over the whole sequence), and
  * they generate the same tokens,

then reports generated tokens per second for each.

    python3 examples/generate.py [--batch 8] [--prompt 32] [--new 96]
        [--layers 2] [--d-model 256] [--heads 4] [--dtype float32|bfloat16]
        [--implementation None|xla|pallas|cuda] [--repeats 3]

The parameters are random (generation speed and agreement do not need a
trained model).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

import jax_flash.flax as jff


class DecoderLM(nn.Module):
  vocab: int
  d_model: int
  heads: int
  layers: int
  max_len: int
  stock: bool = False
  decode: bool = False
  implementation: str | None = None
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens, positions):
    x = nn.Embed(self.vocab, self.d_model, dtype=self.dtype)(tokens)
    x = x + nn.Embed(self.max_len, self.d_model, dtype=self.dtype)(positions)
    for i in range(self.layers):
      h = nn.LayerNorm(dtype=self.dtype, name=f"ln{i}")(x)
      if self.stock:
        mask = None if self.decode else nn.make_causal_mask(tokens)
        h = nn.MultiHeadDotProductAttention(
            self.heads, dtype=self.dtype, decode=self.decode,
            name=f"attn{i}")(h, mask=mask)
      else:
        h = jff.SelfAttention(
            num_heads=self.heads, causal=True, decode=self.decode,
            implementation=self.implementation, dtype=self.dtype,
            name=f"attn{i}")(h)
      x = x + h
      h = nn.LayerNorm(dtype=self.dtype, name=f"ln_mlp{i}")(x)
      h = nn.Dense(4 * self.d_model, dtype=self.dtype, name=f"up{i}")(h)
      x = x + nn.Dense(self.d_model, dtype=self.dtype, name=f"down{i}")(
          nn.gelu(h))
    x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
    return nn.Dense(self.vocab, dtype=self.dtype, name="head")(x).astype(
        jnp.float32)



IMPLEMENTATIONS = ("cuda", "pallas", "xla")


def implementation_arg(text: str) -> str | None:
  """--implementation: "None" (or "auto") is Python's None, the best
  available backend; otherwise one of jax_flash's backend names."""
  if text in ("None", "none", "auto"):
    return None
  if text not in IMPLEMENTATIONS:
    raise argparse.ArgumentTypeError(
        f"--implementation {text!r} is not known; supported: None (best "
        f"available), {', '.join(IMPLEMENTATIONS)}")
  return text


def make_generate(model, batch: int, prompt_len: int, new: int):
  """jit(params, prompt) -> (tokens [batch, new], logits [batch, new, V]):
  the prompt is fed one token per step (flax's decode takes one at a time),
  then `new` greedy tokens; logits[:, i] are those that chose tokens[:, i]."""
  total = prompt_len + new

  def step(params, cache, token, pos):
    logits, upd = model.apply({"params": params, "cache": cache},
                              token[:, None], jnp.full((batch, 1), pos),
                              mutable=["cache"])
    return upd["cache"], logits[:, 0]

  @jax.jit
  def generate(params, cache, prompt):
    def body(carry, pos):
      cache, token = carry
      cache, logits = step(params, cache, token, pos)
      nxt = jnp.where(pos + 1 < prompt_len,
                      prompt[:, jnp.minimum(pos + 1, prompt_len - 1)],
                      jnp.argmax(logits, -1).astype(prompt.dtype))
      return (cache, nxt), (nxt, logits)

    _, (tokens, logits) = jax.lax.scan(body, (cache, prompt[:, 0]),
                                       jnp.arange(total - 1))
    # Steps prompt_len - 1 ... total - 2 chose the generated tokens.
    tokens = tokens[prompt_len - 1:].T
    logits = jnp.swapaxes(logits[prompt_len - 1:], 0, 1)
    return tokens, logits

  return generate


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=8,
                 help="sequences decoded together (default: 8)")
  p.add_argument("--prompt", type=int, default=32,
                 help="prompt length in tokens (default: 32)")
  p.add_argument("--new", type=int, default=96,
                 help="tokens generated after the prompt (default: 96)")
  p.add_argument("--layers", type=int, default=2,
                 help="decoder layers (default: 2)")
  p.add_argument("--d-model", type=int, default=256,
                 help="model width (default: 256)")
  p.add_argument("--heads", type=int, default=4,
                 help="attention heads (default: 4)")
  p.add_argument("--vocab", type=int, default=256,
                 help="vocabulary size (default: 256)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="parameter and activation dtype (default: float32)")
  p.add_argument("--implementation", default=None, type=implementation_arg,
                 help="attention backend: None (best available), cuda, pallas or xla (default: None)")
  p.add_argument("--repeats", type=int, default=3,
                 help="timed generations, the best one reported (default: 3)")
  args = p.parse_args(argv)

  dtype = jnp.dtype(args.dtype)
  total = args.prompt + args.new
  common = dict(vocab=args.vocab, d_model=args.d_model, heads=args.heads,
                layers=args.layers, max_len=total, dtype=dtype)
  ours = DecoderLM(**common, decode=True, implementation=args.implementation)
  stock = DecoderLM(**common, decode=True, stock=True)
  full = DecoderLM(**common, implementation=args.implementation)

  key = jax.random.key(0)
  pkey, tkey = jax.random.split(key)
  tokens0 = jnp.zeros((args.batch, total), jnp.int32)
  positions0 = jnp.broadcast_to(jnp.arange(total), (args.batch, total))
  params = stock.init(pkey, tokens0, positions0)["params"]
  # The same parameter tree serves both decoders (SelfAttention is laid out
  # like MultiHeadDotProductAttention); each gets its own empty cache.
  cache_ours = ours.init(pkey, tokens0, positions0)["cache"]
  cache_stock = stock.init(pkey, tokens0, positions0)["cache"]
  prompt = jax.random.randint(tkey, (args.batch, args.prompt), 0, args.vocab)

  gen_ours = make_generate(ours, args.batch, args.prompt, args.new)
  gen_stock = make_generate(stock, args.batch, args.prompt, args.new)
  tok_ours, logit_ours = gen_ours(params, cache_ours, prompt)
  tok_stock, logit_stock = gen_stock(params, cache_stock, prompt)

  # Teacher-forced check on one token path (ours): the stock decoder's and a
  # cache-free causal forward's logits over the same sequence.
  seq = jnp.concatenate([prompt, tok_ours[:, :-1]], 1)
  ref_full = jax.jit(lambda p, s: full.apply(
      {"params": p}, s, positions0[:, :s.shape[1]]))(params, seq)
  ref_full = ref_full[:, args.prompt - 1:]
  tol = 1e-3 if dtype == jnp.float32 else 0.1
  scale = float(jnp.max(jnp.abs(ref_full)))
  err_full = float(jnp.max(jnp.abs(logit_ours - ref_full))) / scale
  same_tokens = float(jnp.mean(tok_ours == tok_stock))
  first_diff = int(jnp.argmax(jnp.any(tok_ours != tok_stock, 0))) if (
      same_tokens < 1) else args.new
  # Where both took the same path, their logits must agree too.
  n = first_diff
  err_stock = (float(jnp.max(jnp.abs(logit_ours[:, :n] - logit_stock[:, :n])))
               / scale if n else 0.0)
  print(f"{jax.default_backend()}: batch {args.batch}, prompt {args.prompt}, "
        f"{args.new} new tokens, {args.layers} layers, d_model "
        f"{args.d_model}, {args.heads} heads, {args.dtype}")
  print(f"logits vs cache-free forward: max rel err {err_full:.2e}; vs flax "
        f"decode: {err_stock:.2e}; same greedy tokens: {same_tokens:.3f}")
  ok = err_full <= tol and err_stock <= tol
  if dtype == jnp.float32:
    ok = ok and same_tokens == 1.0

  for name, gen, cache in (("jax_flash decode", gen_ours, cache_ours),
                           ("flax decode", gen_stock, cache_stock)):
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(gen(params, cache, prompt))
      times.append(time.perf_counter() - t0)
    dt = float(np.median(times))
    print(f"{name:17s} {args.batch * args.new / dt:10.0f} generated tokens/s "
          f"({dt * 1e3:.1f} ms for {total - 1} steps)")
  if not ok:
    print("FAILED: the decoders disagree")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
