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
                                [--compare-packing] [--dropout RATE]
                                [--compare-dropout IMPL_A IMPL_B]

`--stock` swaps in flax's own MultiHeadDotProductAttention with an explicit
mask (no GQA), for comparison. `--compare-packing` then times training steps
on the same documents packed (segment ids, as trained) and unpacked (one
document per row, padded to the row length, padding masked out of the loss),
in real tokens per second.

`--dropout RATE` trains with attention dropout (SelfAttention's
dropout_rate; the 'dropout' rng stream, a fresh key every step).
`--compare-dropout IMPL_A IMPL_B` (e.g. `cuda xla` on a GPU, in bfloat16 by
default; `xla pallas` anywhere) trains the model twice from the same
initialisation, on the same batches with the same dropout keys, once on
each implementation (rate --dropout, 0.25 if not given): jax_flash draws
the dropout mask as a pure function of the key and the position, so both
runs must follow the same loss curve up to rounding. It prints both curves
side by side and their largest difference, then, as a control, the same
run on IMPL_A with other dropout keys (another mask: the gap a wrong mask
opens). Exit status 1 if the two runs differ by more than the tolerance
(COMPARE_RTOL) at any step, 2 if the control does not (the comparison
could not tell masks apart), else 0.
"""

from __future__ import annotations

import argparse
import functools
import math
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
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x, segment_ids, deterministic=True):
    h = nn.LayerNorm(dtype=self.dtype)(x)
    if self.stock:
      mask = nn.combine_masks(
          nn.make_causal_mask(segment_ids),
          nn.make_attention_mask(segment_ids, segment_ids, jnp.equal))
      h = nn.MultiHeadDotProductAttention(
          HEADS, dtype=self.dtype, dropout_rate=self.dropout_rate,
          name="attn")(h, mask=mask, deterministic=deterministic)
    else:
      # Attention dropout from the 'dropout' rng stream when not
      # deterministic (jax_flash's own generator: the mask is a function of
      # the key and the position, the same on every implementation).
      h = jff.SelfAttention(
          num_heads=HEADS, num_kv_heads=KV_HEADS, causal=True,
          implementation=self.implementation, dtype=self.dtype,
          dropout_rate=self.dropout_rate, name="attn")(
              h, segment_ids, deterministic=deterministic)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.Dense(4 * D_MODEL, dtype=self.dtype)(h)
    return x + nn.Dense(D_MODEL, dtype=self.dtype)(nn.gelu(h))


class TinyLM(nn.Module):
  implementation: str | None = None
  dtype: jnp.dtype = jnp.float32
  stock: bool = False
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, tokens, segment_ids, positions, deterministic=True):
    x = nn.Embed(VOCAB, D_MODEL, dtype=self.dtype)(tokens)
    x = x + nn.Embed(DOC_LEN, D_MODEL, dtype=self.dtype)(positions)
    for i in range(LAYERS):
      x = Block(self.implementation, self.dtype, self.stock,
                self.dropout_rate, name=f"block{i}")(x, segment_ids,
                                                      deterministic)
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


# --compare-dropout's tolerance on the relative difference of the two
# runs' training losses, at every step. The runs see the same data and the
# same dropout masks, so they differ only by rounding, which training
# amplifies step by step: in float32 (24 significant bits) the curves of two
# implementations stay orders of magnitude inside 1e-3. bfloat16 keeps 8
# bits (a relative rounding step of 2^-8 = 0.4%); kernels that round
# differently (P cast before P.V, another accumulation order) start a few
# 1e-4 apart and drift, and 2e-2 (five bf16 steps) leaves room for that
# drift over --steps 50. Another dropout mask moves a batch's loss by ~1e-2
# from the first step and the curves apart by ~1e-1 within a few dozen
# steps: the control run prints that gap, and the comparison counts as
# conclusive only if it exceeds the tolerance.
COMPARE_RTOL = {"float32": 1e-3, "bfloat16": 2e-2}
COMPARE_RATE = 0.25  # --compare-dropout's default rate
COMPARE_STEPS = 50


def train(args, implementation, dropout_rate, dropout_seed, *, log=True):
  """Trains TinyLM for args.steps steps: (losses, params, opt_state,
  train_step, data_key). The initialisation and the batches depend on
  nothing but the seed 0, the dropout keys on dropout_seed alone, so two
  calls differ only by what is asked."""
  dtype = jnp.dtype(args.dtype)
  model = TinyLM(implementation, dtype, args.stock, dropout_rate)
  key = jax.random.key(0)
  init_key, data_key = jax.random.split(key)
  batch0 = make_batch(data_key, args.batch)
  params = model.init(init_key, batch0[0], batch0[2], batch0[3])
  opt_init, opt_update, opt_name = make_optimizer(args.lr)
  opt_state = opt_init(params)
  dropout_base = jax.random.key(dropout_seed)

  def loss_fn(params, dropout_key, inputs, targets, segment_ids, positions,
              weights):
    logits = model.apply(params, inputs, segment_ids, positions,
                         deterministic=dropout_rate == 0.0,
                         rngs={"dropout": dropout_key})
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return jnp.sum(nll * weights) / jnp.sum(weights)

  @functools.partial(jax.jit, static_argnames="packed")
  def train_step(params, opt_state, key, step, packed=True):
    batch = make_batch(key, args.batch, packed)
    dropout_key = jax.random.fold_in(dropout_base, step)
    loss, grads = jax.value_and_grad(loss_fn)(params, dropout_key, *batch)
    updates, opt_state = opt_update(grads, opt_state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
    return params, opt_state, loss

  attn = ("flax stock attention" if args.stock else
          f"jax_flash (implementation={implementation!r}; registered: "
          f"{', '.join(jax_flash.available_implementations())})")
  if log:
    print(f"{jax.default_backend()}: {LAYERS} layers, d_model {D_MODEL}, "
          f"{HEADS} heads ({KV_HEADS} kv), seq {SEQ}, vocab {VOCAB}, "
          f"{args.dtype}, {opt_name}, attention: {attn}"
          + (f", attention dropout {dropout_rate:g}" if dropout_rate else ""))
  losses = []
  t0 = time.perf_counter()
  for step in range(args.steps):
    data_key, k = jax.random.split(data_key)
    params, opt_state, loss = train_step(params, opt_state, k, step)
    losses.append(float(loss))
    if log and (step % 10 == 0 or step == args.steps - 1):
      print(f"step {step:4d}  loss {losses[-1]:.4f}")
  if log:
    print(f"{args.steps} steps in {time.perf_counter() - t0:.1f}s "
          f"(incl. compile); loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  return losses, params, opt_state, train_step, data_key


def compare_dropout(args, impl_a, impl_b) -> int:
  """--compare-dropout: the same training on impl_a and impl_b (same init,
  batches and dropout keys), then impl_a with other dropout keys as the
  control. Returns the exit status (see the module docstring)."""
  rate = args.dropout if args.dropout else COMPARE_RATE
  name_a, name_b = str(impl_a), str(impl_b)
  rtol = COMPARE_RTOL[args.dtype]
  print(f"{jax.default_backend()}: --compare-dropout {impl_a} {impl_b}: "
        f"{args.steps} steps, {args.dtype}, attention dropout {rate:g}, "
        f"batch {args.batch}; tolerance: relative {rtol:g} on the loss at "
        "every step")
  a = train(args, impl_a, rate, dropout_seed=1, log=False)[0]
  b = train(args, impl_b, rate, dropout_seed=1, log=False)[0]
  control = (train(args, impl_a, rate, dropout_seed=2, log=False)[0]
             if args.control else None)
  rel = lambda x, y: abs(x - y) / max(abs(y), 1e-30)
  print(f"{'step':>5s} {name_a:>10s} {name_b:>10s} {'|diff|':>10s} "
        f"{'rel':>9s}" + (f" {name_a + ' other keys':>18s} {'rel':>9s}"
                          if control else ""))
  for step, (x, y) in enumerate(zip(a, b)):
    if step % args.log_every and step != args.steps - 1:
      continue
    line = (f"{step:5d} {x:10.5f} {y:10.5f} {abs(x - y):10.3e} "
            f"{rel(x, y):9.2e}")
    if control:
      line += f" {control[step]:18.5f} {rel(control[step], x):9.2e}"
    print(line)
  diff = max(abs(x - y) for x, y in zip(a, b))
  worst = max(rel(x, y) for x, y in zip(a, b))
  print(f"max |loss_{impl_a} - loss_{impl_b}| = {diff:.3e} (relative "
        f"{worst:.2e}; tolerance {rtol:g})")
  finite = all(map(math.isfinite, a + b))
  if not finite or not worst <= rtol:
    print(f"FAILED: {impl_a} and {impl_b} diverge beyond {args.dtype} "
          "rounding with the same dropout keys (a different mask, or a "
          "numerical bug)")
    return 1
  if control is not None:
    gap = max(rel(c, x) for c, x in zip(control, a))
    print(f"control: {impl_a} with other dropout keys differs by up to "
          f"{gap:.2e} (relative)")
    if not gap > rtol:
      print(f"INCONCLUSIVE: another mask moves the loss by no more than the "
            f"tolerance {rtol:g}; raise --dropout or --steps")
      return 2
  print(f"OK: {impl_a} and {impl_b} follow the same loss curve with the "
        "same dropout keys")
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=None,
                 help="training steps (default: 100; --compare-dropout: "
                 f"{COMPARE_STEPS})")
  p.add_argument("--batch", type=int, default=16,
                 help="rows per step, each packed with documents (default: 16)")
  p.add_argument("--lr", type=float, default=3e-3,
                 help="Adam learning rate (default: 3e-3)")
  p.add_argument("--implementation", default=None, type=implementation_arg,
                 help="attention backend: None (best available), cuda, pallas or xla (default: None)")
  p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                 help="parameter and activation dtype (default: float32; "
                 "bfloat16 for --compare-dropout with cuda, whose kernels "
                 "take 16-bit inputs)")
  p.add_argument("--stock", action="store_true",
                 help="use flax's own attention instead of jax_flash")
  p.add_argument("--compare-packing", action="store_true",
                 help="time packed vs one-document-per-row steps after training")
  p.add_argument("--dropout", type=float, default=0.0,
                 help="attention dropout rate (default: 0, none; "
                 f"--compare-dropout: {COMPARE_RATE})")
  p.add_argument("--compare-dropout", nargs=2, metavar=("IMPL_A", "IMPL_B"),
                 type=implementation_arg,
                 help="train on both implementations with the same dropout "
                 "keys and compare the loss curves (e.g. cuda xla)")
  p.add_argument("--no-control", dest="control", action="store_false",
                 help="--compare-dropout without the control run (other "
                 "dropout keys)")
  p.add_argument("--log-every", type=int, default=5,
                 help="--compare-dropout: print every N-th step (default: 5)")
  args = p.parse_args(argv)
  if not 0.0 <= args.dropout < 1.0:
    p.error(f"--dropout must be in [0, 1); got {args.dropout}")
  if args.compare_dropout:
    if args.stock:
      p.error("--compare-dropout compares jax_flash implementations; "
              "not with --stock")
    args.steps = COMPARE_STEPS if args.steps is None else args.steps
    if args.dtype is None:
      args.dtype = ("bfloat16" if "cuda" in args.compare_dropout else
                    "float32")
    return compare_dropout(args, *args.compare_dropout)
  args.steps = 100 if args.steps is None else args.steps
  args.dtype = args.dtype or "float32"

  losses, params, opt_state, train_step, data_key = train(
      args, args.implementation, args.dropout, dropout_seed=1)
  if not all(map(math.isfinite, losses)) or losses[-1] >= losses[0]:
    print("FAILED: loss did not decrease")
    return 1
  if args.compare_packing:
    tokens = args.batch * DOCS_PER_ROW * DOC_LEN  # real tokens per step
    for packed in (True, False):
      state = train_step(params, opt_state, data_key, 0, packed=packed)  # compile
      jax.block_until_ready(state)
      t0 = time.perf_counter()
      for _ in range(20):
        state = train_step(params, opt_state, data_key, 0, packed=packed)
      jax.block_until_ready(state)
      dt = (time.perf_counter() - t0) / 20
      print(f"{'packed (segment ids)' if packed else 'one document per row':22s}"
            f" {tokens / dt:10.0f} tokens/s ({dt * 1e3:.2f} ms/step)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
