"""Lowered programs of the feature calls, one hash per call.

tools/check_lowering.py covers `attention` and its transformations; this
covers what is built around it: `fp8_attention` (arrays, Fp8Tensors, mixed,
segment ids, gradients, vmap), `attention_with_kvcache` (contiguous, paged,
FP8 cache, appends, gradients, vmap) and the sharded calls over 8 host
devices (custom_partitioning on an Auto mesh: its Shardy rules; shard_map on
explicit axes). Each program is hashed with locations, metadata and the
callbacks' addresses removed; two source trees that print the same lines
lower every case to the same program:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        PYTHONPATH=<tree> python tools/check_lowering_features.py [--cuda]

`--cuda` lowers for the "cuda" platform with the kernels' checks seeing a
GPU (needs the built extension's `_jax_flash_cuda*.so` and `_build.json` in
the tree's jax_flash/, not a GPU), so the FP8 and decoding kernels' custom
calls, their attributes and the partitioned calls' rules are compared. It
uses `Traced.lower(lowering_platforms=...)`, not jax.export, which cannot
serialise custom_partitioning's callbacks. `--dump DIR` also writes each
normalised program, for diffing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

import jax
import jax.numpy as jnp

_LOC = re.compile(r"\s*loc\(.*?\)(?=[\s,)\]}]|$)|#loc\d*|^#loc.*$",
                  re.MULTILINE)
_NAMES = re.compile(r'(mhlo\.frontend_attributes|metadata|jax\.result_info|'
                    r'mhlo\.sharding_info)\s*=\s*"[^"]*"')


# custom_partitioning's backend_config is the address of its Python callbacks.
_CALLBACK = re.compile(r'(@CustomSPMDPartitioning\(.*?backend_config = )"\d+"')


def normalise(text: str) -> str:
  text = _CALLBACK.sub(r'\1"callbacks"', text)
  text = _LOC.sub("", text)
  text = _NAMES.sub("", text)
  return "\n".join(line.rstrip() for line in text.splitlines()
                   if line.strip())


def _arrays(*shapes, dtype=jnp.bfloat16):
  return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


def grad(f, argnums=(0, 1, 2)):
  """The gradient of the sum of f's (first) output."""
  def loss(*args):
    o = f(*args)
    o = o[0] if isinstance(o, tuple) else o
    return jnp.sum(o.astype(jnp.float32))
  return jax.grad(loss, argnums=argnums)


def cases(jf, cuda: bool):
  """{name: (fn, args)}: the calls to lower."""
  B, T, S, H, Hk = 2, 128, 128, 4, 2
  seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
  lens = jax.ShapeDtypeStruct((B,), jnp.int32)
  impl = None if cuda else "xla"
  out = {}
  # FP8: arrays, Fp8Tensors (quantised inside the program), gradients.
  fimpl = "cuda" if cuda else "xla"
  fq, fk, fv = _arrays((B, T, H, 128), (B, S, Hk, 128), (B, S, Hk, 128))
  fp8 = lambda q, k, v, **kw: jf.fp8_attention(
      q, k, v, implementation=fimpl, **kw)
  out["fp8_arrays"] = (lambda q, k, v: fp8(q, k, v, causal=True,
                                           return_lse=True), (fq, fk, fv))
  out["fp8_segments"] = (lambda q, k, v, s: fp8(q, k, v, segment_ids=s),
                         (fq, fk, fv, seg))
  out["fp8_tensors"] = (lambda q, k, v: fp8(*(
      jf.quantize_fp8(x, kind=n) for x, n in zip(
          (q, k, v), ("query", "key", "value"))), causal=True), (fq, fk, fv))
  out["fp8_mixed"] = (lambda q, k, v: fp8(q, jf.quantize_fp8(k, kind="key"),
                                          jf.quantize_fp8(v, kind="value")),
                      (fq, fk, fv))
  out["fp8_grad"] = (grad(lambda q, k, v: fp8(q, k, v, causal=True)),
                     (fq, fk, fv))
  out["fp8_vmap"] = (jax.vmap(lambda q, k, v: fp8(q, k, v)), _arrays(
      (3, B, T, H, 128), (3, B, S, Hk, 128), (3, B, S, Hk, 128)))

  # KV cache: contiguous, paged, FP8; with appends; a gradient.
  kimpl = None if cuda else "xla"
  dq = jax.ShapeDtypeStruct((B, 1, H, 128), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((B, 256, Hk, 128), jnp.bfloat16)
  pages = jax.ShapeDtypeStruct((16, 64, Hk, 128), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((B, 4), jnp.int32)
  new = jax.ShapeDtypeStruct((B, 1, Hk, 128), jnp.bfloat16)
  kv = lambda *a, **kw: jf.attention_with_kvcache(*a, implementation=kimpl,
                                                  **kw)
  out["kvcache_contiguous"] = (lambda q, kc, vc, n, kn, vn: kv(
      q, kc, vc, n, k_new=kn, v_new=vn, return_lse=True),
                               (dq, cache, cache, lens, new, new))
  out["kvcache_paged"] = (lambda q, kc, vc, n, t: kv(
      q, kc, vc, n, page_table=t, window=(64, 0)),
                          (dq, pages, pages, lens, table))
  out["kvcache_fp8"] = (lambda q, kc, vc, n, t: kv(
      q, jf.quantize_kv_cache(kc, rotate=True, seed=3),
      jf.quantize_kv_cache(vc, rotate=True, seed=3), n, page_table=t),
                        (dq, pages, pages, lens, table))
  out["kvcache_grad"] = (grad(lambda q, kc, vc, n: kv(q, kc, vc, n)),
                         (dq, cache, cache, lens))
  out["kvcache_fp8_grad"] = (grad(lambda q, kc, vc, n, t: kv(
      q, jf.quantize_kv_cache(kc), jf.quantize_kv_cache(vc), n,
      page_table=t), argnums=0), (dq, pages, pages, lens, table))
  out["kvcache_vmap"] = (jax.vmap(lambda q, kc, vc, n: kv(q, kc, vc, n),
                                  in_axes=(0, None, None, 0)),
                         (jax.ShapeDtypeStruct((3,) + dq.shape, dq.dtype),
                          cache, cache,
                          jax.ShapeDtypeStruct((3, B), jnp.int32)))
  out.update(sharded_cases(jf, impl, fimpl, kimpl))
  return out


def sharded_cases(jf, impl, fimpl, kimpl):
  """Calls on arrays sharded over batch/heads (8 host devices), on an Auto
  mesh (custom_partitioning) and on explicit axes (shard_map)."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  if len(jax.devices()) < 8:
    return {}
  B, T, H, Hk, D = 4, 128, 8, 4, 128
  out = {}
  for kind in ("auto", "explicit"):
    start = len(out)
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("b", "h"), axis_types=(axis_type,) * 2)
    sh = NamedSharding(mesh, P("b", None, "h", None))
    ssh = NamedSharding(mesh, P("b", None))
    rsh = NamedSharding(mesh, P("b"))
    arr = lambda s, dt=jnp.bfloat16, shd=sh: jax.ShapeDtypeStruct(
        s, dt, sharding=shd)
    q, k = arr((B, T, H, D)), arr((B, T, Hk, D))
    seg = arr((B, T), jnp.int32, ssh)
    attn = lambda q, k, v, s: jf.attention(q, k, v, segment_ids=s,
                                           causal=True, implementation=impl)
    out[f"sharded_{kind}_attention"] = (attn, (q, k, k, seg))
    out[f"sharded_{kind}_attention_grad"] = (grad(attn), (q, k, k, seg))
    fp8 = lambda q, k, v, s: jf.fp8_attention(
        q, k, v, segment_ids=s, causal=True, return_lse=True,
        implementation=fimpl)
    out[f"sharded_{kind}_fp8"] = (fp8, (q, k, k, seg))
    out[f"sharded_{kind}_fp8_tensors"] = (lambda q, k, v: jf.fp8_attention(
        jf.quantize_fp8(q, kind="query"), jf.quantize_fp8(k, kind="key"),
        jf.quantize_fp8(v, kind="value"), implementation=fimpl), (q, k, k))
    if kind == "auto":
      dq = arr((B, 1, H, D))
      lens = arr((B,), jnp.int32, rsh)
      kv = lambda q, kc, vc, n: jf.attention_with_kvcache(
          q, kc, vc, n, implementation=kimpl)
      out["sharded_auto_kvcache"] = (kv, (dq, k, k, lens))
      pages = arr((16, 64, Hk, D), jnp.bfloat16,
                  NamedSharding(mesh, P(None, None, "h", None)))
      table = arr((B, 2), jnp.int32, ssh)
      out["sharded_auto_kvcache_paged_fp8"] = (
          lambda q, kc, vc, n, t: jf.attention_with_kvcache(
              q, jf.quantize_kv_cache(kc), jf.quantize_kv_cache(vc), n,
              page_table=t, implementation=kimpl), (dq, pages, pages, lens,
                                                    table))
    if kind == "explicit":  # lowered under the mesh: jax.set_mesh
      for name in list(out)[start:]:
        out[name] += (mesh,)
  return out


def lower(fn, args, cuda: bool, mesh=None) -> str:
  if mesh is not None:
    with jax.set_mesh(mesh):
      return lower(fn, args, cuda)
  platforms = ("cuda",) if cuda else None
  return jax.jit(fn).trace(*args).lower(
      lowering_platforms=platforms).as_text()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cuda", action="store_true")
  parser.add_argument("--dump", default=None)
  parser.add_argument("--only", default=None, help="regex of case names")
  a = parser.parse_args()
  import jax_flash as jf
  if a.cuda:  # stage the GPU branch from this host: the kernels' checks see
    import importlib  # a GPU platform (the registry module of either layout)
    try:
      registry = importlib.import_module("jax_flash._src.backends.registry")
    except ImportError:
      registry = importlib.import_module("jax_flash._src.backends")
    registry.default_platform = lambda: "gpu"
  print(f"# jax_flash from {os.path.dirname(jf.__file__)}", file=sys.stderr)
  for name, (fn, args, *mesh) in cases(jf, a.cuda).items():
    if a.only and not re.search(a.only, name):
      continue
    try:
      text = normalise(lower(fn, args, a.cuda, *mesh))
    except Exception as e:  # noqa: BLE001 (an error is a result too)
      text = f"error {type(e).__name__}: {e}"
    if a.dump:
      os.makedirs(a.dump, exist_ok=True)
      with open(os.path.join(a.dump, name + ".mlir"), "w") as f:
        f.write(text + "\n")
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    print(f"{name:40s} {digest}  {text[:70] if text.startswith('error') else ''}",
          flush=True)


if __name__ == "__main__":
  main()
