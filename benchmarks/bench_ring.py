"""Context parallelism: ring attention sharded over N devices against one
device, forward and forward+backward: time, TF/s per device, peak memory per
device and the scaling efficiency.

    python benchmarks/bench_ring.py                          # T = 64k, 1 and all GPUs
    python benchmarks/bench_ring.py --seqs 131072,262144,1048576 \\
        --devices 1,2,4,8 --masks causal,full --kv-heads 8 --heads 32 \\
        --out benchmarks/results/ring_h200.json --plot benchmarks/results/ring_h200.png
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/bench_ring.py --seqs 2048 --impl xla   # CPU smoke test

Each configuration runs in its own process so that a device's peak memory
(`memory_stats()["peak_bytes_in_use"]`) belongs to that configuration alone;
the compiled program's own estimate (`memory_analysis()`: arguments + outputs
+ temporaries per device) is reported next to it. A configuration that does
not fit (or fails) is reported and skipped. Timing as in bench_attention.py:
warm up, back-to-back calls between two syncs, median of repeats. FLOPs:
fwd = 4*B*H*T*T*D (halved when causal), fwd+bwd = 3.5x.

Efficiency of N devices at one T: (time on 1 device) / (N * time on N), or,
where one device cannot hold T, (2 * time on 2) / (N * time on N). `--trace
DIR` writes a profiler trace of each multi-device run (the ring's transfers
against its kernels).
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

KEY = ("devices", "T", "mode", "causal", "H", "H_kv", "D", "B", "impl", "strategy")


def run_one(a) -> dict:
  """One configuration in this process; returns its record."""
  devices = jax.devices()[: a.devices]
  mesh = jax.sharding.Mesh(np.array(devices), ("seq",))
  causal = a.mask == "causal"
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (a.batch, a.seq, a.heads, a.dim), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (a.batch, a.seq, a.kv_heads, a.dim), jnp.bfloat16)
          for kk in keys[1:3])
  do = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
  if a.devices > 1:
    sharding = jax.sharding.NamedSharding(mesh, jax.P(None, "seq"))
    q, k, v, do = (jax.device_put(x, sharding) for x in (q, k, v, do))

    def attn(q, k, v):
      return jax_flash.ring_attention(q, k, v, mesh=mesh, seq_axis="seq", causal=causal,
                                      implementation=a.impl, strategy=a.strategy)
  else:
    q, k, v, do = (jax.device_put(x, devices[0]) for x in (q, k, v, do))

    def attn(q, k, v):
      return jax_flash.attention(q, k, v, causal=causal, implementation=a.impl)

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
  if a.trace and a.devices > 1:
    path = pathlib.Path(a.trace) / f"{a.mask}_{a.mode}_T{a.seq}_n{a.devices}"
    with jax.profiler.trace(str(path)):
      jax.block_until_ready(compiled(*args))
  flops = 4.0 * a.batch * a.heads * a.seq * a.seq * a.dim * mult * (0.5 if causal else 1.0)
  peaks = []
  for d in devices:
    stats = d.memory_stats() or {}
    peaks.append(stats.get("peak_bytes_in_use"))
  return dict(devices=a.devices, mode=a.mode, impl=a.impl, B=a.batch, T=a.seq, H=a.heads,
              H_kv=a.kv_heads, D=a.dim, causal=causal,
              strategy=a.strategy if a.devices > 1 else None, ms=sec * 1e3,
              tflops_total=flops / sec * 1e-12, tflops_per_device=flops / sec * 1e-12 / a.devices,
              peak_bytes_per_device=peaks, compiled_bytes_per_device=est,
              platform=devices[0].platform, device=devices[0].device_kind, jax=jax.__version__)


def efficiencies(records):
  """Adds `efficiency` (and `baseline_devices`) to each record: its speed-up
  over the smallest device count measured at the same (T, mode, causal),
  divided by the device ratio."""
  groups = {}
  for r in records:
    groups.setdefault((r["T"], r["mode"], r["causal"], r["H"], r["H_kv"]), []).append(r)
  # (one strategy per run: the 1-device baseline has none)
  for rs in groups.values():
    base = min(rs, key=lambda r: r["devices"])
    for r in rs:
      r["baseline_devices"] = base["devices"]
      r["efficiency"] = (base["ms"] * base["devices"]) / (r["ms"] * r["devices"])
  return records


def merge(path: pathlib.Path, records):
  old = json.loads(path.read_text()) if path.exists() else []
  keys = {tuple(r.get(f) for f in KEY) for r in records}
  merged = [r for r in old if tuple(r.get(f) for f in KEY) not in keys] + records
  merged.sort(key=lambda r: tuple(str(r.get(f)) for f in KEY))
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(merged, indent=1) + "\n")


def plot(records, path: pathlib.Path):
  try:
    import matplotlib
  except ImportError:
    print(f"matplotlib is not installed: no plot ({path})")
    return
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for ax, mode in zip(axes, ("fwd", "fwd_bwd")):
    for (T, causal) in sorted({(r["T"], r["causal"]) for r in records if r["mode"] == mode}):
      rs = sorted((r for r in records if r["mode"] == mode and r["T"] == T
                   and r["causal"] == causal), key=lambda r: r["devices"])
      ax.plot([r["devices"] for r in rs], [r["efficiency"] for r in rs], marker="o",
              label=f"T={T // 1024}k {'causal' if causal else 'full'}")
    ax.axhline(0.9, color="gray", lw=0.8, ls="--")
    ax.set_title(mode)
    ax.set_xlabel("devices")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
  axes[0].set_ylabel("scaling efficiency")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seqs", default="65536", help="comma-separated T")
  p.add_argument("--devices", help="comma-separated device counts (default: 1 and all)")
  p.add_argument("--masks", default="causal", help="causal,full")
  p.add_argument("--modes", default="fwd,fwd_bwd")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, help="default: --heads")
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--impl", default=None, help="per-step backend (default: best)")
  p.add_argument("--strategy", default="ring", help="ring or all_gather (ring_attention)")
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
  p.add_argument("--trace", help="write profiler traces of the multi-device runs here")
  p.add_argument("--out", type=pathlib.Path, help="merge the records into this JSON file")
  p.add_argument("--plot", type=pathlib.Path, help="write the scaling plot here")
  # One configuration (internal: the parent runs each in its own process).
  p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
  p.add_argument("--mask", help=argparse.SUPPRESS)
  p.add_argument("--mode", help=argparse.SUPPRESS)
  a = p.parse_args()
  a.kv_heads = a.kv_heads or a.heads
  if a.one:
    a.devices = int(a.devices)
    print("RECORD " + json.dumps(run_one(a)), flush=True)
    return

  n = len(jax.devices())
  counts = sorted({1, n}) if a.devices is None else [int(x) for x in a.devices.split(",")]
  counts = [c for c in counts if c <= n]
  records = []
  for seq in (int(x) for x in a.seqs.split(",")):
    for mask in a.masks.split(","):
      for mode in a.modes.split(","):
        for devices in counts:
          if seq % (2 * devices):
            continue
          cmd = [sys.executable, __file__, "--one", "--devices", str(devices), "--mode", mode,
                 "--mask", mask, "--seq", str(seq), "--batch", str(a.batch),
                 "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--dim", str(a.dim),
                 "--iters", str(a.iters), "--repeats", str(a.repeats)]
          if a.impl:
            cmd += ["--impl", a.impl]
          cmd += ["--strategy", a.strategy]
          if a.trace:
            cmd += ["--trace", a.trace]
          try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
          except subprocess.TimeoutExpired:
            print(f"T={seq} {mask} {mode} devices={devices}: timed out")
            continue
          lines = [l for l in res.stdout.splitlines() if l.startswith("RECORD ")]
          if res.returncode or not lines:
            err = (res.stderr.strip().splitlines() or ["?"])[-1]
            print(f"T={seq} {mask} {mode} devices={devices}: failed: {err[:200]}")
            continue
          records.append(json.loads(lines[-1][len("RECORD "):]))
          r = records[-1]
          print(f"T={seq} {mask} {mode} devices={devices}: {r['ms']:.2f} ms, "
                f"{r['tflops_per_device']:.1f} TF/s/dev", flush=True)
  efficiencies(records)
  if a.out is not None:
    merge(a.out, records)
  if a.plot is not None and records:
    plot(records, a.plot)
  gib = 2.0**30
  print(f"\n{'T':>8} {'mask':6} {'mode':8} {'dev':>3} {'ms':>9} {'TF/s/dev':>9} {'eff':>5} "
        f"{'peak GiB/dev':>13} {'compiled GiB/dev':>16}")
  for r in records:
    peak = max((x for x in r["peak_bytes_per_device"] if x is not None), default=None)
    est = r["compiled_bytes_per_device"]
    print(f"{r['T']:>8} {'causal' if r['causal'] else 'full':6} {r['mode']:8} {r['devices']:>3} "
          f"{r['ms']:9.2f} {r['tflops_per_device']:9.1f} {r['efficiency']:5.2f} "
          f"{peak / gib if peak else float('nan'):13.2f} {est / gib if est else float('nan'):16.2f}")


if __name__ == "__main__":
  main()
