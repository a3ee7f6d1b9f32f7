"""A tiny causal Flax (linen) language model trained with jax_flash attention.

Each attention layer is `jax_flash.flax.SelfAttention` (causal, grouped-query:
4 query heads share 2 key/value heads). Every row of a batch packs two
independent documents; `segment_ids` keeps attention inside each document.
The data is learnable: every document repeats a random 8-token motif, so the
model can only predict the repeats by attending back 8 positions. The loss
falls from ~log(64) = 4.2 towards ~1.8 (the first 7 targets of each document
are random, so 7/16 * 4.2 is the floor) within ~100 steps.

    python3 examples/flax_lm.py [--steps 100] [--implementation xla|pallas|cuda]
                                [--dtype float32|bfloat16] [--stock]
                                [--compare-packing]

`--stock` swaps in flax's own MultiHeadDotProductAttention with an explicit
mask (no GQA), for comparison. `--compare-packing` then times training steps
on the same documents packed (segment ids, as trained) and unpacked (one
document per row, padded to the row length, padding masked out of the loss),
in real tokens per second.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
from flax import linen as nn

import jax_flash
import jax_flash.flax as jff

# head_dim = D_MODEL // HEADS = 32, the smallest the Pallas kernels take.
VOCAB, D_MODEL, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
DOCS_PER_ROW, DOC_LEN, MOTIF = 2, 16, 8
SEQ = DOCS_PER_ROW * DOC_LEN  # 32


class Block(nn.Module):
  implementation: str | None
  dtype: jnp.dtype
  stock: bool = False

  @nn.compact
  def __call__(self, x, segment_ids):
    h = nn.LayerNorm(dtype=self.dtype)(x)
    if self.stock:
      mask = nn.combine_masks(
          nn.make_causal_mask(segment_ids),
          nn.make_attention_mask(segment_ids, segment_ids, jnp.equal))
      h = nn.MultiHeadDotProductAttention(
          HEADS, dtype=self.dtype, name="attn")(h, mask=mask)
    else:
      h = jff.SelfAttention(
          num_heads=HEADS, num_kv_heads=KV_HEADS, causal=True,
          implementation=self.implementation, dtype=self.dtype,
          name="attn")(h, segment_ids)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.Dense(4 * D_MODEL, dtype=self.dtype)(h)
    return x + nn.Dense(D_MODEL, dtype=self.dtype)(nn.gelu(h))


class TinyLM(nn.Module):
  implementation: str | None = None
  dtype: jnp.dtype = jnp.float32
  stock: bool = False

  @nn.compact
  def __call__(self, tokens, segment_ids, positions):
    x = nn.Embed(VOCAB, D_MODEL, dtype=self.dtype)(tokens)
    x = x + nn.Embed(DOC_LEN, D_MODEL, dtype=self.dtype)(positions)
    for i in range(LAYERS):
      x = Block(self.implementation, self.dtype, self.stock,
                name=f"block{i}")(x, segment_ids)
    x = nn.LayerNorm(dtype=self.dtype)(x)
    return nn.Dense(VOCAB, dtype=self.dtype)(x).astype(jnp.float32)



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


def make_batch(key, batch, packed=True):
  """(inputs, targets, segment_ids, positions, weights): rows of
  DOCS_PER_ROW documents, each a random motif repeated (packed), or the same
  documents one per row, padded to SEQ (segment id 1, weight 0)."""
  motifs = jax.random.randint(key, (batch, DOCS_PER_ROW, MOTIF), 0, VOCAB)
  docs = jnp.tile(motifs, (1, 1, DOC_LEN // MOTIF + 1))[..., :DOC_LEN + 1]
  if not packed:
    rows = batch * DOCS_PER_ROW
    pad = lambda x: jnp.pad(x.reshape(rows, DOC_LEN), ((0, 0), (0, SEQ - DOC_LEN)))
    real = jnp.arange(SEQ)[None] < DOC_LEN
    return (pad(docs[..., :-1]), pad(docs[..., 1:]),
            jnp.where(real, 0, 1).astype(jnp.int32).repeat(rows, 0),
            jnp.minimum(jnp.arange(SEQ), DOC_LEN - 1)[None].repeat(rows, 0),
            real.astype(jnp.float32).repeat(rows, 0))
  inputs = docs[..., :-1].reshape(batch, SEQ)
  targets = docs[..., 1:].reshape(batch, SEQ)
  segment_ids = jnp.repeat(jnp.arange(DOCS_PER_ROW, dtype=jnp.int32),
                           DOC_LEN)[None].repeat(batch, 0)
  positions = jnp.tile(jnp.arange(DOC_LEN), DOCS_PER_ROW)[None].repeat(batch, 0)
  return inputs, targets, segment_ids, positions, jnp.ones((batch, SEQ))


def make_optimizer(lr):
  """optax.adamw when available (flax depends on it), else plain SGD."""
  try:
    import optax
  except ImportError:  # pragma: no cover
    sgd_lr = 10 * lr
    return (lambda params: None,
            lambda g, s, p: (jax.tree.map(lambda x: -sgd_lr * x, g), s),
            "sgd")
  opt = optax.adamw(lr)
  return opt.init, opt.update, "optax.adamw"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=100,
                 help="training steps (default: 100)")
  p.add_argument("--batch", type=int, default=16,
                 help="rows per step, each packed with documents (default: 16)")
  p.add_argument("--lr", type=float, default=3e-3,
                 help="Adam learning rate (default: 3e-3)")
  p.add_argument("--implementation", default=None, type=implementation_arg,
                 help="attention backend: None (best available), cuda, pallas or xla (default: None)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="parameter and activation dtype (default: float32)")
  p.add_argument("--stock", action="store_true",
                 help="use flax's own attention instead of jax_flash")
  p.add_argument("--compare-packing", action="store_true",
                 help="time packed vs one-document-per-row steps after training")
  args = p.parse_args(argv)

  dtype = jnp.dtype(args.dtype)
  model = TinyLM(args.implementation, dtype, args.stock)
  key = jax.random.key(0)
  init_key, data_key = jax.random.split(key)
  batch0 = make_batch(data_key, args.batch)
  params = model.init(init_key, batch0[0], batch0[2], batch0[3])
  opt_init, opt_update, opt_name = make_optimizer(args.lr)
  opt_state = opt_init(params)

  def loss_fn(params, inputs, targets, segment_ids, positions, weights):
    logits = model.apply(params, inputs, segment_ids, positions)
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return jnp.sum(nll * weights) / jnp.sum(weights)

  @functools.partial(jax.jit, static_argnames="packed")
  def train_step(params, opt_state, key, packed=True):
    batch = make_batch(key, args.batch, packed)
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, opt_state = opt_update(grads, opt_state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
    return params, opt_state, loss

  attn = ("flax stock attention" if args.stock else
          f"jax_flash (implementation={args.implementation!r}; registered: "
          f"{', '.join(jax_flash.available_implementations())})")
  print(f"{jax.default_backend()}: {LAYERS} layers, d_model {D_MODEL}, "
        f"{HEADS} heads ({KV_HEADS} kv), seq {SEQ}, vocab {VOCAB}, "
        f"{args.dtype}, {opt_name}, attention: {attn}")
  losses = []
  t0 = time.perf_counter()
  for step in range(args.steps):
    data_key, k = jax.random.split(data_key)
    params, opt_state, loss = train_step(params, opt_state, k)
    losses.append(float(loss))
    if step % 10 == 0 or step == args.steps - 1:
      print(f"step {step:4d}  loss {losses[-1]:.4f}")
  print(f"{args.steps} steps in {time.perf_counter() - t0:.1f}s "
        f"(incl. compile); loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  if not all(map(jnp.isfinite, losses)) or losses[-1] >= losses[0]:
    print("FAILED: loss did not decrease")
    return 1
  if args.compare_packing:
    tokens = args.batch * DOCS_PER_ROW * DOC_LEN  # real tokens per step
    for packed in (True, False):
      state = train_step(params, opt_state, data_key, packed=packed)  # compile
      jax.block_until_ready(state)
      t0 = time.perf_counter()
      for _ in range(20):
        state = train_step(params, opt_state, data_key, packed=packed)
      jax.block_until_ready(state)
      dt = (time.perf_counter() - t0) / 20
      print(f"{'packed (segment ids)' if packed else 'one document per row':22s}"
            f" {tokens / dt:10.0f} tokens/s ({dt * 1e3:.2f} ms/step)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
