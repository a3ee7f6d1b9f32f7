"""jax_flash quickstart: causal GQA attention, forward and backward.

Runs on whatever JAX finds (CPU or GPU). Compares `jax_flash.attention` with
`jax.nn.dot_product_attention` (computed in float32 at full precision) for the
default backend choice and for every backend registered here, and exits with
status 1 if an error is larger than the tolerance for the dtype.

    python3 examples/quickstart.py [--dtype float32|bfloat16|float16]
        [--implementation all|None|cuda|pallas|xla]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

import jax_flash

# [batch, seq, heads, head_dim]; 8 query heads share 2 key/value heads (GQA).
B, T, H, H_KV, D = 2, 256, 8, 2, 64


def rel_err(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)),
                                                      1e-30))


def reference(q, k, v, do):
  """Output and (dq, dk, dv) from jax.nn.dot_product_attention in float32."""
  q, k, v, do = (x.astype(jnp.float32) for x in (q, k, v, do))
  with jax.default_matmul_precision("highest"):
    o, vjp = jax.vjp(
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla"), q, k, v)
    return o, vjp(do)


def run(q, k, v, do, implementation):
  def f(q, k, v):
    return jax_flash.attention(q, k, v, causal=True,
                               implementation=implementation)

  @jax.jit
  def fwd_bwd(q, k, v, do):
    o, vjp = jax.vjp(f, q, k, v)
    return o, vjp(do)

  return fwd_bwd(q, k, v, do)


def main(argv=None) -> int:
  backend = jax.default_backend()
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dtype", default=None,
                 choices=["float32", "bfloat16", "float16"],
                 help="input dtype (default: bfloat16 on GPU, float32 "
                 "elsewhere)")
  p.add_argument("--implementation", default="all",
                 choices=["all", "None", "cuda", "pallas", "xla"],
                 help="backend to compare with the reference: all (default: "
                 "None, the best available, then every backend that runs "
                 "here), None, or one backend name")
  args = p.parse_args(argv)
  if args.dtype is not None:
    dtype = jnp.dtype(args.dtype)
  else:
    dtype = jnp.bfloat16 if backend == "gpu" else jnp.float32
  tol = 5e-3 if dtype == jnp.float32 else 2e-2  # relative to max |ref|
  print(f"jax {jax.__version__}, jax_flash {jax_flash.__version__}")
  print(f"default backend: {backend} ({jax.devices()[0].device_kind})")
  info = jax_flash.build_info()
  print("CUDA kernels: " + ("built into this installation"
                            if info["cuda_kernels"] else
                            f"not built ({info['reason']})"))
  print(f"jax_flash implementations that run here: "
        f"{', '.join(jax_flash.available_implementations())}")
  print(f"shapes: q [{B}, {T}, {H}, {D}], k/v [{B}, {T}, {H_KV}, {D}], "
        f"{jnp.dtype(dtype).name}, causal=True")

  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, T, H, D), dtype)
  k = jax.random.normal(keys[1], (B, T, H_KV, D), dtype)
  v = jax.random.normal(keys[2], (B, T, H_KV, D), dtype)
  do = jax.random.normal(keys[3], (B, T, H, D), dtype)
  o_ref, grads_ref = reference(q, k, v, do)

  ok = True
  results = {}
  if args.implementation == "all":
    impls = (None,) + jax_flash.available_implementations()
  else:
    impls = (None if args.implementation == "None" else args.implementation,)
  for impl in impls:
    name = "auto (None)" if impl is None else repr(impl)
    try:
      t0 = time.perf_counter()
      o, grads = jax.block_until_ready(run(q, k, v, do, impl))
      secs = time.perf_counter() - t0
    except jax_flash.Unsupported as e:
      first = str(e).splitlines()[0]
      print(f"  implementation={name:12s} not available here: {first}")
      continue
    results[impl] = (o, grads)
    errs = [rel_err(o, o_ref)] + [rel_err(g, r) for g, r in
                                  zip(grads, grads_ref)]
    worst = max(errs)
    status = "ok" if worst <= tol else "FAIL"
    ok &= worst <= tol
    print(f"  implementation={name:12s} max rel error: out {errs[0]:.2e}, "
          f"dq {errs[1]:.2e}, dk {errs[2]:.2e}, dv {errs[3]:.2e} "
          f"(tol {tol:.0e}) {status}  [{secs:.2f}s incl. compile]")

  # implementation=None takes the first backend that can serve the request:
  # cuda -> pallas -> xla on GPU, xla elsewhere. Name it by its bits.
  same = [repr(i) for i in results if i is not None and None in results and
          all(bool(jnp.array_equal(a, b)) for a, b in zip(
              jax.tree.leaves(results[i]), jax.tree.leaves(results[None])))]
  if same:
    print(f"implementation=None ran: {' / '.join(same)} (bitwise identical)")
  print("OK" if ok else "FAILED: error above tolerance")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
