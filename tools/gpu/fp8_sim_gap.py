"""The FP8 kernel against its simulation as the key sequence grows.

Prints, per S, the RMS difference (relative to the output's RMS) of the sm90
FP8 forward from the xla simulation on the same quantised inputs, and each
one's RMS error against float64 attention of the dequantised inputs. If the
kernel-vs-simulation gap grows with S while the simulation's own error does
not, the kernel loses precision accumulating O over the keys (FP8 tensor-core
accumulation), not in P's rounding.

  python3 tools/gpu/fp8_sim_gap.py [--seqs 256,1024,4096,16384] [--d 128]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._src.fp8 import cuda, quantize, reference, scheme
from jax_flash._src.core.spec import AttentionSpec


def _rms(x):
  return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def _dequantised(q8, qd, k8, kd, v8, vd, scale, T, S):
  """float64 attention of the dequantised inputs ([B, T, H, D]), in chunks."""
  f = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  q = f(q8) * np.repeat(f(qd), scheme.Q_BLOCK, axis=2)[:, :, :T].transpose(0, 2, 1)[..., None]
  kb = scheme.k_block(k8.shape[-1])
  k = f(k8) * np.repeat(f(kd), kb, axis=2)[:, :, :S].transpose(0, 2, 1)[..., None]
  v = f(v8) * f(vd)[:, None]
  s = np.einsum("bthd,bshd->bhts", q, k) * scale
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seqs", default="256,1024,4096,16384")
  ap.add_argument("--d", type=int, default=128)
  ap.add_argument("--t", type=int, default=256, help="query rows")
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  D, T, H = args.d, args.t, 2
  print(f"{'S':>7} {'kernel-sim':>11} {'kernel-f64':>11} {'sim-f64':>11}")
  for S in (int(s) for s in args.seqs.split(",")):
    mk = lambda n: jnp.asarray(rng.standard_normal((1, n, H, D)), jnp.bfloat16)
    q, k, v = mk(T), mk(S), mk(S)
    spec = AttentionSpec(scale=1 / np.sqrt(D), batch=1, q_len=T, kv_len=S,
                         num_heads=H, num_kv_heads=H, head_dim=D, dtype="bfloat16")
    q8, qd, k8, kd, v8, vd = quantize.quantize_qkv(q, k, v, seed=0)
    o_k, _ = jax.jit(lambda *a: cuda.forward(spec, *a, None, None, jnp.bfloat16))(
        q8, qd, k8, kd, v8, vd)
    o_s, _ = jax.jit(lambda *a: reference.forward(spec, *a, None, None, jnp.float32))(
        q8, qd, k8, kd, v8, vd)
    exact = _dequantised(q8, qd, k8, kd, v8, vd, spec.scale, T, S)
    o_k = np.asarray(o_k.astype(jnp.float32), np.float64)
    o_s = np.asarray(o_s, np.float64)
    r = _rms(exact)
    print(f"{S:7d} {_rms(o_k - o_s) / r:11.3e} {_rms(o_k - exact) / r:11.3e} "
          f"{_rms(o_s - exact) / r:11.3e}")


if __name__ == "__main__":
  main()
