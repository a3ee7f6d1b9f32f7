"""The kernels of examples/generate.py's decode steps (its GPU configuration:
batch 8, a 4000-token prompt, 4 layers, d_model 2048, 16 heads, bf16), for a
per-kernel profile of one serving step, jax_flash's decoder then Flax's:

    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        --print-summary none python3 tools/gpu/decode_step_profile.py

Each decoder prefills, then runs a 3-token decode (2 steps) after a marker
line (compiled and run once before). DECODERS=jax_flash (or flax) profiles one
of them only: Flax's token-by-token prefill is thousands of kernels under ncu.
"""
import importlib.util
import os
import pathlib
import sys

import jax
import jax.numpy as jnp

path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "generate.py"
spec = importlib.util.spec_from_file_location("generate", path)
gen = importlib.util.module_from_spec(spec)
sys.modules["generate"] = gen
spec.loader.exec_module(gen)

args = gen.parse_args(sys.argv[1:] + ["--new", "3"])  # e.g. --small
dtype = jnp.dtype(args.dtype)
ours, stock, _ = gen.build(args, dtype)
total = args.prompt + args.new
init = gen.DecoderLM(args.vocab, args.d_model, args.heads, args.layers, total,
                     stock=True).init
zeros = jnp.zeros((1, total), jnp.int32)
params = jax.jit(lambda k: init(k, zeros, zeros))(jax.random.key(0))["params"]
params = jax.tree.map(lambda x: x.astype(dtype), params)
prompt = jax.random.randint(jax.random.key(1), (args.batch, args.prompt), 0,
                            args.vocab)
wanted = os.environ.get("DECODERS", "jax_flash,flax").split(",")
for name, dec in (("jax_flash", ours), ("flax", stock)):
  if name not in wanted:
    continue
  for marked in (False, True):
    cache = jax.block_until_ready(dec.empty_cache())
    cache, first, _ = jax.block_until_ready(dec.prefill(params, cache, prompt))
    if marked:
      print(f"== {name} decode", flush=True)
    jax.block_until_ready(dec.decode(params, cache, first))
