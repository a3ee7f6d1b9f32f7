"""The kernels of examples/generate.py's decode steps (its GPU configuration:
batch 8, a 4000-token prompt, 4 layers, d_model 2048, 16 heads, bf16), for a
per-kernel profile of one serving step, jax_flash's decoder then Flax's:

    ncu --profile-from-start off --print-summary per-kernel \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        python3 tools/gpu/decode_step_profile.py

Each decoder runs --steps decoding steps (default 2) from a cache that
holds the prompt's length of keys (their values do not change the work, so
neither decoder prefills: Flax's token-by-token prefill would be thousands
of profiled steps), once to compile and warm up, then once more between
cuProfilerStart and cuProfilerStop, so that with `--profile-from-start off`
ncu sees only those steps' kernels, jax_flash's first, then Flax's
(`--decoder jax_flash|flax`, or DECODERS=jax_flash / flax, profiles
one). Without ncu it prints each
decoder's mean time per step over --repeats timed runs.
--hlo DIR writes each decoder's compiled decoding loop (HLO text) there.
Any of examples/generate.py's options applies (e.g. --small).
"""
import argparse
import ctypes
import importlib.util
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "generate.py"
spec = importlib.util.spec_from_file_location("generate", path)
gen = importlib.util.module_from_spec(spec)
sys.modules["generate"] = gen
spec.loader.exec_module(gen)


def profiler(start: bool):
  """cuProfilerStart / cuProfilerStop on device 0's primary context (the
  one XLA runs in); prints why not where the driver refuses."""
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError as e:
    print(f"(no CUDA driver: {e})")
    return
  dev, ctx = ctypes.c_int(), ctypes.c_void_p()
  calls = [("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0)),
           ("cuDevicePrimaryCtxRetain",
            lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
           ("cuCtxPushCurrent", lambda: cuda.cuCtxPushCurrent_v2(ctx)),
           ("cuProfilerStart" if start else "cuProfilerStop",
            cuda.cuProfilerStart if start else cuda.cuProfilerStop),
           ("cuCtxPopCurrent",
            lambda: cuda.cuCtxPopCurrent_v2(ctypes.byref(ctx)))]
  for name, call in calls:
    rc = call()
    if rc:
      print(f"({name} returned CUDA error {rc})")
      return


def main(argv):
  p = argparse.ArgumentParser(add_help=False)
  p.add_argument("--steps", type=int, default=2)
  p.add_argument("--hlo", type=pathlib.Path,
                 help="write each decoder's compiled decode (HLO text) into "
                 "this folder as <decoder>_decode.hlo")
  p.add_argument("--decoder", choices=("jax_flash", "flax", "both"),
                 default=os.environ.get("DECODERS", "both"))
  own, rest = p.parse_known_args(argv)
  args = gen.parse_args(rest + ["--new", str(own.steps + 1)])
  dtype = jnp.dtype(args.dtype)
  ours, stock, _ = gen.build(args, dtype)
  total = args.prompt + args.new
  init = gen.DecoderLM(args.vocab, args.d_model, args.heads, args.layers,
                       total, stock=True).init
  zeros = jnp.zeros((1, total), jnp.int32)
  params = jax.jit(lambda k: init(k, zeros, zeros))(jax.random.key(0))
  params = jax.tree.map(lambda x: x.astype(dtype), params["params"])
  token = jax.random.randint(jax.random.key(1), (args.batch,), 0, args.vocab)

  def full_cache(dec):
    """A cache that holds the prompt: every cache_index at its length."""
    cache = dec.empty_cache()
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (jnp.full_like(x, args.prompt)
                         if "cache_index" in jax.tree_util.keystr(path)
                         else x), cache)

  names = [n for n in ("jax_flash", "flax")
           if own.decoder in ("both", "jax_flash,flax") or n in own.decoder]
  decoders = {"jax_flash": ours, "flax": stock}
  for name in names:
    dec = decoders[name]
    if own.hlo is not None:
      own.hlo.mkdir(parents=True, exist_ok=True)
      text = dec.decode.lower(params, full_cache(dec), token).compile().as_text()
      (own.hlo / f"{name}_decode.hlo").write_text(text)
    jax.block_until_ready(dec.decode(params, full_cache(dec), token))
    times = []
    for _ in range(args.repeats):
      cache = jax.block_until_ready(full_cache(dec))
      t0 = time.perf_counter()
      jax.block_until_ready(dec.decode(params, cache, token))
      times.append(time.perf_counter() - t0)
    cache = jax.block_until_ready(full_cache(dec))
    print(f"== {name}: {own.steps} decode steps, "
          f"{min(times) / own.steps * 1e6:.0f} us per step (best of "
          f"{args.repeats}, unprofiled)", flush=True)
    profiler(True)
    jax.block_until_ready(dec.decode(params, cache, token))
    profiler(False)


if __name__ == "__main__":
  main(sys.argv[1:])
