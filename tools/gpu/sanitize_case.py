"""A small forward + backward through the CUDA kernels, for compute-sanitizer.

Odd sizes, GQA, causal and segment ids, so the masked and predicated paths run.
Exits non-zero if the result is not finite.
"""

import numpy as np

import jax
import jax.numpy as jnp

import jax_flash


def main():
  rng = np.random.default_rng(7)
  B, T, S, H, Hk = 1, 77, 131, 4, 2
  for D in (64, 128):
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, S, Hk, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, S, Hk, D)), jnp.bfloat16)
    seg = (jnp.asarray(rng.integers(0, 2, (B, T)), jnp.int32),
           jnp.asarray(rng.integers(0, 2, (B, S)), jnp.int32))
    for kw in (dict(causal=True), dict(window=(17, 5), segment_ids=seg,
                                       softcap=20.0)):
      f = lambda q, k, v: jnp.sum(
          jax_flash.attention(q, k, v, implementation="cuda", **kw).astype(
              jnp.float32))
      val, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)
      ok = bool(jnp.isfinite(val)) and all(
          bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads)
      print(f"D={D} {sorted(kw)} finite={ok}")
      if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
  main()
