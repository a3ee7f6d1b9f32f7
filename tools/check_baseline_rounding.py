"""Does the same-dtype XLA baseline of the test suite really round dS?

tests/reference.py's dense_attention_jax rounds the cotangent of the scores
(dS) to the input dtype before the dQ / dK matmuls, as a bf16 autograd
program and every FlashAttention kernel do. It did so with
`g.astype(bf16).astype(f32)`; XLA:GPU may drop such a convert pair
(`xla_allow_excess_precision`, on by default), which leaves dS in float32 and
makes the GPU baseline more accurate than the one it is meant to be (and the
2x-baseline bound of the suite tighter than on the CPU). This prints, for the
suite case `window_both_long` (B=2, T=S=300, H=2, Hk=1, D=128, window (40, 70),
a dLSE cotangent), max |dq_baseline - dq_float64| with the rounding written
three ways: the plain convert pair, the pair around an optimization barrier,
and lax.reduce_precision (bf16: the same rounding). Equal rows = the rounding
happens.

    python tools/check_baseline_rounding.py [seeds]
"""
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import reference  # noqa: E402

B, T, H, Hk, D = 2, 300, 2, 1, 128
WINDOW = (40, 70)


def rounding(kind):
  def round_cotangent(x, dtype):
    @jax.custom_vjp
    def ident(x):
      return x

    def bwd(_, g):
      if kind == "convert pair":
        r = g.astype(dtype).astype(g.dtype)
      elif kind == "barrier":
        r = jax.lax.optimization_barrier(g.astype(dtype)).astype(g.dtype)
      else:
        r = jax.lax.reduce_precision(g, exponent_bits=8, mantissa_bits=7)
      return (r,)

    ident.defvjp(lambda x: (x, None), bwd)
    return ident(x)
  return round_cotangent


def main():
  seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
  print(f"backend {jax.default_backend()}, jax {jax.__version__}")
  for seed in range(seeds):
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, k, v, do = mk(B, T, H, D), mk(B, T, Hk, D), mk(B, T, Hk, D), mk(B, T, H, D)
    dlse = jnp.asarray(rng.standard_normal((B, H, T)), jnp.float32)
    dq64 = reference.attention_vjp(*(np.asarray(x.astype(jnp.float32)) for x in (q, k, v, do)),
                                   dlse=np.asarray(dlse), window=WINDOW)[0]
    row = []
    for kind in ("convert pair", "barrier", "reduce_precision"):
      reference._round_cotangent = rounding(kind)
      f = jax.jit(lambda q, k, v: reference.dense_attention_jax(q, k, v, window=WINDOW))
      (o, lse), vjp = jax.vjp(f, q, k, v)
      dq = vjp((do, dlse))[0]
      row.append(np.abs(np.asarray(dq.astype(jnp.float32), np.float64) - dq64).max())
    print(f"seed {seed}: max |dq - ref64|  " +
          "  ".join(f"{k} {e:.3e}" for k, e in zip(("convert pair", "barrier", "reduce_precision"), row)))


if __name__ == "__main__":
  main()
