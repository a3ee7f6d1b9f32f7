"""The kernels of one varlen training step (forward + backward) with the
packed backward (the default) and with the per-sequence backward
(JAX_FLASH_VARLEN_BWD_KERNEL=1), for a per-kernel profile on a GPU:

    ncu --metrics gpu__time_duration.sum,launch__grid_size,\\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\\
smsp__warps_eligible.avg.per_cycle_active --print-summary none \\
        python3 tools/gpu/varlen_bwd_profile.py [packed_8x1k|mixed_40_6k] [--causal]

bench_packing.py's lengths, H = 16 query heads on 4 KV heads, D = 128, bf16.
Each jitted step runs 3 times to warm up, then once more after a marker line
(ncu prints its reports at the end: the kernel names tell the two apart).
"""
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_packing  # noqa: E402

args = [a for a in sys.argv[1:] if not a.startswith("--")]
case = args[0] if args else "packed_8x1k"
causal = "--causal" in sys.argv
lens = bench_packing.case_lengths(case)
total, H, Hk, D = sum(lens), 16, 4, 128
cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
rng = np.random.default_rng(0)
mk = lambda h: jnp.asarray(rng.standard_normal((total, h, D)), jnp.bfloat16)
q, k, v, do = mk(H), mk(Hk), mk(Hk), mk(H)


def step(bwd_kernel: bool):
  os.environ["JAX_FLASH_VARLEN_BWD_KERNEL"] = "1" if bwd_kernel else "0"
  def loss(q, k, v):
    o = jax_flash.varlen_attention(
        q, k, v, cu, cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
        causal=causal, implementation="cuda")
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
  f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  jax.block_until_ready(f(q, k, v))  # traced with the knob as set
  return f


steps = {"packed backward": step(False), "per-sequence backward": step(True)}
for f in steps.values():
  for _ in range(3):
    jax.block_until_ready(f(q, k, v))
for name, f in steps.items():
  print(f"== {case} {'causal' if causal else 'full'} {name}", flush=True)
  jax.block_until_ready(f(q, k, v))
