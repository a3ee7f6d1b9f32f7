"""Print a hash of the lowered program of a fixed set of representative calls.

Run it on two source trees and compare the outputs: equal hashes mean the
same StableHLO (locations and metadata removed), i.e. the same computation.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      PYTHONPATH=<tree> python tools/check_lowering.py [--cuda] [--dump DIR]

--cuda lowers for "cuda" with jax.export (needs the built extension's
`_jax_flash_cuda*.so` and `_build.json` in the tree's jax_flash/), so the
CUDA kernel calls and their attributes are compared too. --dump DIR writes
each normalised program to DIR/<case>.mlir for a diff.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
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


def cases(cuda: bool):
  """{name: (fn, args[, mesh to lower under])}."""
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


def normalise(text: str) -> str:
  lines = []
  for line in text.splitlines():
    if line.startswith("#loc") or line.strip().startswith("loc("):
      continue
    line = _strip_locations(line)
    line = re.sub(r'mhlo\.frontend_attributes = \{[^}]*\}', "", line)
    # custom_partitioning's backend_config is the address of its callbacks.
    line = re.sub(r'backend_config = "\d+"', 'backend_config = ""', line)
    lines.append(line)
  return "\n".join(lines)


def lower(fn, args, cuda: bool, mesh=None) -> str:
  if mesh is not None:
    with jax.set_mesh(mesh):
      return lower(fn, args, cuda)
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


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--cuda", action="store_true")
  parser.add_argument("--dump")
  parser.add_argument("--only", help="a regular expression of case names")
  opts = parser.parse_args()
  if opts.dump:
    os.makedirs(opts.dump, exist_ok=True)
  for name, (fn, args, *mesh) in cases(opts.cuda).items():
    if opts.only and not re.search(opts.only, name):
      continue
    try:
      text = normalise(lower(fn, args, opts.cuda, *mesh))
    except Exception as e:  # a refusal is a result too
      text = f"{type(e).__name__}: {e}"
    if opts.dump:
      with open(os.path.join(opts.dump, name + ".mlir"), "w") as f:
        f.write(text)
    print(f"{name:34s} {hashlib.sha256(text.encode()).hexdigest()[:16]}",
          flush=True)


if __name__ == "__main__":
  sys.exit(main())
