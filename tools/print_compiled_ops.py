"""Prints the top-level ops of the compiled fwd+bwd step (the benchmark's
gradient of sum(o * do)) for jax_flash and cuDNN: custom calls, fusions,
copies. Shows what XLA adds around the attention kernels.

    python tools/print_compiled_ops.py [--T 8192] [--causal]
"""
import argparse
import pathlib
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import jax_flash  # noqa: E402


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--T", type=int, default=8192)
  p.add_argument("--causal", action="store_true")
  args = p.parse_args()
  B, H, D = 2, 16, 128
  shape = (B, args.T, H, D)
  q = k = v = do = jnp.ones(shape, jnp.bfloat16)
  impls = {
      "jax_flash": lambda q, k, v: jax_flash.attention(
          q, k, v, causal=args.causal, implementation="cuda"),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=args.causal, implementation="cudnn"),
  }
  for name, fn in impls.items():
    def loss(q, k, v, fn=fn):
      return jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    entry = text[text.index("ENTRY"):]
    print(f"=== {name}")
    for line in entry.splitlines()[1:]:
      m = re.match(r"\s*(?:ROOT )?(\S+) = (.+?) ([a-z][\w-]*)\(", line)
      if not m or m.group(3) in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
        continue
      target = re.search(r'custom_call_target="([^"]+)"', line)
      kind = re.search(r"kind=(\w+)", line)
      print(f"  {m.group(3):14s} {m.group(2)[:60]:60s} "
            f"{target.group(1) if target else (kind.group(1) if kind else '')}")


if __name__ == "__main__":
  main()
