"""The kernels of one causal training step (forward + backward) of jax_flash
beside FlashAttention-3's (flash-attn3-jax), for a per-kernel profile:

    ncu --metrics gpu__time_duration.sum,sm__inst_executed.sum,\\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\\
smsp__warps_eligible.avg.per_cycle_active --print-summary none \\
        python3 tools/gpu/bwd_profile.py [T] [--full]

B * T = 16k tokens, 16 heads, D = 128, bf16, causal unless --full. Each
jitted step runs 3 times to warm up, then once more after a marker line.
"""
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import peers  # noqa: E402

args = [a for a in sys.argv[1:] if not a.startswith("--")]
T = int(args[0]) if args else 2048
causal = "--full" not in sys.argv
B, H, D = 16384 // T, 16, 128
rng = np.random.default_rng(0)
q, k, v, do = (jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
               for _ in range(4))


def step(attn):
  def loss(q, k, v):
    return jnp.vdot(attn(q, k, v).astype(jnp.float32), do.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


steps = {
    "jax_flash": step(lambda q, k, v: jax_flash.attention(
        q, k, v, causal=causal, implementation="cuda")),
    "fa3": step(lambda q, k, v: peers.fa3(q, k, v, causal)),
}
for _ in range(3):
  for f in steps.values():
    jax.block_until_ready(f(q, k, v))
for name, f in steps.items():
  print(f"== {name} T={T} causal={causal}", flush=True)
  jax.block_until_ready(f(q, k, v))
