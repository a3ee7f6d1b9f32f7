"""Where the time of one jitted forward goes, for jax_flash's CUDA kernel and
cuDNN (jax.nn.dot_product_attention), at the reference shape.

Prints the wall time per call of `--iters` back-to-back calls, alternating
the two implementations round by round, and the XLA HLO of each step (so
copies or transposes that XLA adds around the custom call show up). Run it
under `nsys profile --stats=true` to get each kernel's own duration: if the
kernel time equals the wall time per call, nothing but the kernel runs.

  python tools/profile_fwd_jax.py [--iters 50] [--rounds 6] [--causal]
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jax_flash


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--iters", type=int, default=50)
  ap.add_argument("--rounds", type=int, default=6)
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--hlo", action="store_true")
  args = ap.parse_args()
  B, T, H, D = 2, 8192, 16, 128
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (B, T, H, D), jnp.bfloat16) for key in (kq, kk, kv))
  steps = {
      "jax_flash_cuda": jax.jit(lambda q, k, v: jax_flash.attention(
          q, k, v, causal=args.causal, implementation="cuda")),
      "cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=args.causal, implementation="cudnn")),
  }
  flops = 4 * B * H * T * T * D * (0.5 if args.causal else 1.0)
  for name, step in steps.items():
    if args.hlo:
      print(f"---- {name} optimized HLO ----")
      print(step.lower(q, k, v).compile().as_text())
    for _ in range(3):
      jax.block_until_ready(step(q, k, v))
  samples = {name: [] for name in steps}
  order = list(steps)
  for r in range(args.rounds):
    for name in (order if r % 2 == 0 else order[::-1]):
      jax.block_until_ready((q, k, v))
      t0 = time.perf_counter()
      for _ in range(args.iters):
        out = steps[name](q, k, v)
      jax.block_until_ready(out)
      samples[name].append((time.perf_counter() - t0) / args.iters)
  for name, s in samples.items():
    ms = statistics.median(s) * 1e3
    print(f"{name:16s} {ms:.4f} ms/call  {flops / ms / 1e9:.1f} TF/s  "
          f"(rounds {', '.join(f'{x * 1e3:.3f}' for x in s)})")


if __name__ == "__main__":
  main()
