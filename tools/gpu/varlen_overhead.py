"""Which kernels one `varlen_attention` call runs beside the same packing
given as segment ids (bench_packing.py's mixed_40 lengths), for a per-kernel
profile on a GPU:

    ncu --metrics gpu__time_duration.sum --print-summary none \\
        python3 tools/gpu/varlen_overhead.py

Each jitted call runs 3 times to warm up, then once more after a marker line.
"""
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_packing  # noqa: E402

lens = bench_packing.mixed_lengths()
total, H, D = sum(lens), 16, 128
cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
seg = jnp.asarray(np.repeat(np.arange(len(lens)), lens)[None], jnp.int32)
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((total, H, D)), jnp.bfloat16)
           for _ in range(3))
varlen = jax.jit(lambda q, k, v, cu: jax_flash.varlen_attention(
    q, k, v, cu, cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
    causal=True, implementation="cuda"))
segments = jax.jit(lambda q, k, v, s: jax_flash.attention(
    q[None], k[None], v[None], causal=True, segment_ids=s,
    implementation="cuda")[0])
for _ in range(3):
  varlen(q, k, v, cu).block_until_ready()
  segments(q, k, v, seg).block_until_ready()
print("== varlen", flush=True)
varlen(q, k, v, cu).block_until_ready()
print("== segment ids", flush=True)
segments(q, k, v, seg).block_until_ready()
