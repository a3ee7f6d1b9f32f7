"""Print a hash of the lowered program of a fixed set of representative calls.

Run it on two source trees and compare the outputs: equal hashes mean the
same StableHLO (locations, metadata and the callbacks' addresses removed),
i.e. the same computation.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      PYTHONPATH=<tree> python tools/check_lowering.py [--cuda] [--dump DIR] \
      [--only REGEX]

Two groups of cases, printed as group/name: "attention" (`attention` and its
transformations, and one call of each entry point) and "features" (what is
built around it: `fp8_attention`, `attention_with_kvcache` and the sharded
calls over 8 host devices, custom_partitioning on an Auto mesh with its
Shardy rules, shard_map on explicit axes).

--cuda lowers for the "cuda" platform (needs the built extension's
`_jax_flash_cuda*.so` and `_build.json` in the tree's jax_flash/, not a GPU),
so the CUDA kernels' custom calls, their attributes and the partitioned
calls' rules are compared too. The attention group goes through jax.export;
the features group through `Traced.lower(lowering_platforms=...)`, since
jax.export cannot serialise custom_partitioning's callbacks, with the
kernels' checks seeing a GPU platform. --dump DIR writes each normalised
program to DIR/<group>/<name>.mlir for a diff. --only REGEX keeps the cases
whose group/name it matches (e.g. ^features/). Compare runs with the same
--only: jax numbers the private functions of a program per process, so a
case's hash can depend on which cases lowered before it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flash

B, T, S, H, HK, D = 2, 128, 128, 4, 2, 64


def _sds(shape, dtype=jnp.bfloat16, sharding=None):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _qkv(dtype=jnp.bfloat16, t=T, s=S, h=H, hk=HK, d=D, sharding=None):
  return (_sds((B, t, h, d), dtype, sharding),
          _sds((B, s, hk, d), dtype, sharding),
          _sds((B, s, hk, d), dtype, sharding))


def _loss(fn):
  def loss(q, k, v, *rest):
    out = fn(q, k, v, *rest)
    o = out[0] if isinstance(out, tuple) else out
    total = jnp.sum(o.astype(jnp.float32) ** 2)
    if isinstance(out, tuple):
      total = total + jnp.sum(jnp.where(jnp.isinf(out[1]), 0.0, out[1]))
    return total
  return loss


def _grad(fn, argnums=(0, 1, 2)):
  return jax.grad(_loss(fn), argnums=argnums)


def attention_cases(cuda: bool):
  """`attention` and its transformations, dropout, varlen, FP8, the KV cache,
  dot_product_attention, sharded and ring calls: {name: (fn, args[, mesh to
  lower under])}."""
  a = jax_flash.attention
  ids = _sds((B, T), jnp.int32)
  lens = _sds((B,), jnp.int32)
  key = jax.random.key(0)
  c = {}
  plain = dict(
      causal=dict(causal=True),
      window=dict(window=(32, 8)),
      softcap=dict(softcap=20.0, causal=True),
      lse=dict(return_lse=True),
      deterministic=dict(causal=True, deterministic=True),
  )
  for name, kw in plain.items():
    f = lambda q, k, v, kw=kw: a(q, k, v, **kw)
    c[f"fwd_{name}"] = (f, _qkv())
    c[f"grad_{name}"] = (_grad(f), _qkv())
  seg = lambda q, k, v, i: a(q, k, v, segment_ids=i, causal=True)
  c["fwd_segments"] = (seg, _qkv() + (ids,))
  c["grad_segments"] = (_grad(seg), _qkv() + (ids,))
  kvl = lambda q, k, v, n: a(q, k, v, kv_seq_lengths=n, causal=True,
                             return_lse=True)
  c["fwd_kv_seq_lengths"] = (kvl, _qkv(t=16) + (lens,))
  c["grad_kv_seq_lengths"] = (_grad(kvl), _qkv(t=16) + (lens,))
  mha = lambda q, k, v: a(q, k, v, causal=True)
  c["grad_mha"] = (_grad(mha), _qkv(hk=H))
  c["jvp"] = (lambda q, k, v: jax.jvp(lambda *x: a(*x, causal=True,
                                                    return_lse=True),
                                       (q, k, v), (q, k, v)), _qkv())
  c["vmap_grad"] = (jax.vmap(_grad(mha)), tuple(
      _sds((3,) + x.shape, x.dtype) for x in _qkv()))
  c["hessian_vp"] = (lambda q, k, v: jax.jvp(
      lambda q: _grad(lambda q, k, v: a(q, k, v, causal=True),
                      argnums=0)(q, k, v), (q,), (q,)),
      _qkv(jnp.float32, t=32, s=32, d=32))
  for impl in ("xla", "pallas"):
    for bc in (False, True):
      f = (lambda q, k, v, impl=impl, bc=bc: a(
          q, k, v, causal=True, dropout_rate=0.1, dropout_rng=key,
          dropout_broadcast=bc, implementation=impl, return_lse=True))
      n = f"dropout_{impl}{'_broadcast' if bc else ''}"
      small = _qkv(jnp.float32, t=64, s=64, d=32)
      c[f"fwd_{n}"] = (f, small)
      c[f"grad_{n}"] = (_grad(f), small)
  c["grad_dropout_auto"] = (_grad(lambda q, k, v: a(
      q, k, v, causal=True, dropout_rate=0.1, dropout_rng=key)),
      _qkv(jnp.float32, t=64, s=64, d=32))
  c["dropout_cuda_refused"] = (lambda q, k, v: a(
      q, k, v, dropout_rate=0.1, dropout_rng=key, implementation="cuda"),
      _qkv())
  c["vmap_dropout"] = (jax.vmap(lambda q, k, v, r: a(
      q, k, v, dropout_rate=0.2, dropout_rng=r)), tuple(
          _sds((3,) + x.shape, x.dtype) for x in _qkv(jnp.float32, t=64, s=64,
                                                      d=32)) +
      (jax.ShapeDtypeStruct((3,), jax.random.key(0).dtype),))
  for impl in ("xla", "pallas"):
    f = lambda q, k, v, impl=impl: a(q, k, v, causal=True, window=(16, 0),
                                     implementation=impl)
    c[f"grad_{impl}"] = (_grad(f), _qkv(jnp.float32, t=64, s=64, d=32))

  cu = _sds((3,), jnp.int32)
  vl = lambda q, k, v, cq, ck: jax_flash.varlen_attention(
      q, k, v, cq, ck, max_seqlen_q=64, max_seqlen_k=64, causal=True,
      window=(32, 0))
  vshape = (_sds((T, H, D)), _sds((S, HK, D)), _sds((S, HK, D)), cu, cu)
  c["fwd_varlen"] = (vl, vshape)
  c["grad_varlen"] = (_grad(vl), vshape)

  c["fwd_fp8_arrays"] = (lambda q, k, v: jax_flash.fp8_attention(
      q, k, v, causal=True, return_lse=True), _qkv())
  c["grad_fp8_arrays"] = (_grad(lambda q, k, v: jax_flash.fp8_attention(
      q, k, v, causal=True)), _qkv())

  def fp8_tensors(q, k, v):
    q8, k8, v8 = (jax_flash.quantize_fp8(x, kind=n) for x, n in
                  ((q, "query"), (k, "key"), (v, "value")))
    return jax_flash.fp8_attention(q8, k8, v8, causal=True)
  c["fwd_fp8_tensors"] = (fp8_tensors, _qkv())

  cache = (_sds((B, 256, HK, D)), _sds((B, 256, HK, D)))
  kc = lambda q, kc, vc, n, kn, vn: jax_flash.attention_with_kvcache(
      q, kc, vc, n, k_new=kn, v_new=vn, return_lse=True)
  c["kvcache_contiguous"] = (kc, (_sds((B, 1, H, D)),) + cache + (
      lens, _sds((B, 1, HK, D)), _sds((B, 1, HK, D))))
  c["grad_kvcache_contiguous"] = (_grad(lambda q, kc, vc, n: (
      jax_flash.attention_with_kvcache(q, kc, vc, n, return_lse=True)[:2])),
      (_sds((B, 4, H, D)),) + cache + (lens,))
  pages = (_sds((16, 32, HK, D)), _sds((16, 32, HK, D)))
  c["kvcache_paged"] = (lambda q, kc, vc, n, pt: jax_flash.attention_with_kvcache(
      q, kc, vc, n, page_table=pt), (_sds((B, 1, H, D)),) + pages + (
          lens, _sds((B, 8), jnp.int32)))

  def fp8_cache(q, kc, vc, n):
    k8, v8 = jax_flash.quantize_kv_cache(kc), jax_flash.quantize_kv_cache(vc)
    return jax_flash.attention_with_kvcache(q, k8, v8, n)
  c["kvcache_fp8"] = (fp8_cache, (_sds((B, 1, H, D)),) + cache + (lens,))

  dpa = lambda q, k, v: jax_flash.dot_product_attention(q, k, v,
                                                        is_causal=True)
  c["fwd_dot_product_attention"] = (dpa, _qkv(hk=H))
  c["grad_dot_product_attention"] = (_grad(dpa), _qkv(hk=H))
  c["dot_product_attention_lengths"] = (lambda q, k, v, n: (
      jax_flash.dot_product_attention(q, k, v, key_value_seq_lengths=n)),
      _qkv(hk=H) + (lens,))

  if len(jax.devices()) >= 8 and not cuda:
    mesh = jax.make_mesh((2, 2), ("b", "h"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    sh = NamedSharding(mesh, P("b", None, "h", None))
    f = lambda q, k, v: a(q, k, v, causal=True, implementation="pallas")
    c["sharded_pallas_grad"] = (_grad(f), _qkv(jnp.float32, t=64, s=64, d=32,
                                               sharding=sh))
    c["sharded_xla_grad"] = (_grad(mha), _qkv(jnp.float32, t=64, s=64, d=32,
                                              sharding=sh))
    xmesh = jax.make_mesh((2, 2), ("b", "h"),
                          axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                          devices=jax.devices()[4:8])
    xsh = NamedSharding(xmesh, P("b", None, "h", None))
    c["explicit_pallas_grad"] = (_grad(f), _qkv(jnp.float32, t=64, s=64, d=32,
                                                sharding=xsh), xmesh)
    c["explicit_xla_grad"] = (_grad(mha), _qkv(jnp.float32, t=64, s=64, d=32,
                                               sharding=xsh), xmesh)
    c["explicit_dropout_refused"] = (lambda q, k, v: a(
        q, k, v, dropout_rate=0.1, dropout_rng=key), _qkv(
            jnp.float32, t=64, s=64, d=32, sharding=xsh), xmesh)
    ring_mesh = jax.make_mesh((4,), ("s",), devices=jax.devices()[:4])
    for layout in ("zigzag", "contiguous"):
      r = (lambda q, k, v, layout=layout: jax_flash.ring_attention(
          q, k, v, mesh=ring_mesh, seq_axis="s", causal=True, layout=layout,
          return_lse=True))
      c[f"ring_{layout}"] = (r, _qkv(jnp.float32, t=64, s=64, d=32))
      c[f"grad_ring_{layout}"] = (_grad(r), _qkv(jnp.float32, t=64, s=64,
                                                 d=32))
  return c


def _arrays(*shapes, dtype=jnp.bfloat16):
  return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


def _sum_grad(f, argnums=(0, 1, 2)):
  """The gradient of the sum of f's (first) output."""
  def loss(*args):
    o = f(*args)
    o = o[0] if isinstance(o, tuple) else o
    return jnp.sum(o.astype(jnp.float32))
  return jax.grad(loss, argnums=argnums)


def feature_cases(jf, cuda: bool):
  """What is built around `attention`: `fp8_attention` (arrays, Fp8Tensors,
  mixed, segment ids, gradients, vmap), `attention_with_kvcache` (contiguous,
  paged, FP8 cache, appends, gradients, vmap) and the sharded calls:
  {name: (fn, args[, mesh to lower under])}."""
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
  out["fp8_grad"] = (_sum_grad(lambda q, k, v: fp8(q, k, v, causal=True)),
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
  out["kvcache_grad"] = (_sum_grad(lambda q, kc, vc, n: kv(q, kc, vc, n)),
                         (dq, cache, cache, lens))
  out["kvcache_fp8_grad"] = (_sum_grad(lambda q, kc, vc, n, t: kv(
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
  from jax.sharding import AxisType
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
    out[f"sharded_{kind}_attention_grad"] = (_sum_grad(attn), (q, k, k, seg))
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


def _strip_locations(line: str) -> str:
  """line without its loc(...) annotations (balanced parentheses)."""
  out, i = [], 0
  while True:
    j = line.find(" loc(", i)
    if j < 0:
      out.append(line[i:])
      return "".join(out)
    out.append(line[i:j])
    depth, k = 0, j + 4
    while k < len(line):
      depth += {"(": 1, ")": -1}.get(line[k], 0)
      k += 1
      if depth == 0:
        break
    i = k


# Attributes that name things rather than compute them.
_NAMES = re.compile(r'\s*,?\s*(mhlo\.frontend_attributes\s*=\s*\{[^}]*\}|'
                    r'(mhlo\.frontend_attributes|metadata|jax\.result_info|'
                    r'mhlo\.sharding_info)\s*=\s*"[^"]*")')
# custom_partitioning's backend_config is the address of its Python callbacks.
_CALLBACK = re.compile(r'(@CustomSPMDPartitioning\(.*?backend_config = )"\d+"')


def normalise(text: str) -> str:
  lines = []
  for line in text.splitlines():
    if line.lstrip().startswith(("#loc", "loc(")):
      continue
    line = _strip_locations(line)
    line = _CALLBACK.sub(r'\1"callbacks"', line)
    line = _NAMES.sub("", line).rstrip()
    if line:
      lines.append(line)
  return "\n".join(lines)


def _lower_export(fn, args, cuda: bool) -> str:
  """The attention group: jax.export for "cuda", so the program is the one an
  exported artifact carries."""
  if cuda:
    try:
      from jax_flash._src.backends import ffi
    except ImportError:  # a tree without the backends/ subpackage
      from jax_flash._src import ffi
    ok = [jax.export.DisabledSafetyCheck.custom_call(t) for t in ffi.TARGETS]
    exp = jax.export.export(jax.jit(fn), platforms=["cuda"],
                            disabled_checks=ok)(*args)
    return exp.mlir_module()
  return jax.jit(fn).lower(*args).as_text()


def _lower_traced(fn, args, cuda: bool) -> str:
  """The features group: jax.export cannot serialise custom_partitioning's
  callbacks, Traced.lower takes the platform without serialising."""
  platforms = ("cuda",) if cuda else None
  return jax.jit(fn).trace(*args).lower(
      lowering_platforms=platforms).as_text()


def _stage_gpu():
  """The kernels' checks see a GPU platform from this host (the registry
  module of either layout), so the CUDA branch is the one lowered."""
  try:
    registry = importlib.import_module("jax_flash._src.backends.registry")
  except ImportError:
    registry = importlib.import_module("jax_flash._src.backends")
  registry.default_platform = lambda: "gpu"


def groups(cuda: bool):
  """(group, lowering, cases builder), in the order they run. The GPU staging
  comes after the attention group, which lowers with this host's platform."""
  def features():
    if cuda:
      _stage_gpu()
    return feature_cases(jax_flash, cuda)
  return (("attention", _lower_export, lambda: attention_cases(cuda)),
          ("features", _lower_traced, features))


def lower(lowering, fn, args, cuda: bool, mesh=None) -> str:
  if mesh is not None:
    with jax.set_mesh(mesh):
      return lowering(fn, args, cuda)
  return lowering(fn, args, cuda)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cuda", action="store_true")
  parser.add_argument("--dump")
  parser.add_argument("--only", help="a regular expression of group/name")
  opts = parser.parse_args()
  print(f"# jax_flash from {os.path.dirname(jax_flash.__file__)}",
        file=sys.stderr)
  for group, lowering, build in groups(opts.cuda):
    for name, (fn, args, *mesh) in build().items():
      full = f"{group}/{name}"
      if opts.only and not re.search(opts.only, full):
        continue
      try:
        text = normalise(lower(lowering, fn, args, opts.cuda, *mesh))
      except Exception as e:  # noqa: BLE001 (a refusal is a result too)
        text = f"error {type(e).__name__}: {e}"
      if opts.dump:
        os.makedirs(os.path.join(opts.dump, group), exist_ok=True)
        with open(os.path.join(opts.dump, group, name + ".mlir"), "w") as f:
          f.write(text + "\n")
      digest = hashlib.sha256(text.encode()).hexdigest()[:16]
      note = text[:70] if text.startswith("error") else ""
      print(f"{full:44s} {digest}  {note}".rstrip(), flush=True)


if __name__ == "__main__":
  sys.exit(main())
