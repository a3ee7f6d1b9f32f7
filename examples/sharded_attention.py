"""Ring attention over a sequence-sharded device mesh, inside a Flax model.

A tiny causal linen model whose attention calls `jax_flash.ring_attention`:
the tokens (and so every activation) are sharded along the sequence over the
mesh axis "seq", and each attention layer passes key/value chunks around the
ring instead of gathering the sequence. The script runs one jitted
forward + gradient step on the sharded inputs, the same model with plain
(unsharded) `jax_flash.attention`, and prints the largest differences.

On CPU it asks XLA for 8 host devices (a 2 x 4 "data" x "seq" mesh); on a
machine with several GPUs it uses them instead (the flag only affects the
host platform).

    python3 examples/sharded_attention.py [--implementation xla|pallas|cuda]
        [--strategy ring|all_gather] [--batch 4] [--seq 256] [--train-steps 30]
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # before jax is imported
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                             _FLAG).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_flash  # noqa: E402

VOCAB, D_MODEL, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
HEAD_DIM = D_MODEL // HEADS  # 32, the smallest head dim the Pallas kernels take


class Attention(nn.Module):
  """Causal GQA self-attention; `attn` is the attention function to call."""
  attn: callable

  @nn.compact
  def __call__(self, x):
    B, T, _ = x.shape
    q = nn.Dense(HEADS * HEAD_DIM, use_bias=False, name="q")(x)
    kv = nn.Dense(2 * KV_HEADS * HEAD_DIM, use_bias=False, name="kv")(x)
    q = q.reshape(B, T, HEADS, HEAD_DIM)
    k, v = jnp.split(kv.reshape(B, T, 2 * KV_HEADS, HEAD_DIM), 2, axis=2)
    o = self.attn(q, k, v)
    return nn.Dense(D_MODEL, use_bias=False, name="out")(o.reshape(B, T, -1))


class Model(nn.Module):
  attn: callable

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D_MODEL)(tokens)
    for _ in range(LAYERS):
      x = x + Attention(self.attn)(nn.LayerNorm()(x))
      h = nn.Dense(4 * D_MODEL)(nn.LayerNorm()(x))
      x = x + nn.Dense(D_MODEL)(nn.gelu(h))
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))



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


def loss_fn(model, params, inputs, targets):
  """Next-token cross-entropy (targets = inputs shifted by one)."""
  logp = jax.nn.log_softmax(model.apply(params, inputs).astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def motif_batch(key, batch, seq):
  """Tokens [batch, seq + 1]: a random 8-token motif per row, repeated."""
  motif = jax.random.randint(key, (batch, 8), 0, VOCAB)
  return jnp.tile(motif, (1, (seq + 1) // 8 + 1))[:, :seq + 1]


def train(model, params, mesh, args):
  """(first loss, last loss, tokens/s) of --train-steps adamw steps on
  sequence-sharded motif batches."""
  import optax
  opt = optax.adamw(1e-3)
  seq_sharded = NamedSharding(mesh, P("data", "seq"))

  @jax.jit
  def train_step(params, opt_state, key):
    tokens = motif_batch(key, args.batch, args.seq)
    inputs = jax.lax.with_sharding_constraint(tokens[:, :-1], seq_sharded)
    targets = jax.lax.with_sharding_constraint(tokens[:, 1:], seq_sharded)
    loss, grads = jax.value_and_grad(functools.partial(loss_fn, model))(
        params, inputs, targets)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = opt.init(params)
  keys = jax.random.split(jax.random.key(1), 4)  # a few batches, seen in turn
  losses, t0 = [], None
  for i in range(args.train_steps):
    if i == 1:  # the first step compiles
      jax.block_until_ready(params)
      t0 = time.perf_counter()
    params, opt_state, loss = train_step(params, opt_state, keys[i % 4])
    losses.append(float(loss))
  dt = time.perf_counter() - t0 if t0 is not None else float("nan")
  steps = max(args.train_steps - 1, 1)
  return losses[0], losses[-1], args.batch * args.seq * steps / dt


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--implementation", default=None,
                      type=implementation_arg, help="attention backend: None (best available), cuda, pallas or xla (default: None)")
  parser.add_argument("--batch", type=int, default=4,
                      help="global batch, split over the 'data' axis "
                      "(default: 4)")
  parser.add_argument("--seq", type=int, default=256,
                      help="sequence length, split over the 'seq' axis "
                      "(default: 256)")
  parser.add_argument("--strategy", default="ring",
                      choices=["ring", "all_gather"],
                      help="how keys/values reach every sequence shard "
                      "(default: ring)")
  parser.add_argument("--train-steps", type=int, default=30,
                      help="training steps of the sharded model (default: 30)")
  args = parser.parse_args(argv)

  devices = jax.devices()
  n = len(devices)
  data = 2 if n % 2 == 0 and n >= 4 else 1
  mesh = Mesh(np.array(devices).reshape(data, n // data), ("data", "seq"))
  print(f"{n} {devices[0].platform} devices, mesh {dict(mesh.shape)}")

  ring = functools.partial(
      jax_flash.ring_attention, mesh=mesh, seq_axis="seq", batch_axis="data",
      causal=True, implementation=args.implementation,
      strategy=args.strategy)  # zigzag by default
  plain = functools.partial(jax_flash.attention, causal=True,
                            implementation=args.implementation)

  # seq must be a multiple of 2 * (ring size) for the zigzag layout.
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (args.batch, args.seq + 1)),
                       jnp.int32)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  sharded_model, plain_model = Model(ring), Model(plain)
  params = plain_model.init(jax.random.key(0), inputs)

  step = lambda model: jax.jit(jax.value_and_grad(
      functools.partial(loss_fn, model)))
  with jax.default_matmul_precision("highest"):
    # Tokens sharded over the batch ("data") and the sequence ("seq"): every
    # activation stays sequence-sharded; attention is the only layer that
    # needs the other chunks, and it gets them around the ring.
    seq_sharded = NamedSharding(mesh, P("data", "seq"))
    loss_r, grads_r = step(sharded_model)(
        params, jax.device_put(inputs, seq_sharded),
        jax.device_put(targets, seq_sharded))
    loss_p, grads_p = step(plain_model)(params, inputs, targets)
    x = jnp.asarray(rng.standard_normal((args.batch, args.seq, HEADS,
                                         HEAD_DIM)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, args.batch, args.seq, KV_HEADS,
                                          HEAD_DIM)), jnp.float32)
    o_r = jax.jit(ring)(*(jax.device_put(a, seq_sharded)
                          for a in (x, kv[0], kv[1])))
    o_p = plain(x, kv[0], kv[1])

  d_attn = float(jnp.max(jnp.abs(o_r - o_p)))
  d_loss = abs(float(loss_r) - float(loss_p))
  d_grad = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(grads_r), jax.tree.leaves(grads_p)))
  print(f"ring attention output vs unsharded: max |diff| = {d_attn:.2e}")
  print(f"model loss {float(loss_r):.6f} vs {float(loss_p):.6f} "
        f"(|diff| = {d_loss:.2e}); max |grad diff| = {d_grad:.2e}")
  ok = max(d_attn, d_loss, d_grad) < 1e-4
  print("OK" if ok else "MISMATCH")
  if args.train_steps > 1:
    first, last, tps = train(sharded_model, params, mesh, args)
    print(f"training on the {dict(mesh.shape)} mesh: loss {first:.3f} -> "
          f"{last:.3f} in {args.train_steps} steps, {tps:,.0f} tokens/s")
    if not last < first:
      print("FAILED: the loss did not fall")
      ok = False
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
