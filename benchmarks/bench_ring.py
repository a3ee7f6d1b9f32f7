"""Context parallelism: one long causal attention on 1 GPU vs ring attention
sharded over N GPUs (time and memory per device), forward and forward+backward.

    python benchmarks/bench_ring.py                 # seq 65536, all GPUs
    python benchmarks/bench_ring.py --seq 8192 --impl xla   # CPU smoke test

Each configuration runs in its own process so that a device's peak memory
(`memory_stats()["peak_bytes_in_use"]`) belongs to that configuration alone;
the compiled program's own estimate (`memory_analysis()`: arguments + outputs
+ temporaries per device) is reported next to it. Timing as in
bench_attention.py: warm up, back-to-back calls between two syncs, median of
repeats. FLOPs: causal fwd = 2*B*H*T*T*D, fwd+bwd = 3.5x.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

try:
  import jax_flash
except ImportError:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import jax_flash

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_attention import time_ms  # noqa: E402  (same timing method)


def run_one(a) -> dict:
  """One configuration in this process; returns its record."""
  devices = jax.devices()[: a.devices]
  mesh = jax.sharding.Mesh(np.array(devices), ("seq",))
  shape_q = (a.batch, a.seq, a.heads, a.dim)
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, shape_q, jnp.bfloat16) for kk in keys)
  if a.devices > 1:
    sharding = jax.sharding.NamedSharding(mesh, jax.P(None, "seq"))
    q, k, v, do = (jax.device_put(x, sharding) for x in (q, k, v, do))

    def attn(q, k, v):
      return jax_flash.ring_attention(q, k, v, mesh=mesh, seq_axis="seq", causal=True,
                                      implementation=a.impl)
  else:
    q, k, v, do = (jax.device_put(x, devices[0]) for x in (q, k, v, do))

    def attn(q, k, v):
      return jax_flash.attention(q, k, v, causal=True, implementation=a.impl)

  if a.mode == "fwd":
    fn = jax.jit(attn)
    args = (q, k, v)
    mult = 1.0
  else:
    def loss(q, k, v, do):
      return jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    args = (q, k, v, do)
    mult = 3.5
  compiled = fn.lower(*args).compile()
  ma = compiled.memory_analysis()
  est = None
  if ma is not None:
    est = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
           - ma.alias_size_in_bytes)
  sec = time_ms(compiled, args, iters=a.iters, repeats=a.repeats, warmup=2) * 1e-3
  flops = 2.0 * a.batch * a.heads * a.seq * a.seq * a.dim * mult
  peaks = []
  for d in devices:
    stats = d.memory_stats() or {}
    peaks.append(stats.get("peak_bytes_in_use"))
  return dict(devices=a.devices, mode=a.mode, impl=a.impl, B=a.batch, T=a.seq, H=a.heads,
              D=a.dim, causal=True, ms=sec * 1e3, tflops_total=flops / sec * 1e-12,
              tflops_per_device=flops / sec * 1e-12 / a.devices,
              peak_bytes_per_device=peaks, compiled_bytes_per_device=est,
              platform=devices[0].platform, jax=jax.__version__)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seq", type=int, default=65536)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--impl", default=None, help="per-step backend (default: best)")
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", type=pathlib.Path,
                 help="write the records to this JSON file (default: write "
                 "nothing; the tracked 2x H200 run is results/ring_2xh200.json)")
  p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--devices", type=int, help=argparse.SUPPRESS)
  p.add_argument("--mode", help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.one:
    print("RECORD " + json.dumps(run_one(a)), flush=True)
    return

  n = len(jax.devices())
  records = []
  for devices in sorted({1, n}):
    for mode in ("fwd", "fwd_bwd"):
      cmd = [sys.executable, __file__, "--one", "--devices", str(devices), "--mode", mode,
             "--seq", str(a.seq), "--batch", str(a.batch), "--heads", str(a.heads),
             "--dim", str(a.dim), "--iters", str(a.iters), "--repeats", str(a.repeats)]
      if a.impl:
        cmd += ["--impl", a.impl]
      res = subprocess.run(cmd, capture_output=True, text=True)
      lines = [l for l in res.stdout.splitlines() if l.startswith("RECORD ")]
      if res.returncode or not lines:
        print(f"devices={devices} {mode}: failed\n{res.stderr[-3000:]}")
        continue
      records.append(json.loads(lines[-1][len("RECORD "):]))
  if a.out is not None:
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(records, indent=1) + "\n")
  gib = 2.0**30
  print(f"\n{'devices':>7} {'mode':8} {'ms':>9} {'TF/s total':>10} {'TF/s/dev':>9} "
        f"{'peak GiB/dev':>13} {'compiled GiB/dev':>16}")
  for r in records:
    peak = max((x for x in r["peak_bytes_per_device"] if x is not None), default=None)
    est = r["compiled_bytes_per_device"]
    print(f"{r['devices']:>7} {r['mode']:8} {r['ms']:9.2f} {r['tflops_total']:10.1f} "
          f"{r['tflops_per_device']:9.1f} {peak / gib if peak else float('nan'):13.2f} "
          f"{est / gib if est else float('nan'):16.2f}")


if __name__ == "__main__":
  main()
