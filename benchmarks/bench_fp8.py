"""FP8 (e4m3) attention forward timings (TFLOP/s) against cuDNN, one process.

    python benchmarks/bench_fp8.py --out benchmarks/results/h200_fp8.json
    python benchmarks/bench_fp8.py --quick --out /tmp/fp8_smoke.json   # CPU

Shapes (as the other H200 runs): B*T = 16384 tokens (B=2 at T=8192, B=1 at
T=16384), H = 2048 / D (D=64: 32, D=128: 16, D=256: 8), H_kv = H, S = T; every
D in --dims, T in --seqs, causal and not (--causal). --quick: B=1, T=S=256,
H=2 (a smoke test: a few iterations, nothing worth keeping).

Implementations (--impls), timed side by side on the same random normal bf16
inputs, forward only:
  jax_flash_fp8          the kernel alone: jax_flash._src.fp8.cuda.forward
                         under jit on inputs quantised (cuda.quantize) before
                         the timing; the spec is the one fp8_attention passes
                         (captured from a trace). Off a GPU, or where the
                         internal call cannot be set up: fp8_attention on
                         pre-quantised Fp8Tensors (row field `via` says which)
  jax_flash_fp8_tensors  fp8_attention on Fp8Tensors made by quantize_fp8
                         before the timing (the public kernel-alone call; its
                         row's `entry_ops` lists what XLA runs besides the
                         kernel, so one sees whether it adds work)
  jax_flash_fp8_e2e      fp8_attention from bf16: quantisation included
  jax_flash_fp8_prepass  the quantisation alone (the CUDA pre-pass on a GPU,
                         quantize.py elsewhere), Q and K rotated: rows carry
                         `gbps` (bytes of the 16-bit q, k, v read) instead of
                         TF/s
  jax_flash_fp8_prepass_plain  the same without the rotation (seed None)
  cudnn_fp8              cuDNN FP8 flash attention (jax._src.cudnn.
                         fused_attention_stablehlo.dot_product_attention,
                         use_fp8=True) on e4m3 inputs cast before the timing
                         (per-tensor scales), e4m3 output: the kernel alone
  cudnn_fp8_e2e          the same from bf16: per-tensor amax, scale and cast
                         of q, k, v inside the timed call, output dequantised
                         to bf16 (its scale from one calibration call before
                         the timing: delayed scaling, as TransformerEngine)
  cudnn_bf16             jax.nn.dot_product_attention(implementation="cudnn")
  jax_flash_bf16         jax_flash.attention(implementation="cuda")

Method: that of bench_attention.py (its time_interleaved): every step warmed
up, then --repeats rounds of --iters back-to-back calls between two syncs, the
implementations of a shape timed round by round in alternating order, median
of the rounds. FLOPs 4*B*H*T*S*D, halved when causal. Every failure is
recorded in its row (`error`) and the run goes on. With --out, each shape's
rows are merged into the JSON list as soon as they are measured (records with
the same impl, mode, dtype, B, T, S, H, H_kv, D, causal are replaced; a file
holding another device's records is refused). Each row carries its peers'
figures from the same run: cudnn_fp8_tflops (kernel-alone cuDNN FP8 for rows
without quantisation, the cast-included one for e2e rows), cudnn_bf16_tflops,
speedup_vs_cudnn_fp8 and speedup_vs_cudnn_bf16. A table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import os
import pathlib
import re
import sys
import traceback
import warnings

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # also under PYTHONSAFEPATH=1
  sys.path.insert(0, str(_HERE))

import bench_attention as ba  # noqa: E402  (imports jax_flash, or the checkout)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax_flash = ba.jax_flash

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
BF16 = jnp.bfloat16
FP8_PARAM_NAMES = (
    "amax_dQ", "amax_dK", "amax_dV", "amax_dP", "descale_q", "descale_k",
    "descale_v", "descale_s", "scale_s", "scale_o", "descale_o", "descale_dO",
    "descale_dP", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")

ALL_IMPLS = ("jax_flash_fp8", "jax_flash_fp8_tensors", "jax_flash_fp8_e2e",
             "jax_flash_fp8_prepass", "jax_flash_fp8_prepass_plain",
             "cudnn_fp8", "cudnn_fp8_e2e",
             "cudnn_bf16", "jax_flash_bf16")
FP8_IMPLS = {"jax_flash_fp8", "jax_flash_fp8_tensors", "jax_flash_fp8_e2e",
             "cudnn_fp8", "cudnn_fp8_e2e"}
E2E_IMPLS = {"jax_flash_fp8_e2e", "cudnn_fp8_e2e"}
PREPASS_IMPLS = {"jax_flash_fp8_prepass", "jax_flash_fp8_prepass_plain"}
GPU_ONLY = {"cudnn_fp8", "cudnn_fp8_e2e", "cudnn_bf16"}


def _err(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}"[:500]


# ---------------------------------------------------------------------------
# cuDNN FP8
# ---------------------------------------------------------------------------


def cudnn_fp8_params(descale_q, descale_k, descale_v, scale_o,
                     scale_s=E4M3_MAX):
  """The fp8_params dict of cuDNN's FP8 attention: every one of its 17 keys
  a float32 [1, 1, 1, 1] array. Forward semantics (cuDNN's FP8 fprop graph):
  S = (Q8 K8^T) descale_q descale_k scale; P = exp(S - rowmax) (<= 1, so
  amax(P) = 1 and scale_s = 448 uses e4m3's range); P8 = e4m3(P scale_s);
  O = softmax-normalised (P8 V8) descale_s descale_v; O8 = e4m3(O scale_o).
  The backward-only entries are 1."""
  one = jnp.ones((1, 1, 1, 1), jnp.float32)
  f = lambda x: jnp.asarray(x, jnp.float32).reshape(1, 1, 1, 1)
  params = {name: one for name in FP8_PARAM_NAMES}
  params.update(descale_q=f(descale_q), descale_k=f(descale_k),
                descale_v=f(descale_v), scale_s=f(scale_s),
                descale_s=f(1.0 / scale_s), scale_o=f(scale_o),
                descale_o=f(1.0 / scale_o))
  return params


def cudnn_fp8_attention(q8, k8, v8, params, *, causal, scale):
  """-> (o e4m3 [B, T, H, D] (real O = o * descale_o), amax_s, amax_o)."""
  from jax._src.cudnn.fused_attention_stablehlo import MaskType
  from jax._src.cudnn.fused_attention_stablehlo import \
      dot_product_attention as cudnn_dpa
  return cudnn_dpa(q8, k8, v8, fp8_params=params, scale=scale,
                   mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK,
                   qkv_layout="BTNH", use_fp8=True)


def per_tensor_e4m3(x):
  """(e4m3 x * 448 / amax, descale = amax / 448 as float32 [1, 1, 1, 1])."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  amax = jnp.where(amax > 0, amax, 1.0)
  x8 = jnp.clip(x.astype(jnp.float32) * (E4M3_MAX / amax), -E4M3_MAX,
                E4M3_MAX).astype(E4M3)
  return x8, (amax / E4M3_MAX).reshape(1, 1, 1, 1)


def calibrate_cudnn_scale_o(q8, k8, v8, dq, dk, dv, *, causal, scale):
  """scale_o = 448 / amax(O) from one call with scale_o = 1 (the amax cuDNN
  returns is that of O before scale_o)."""
  params = cudnn_fp8_params(dq, dk, dv, 1.0)
  _, _, amax_o = jax.jit(lambda *a: cudnn_fp8_attention(
      *a, causal=causal, scale=scale))(q8, k8, v8, params)
  amax_o = float(jnp.max(amax_o))
  if not amax_o > 0 or amax_o != amax_o:
    raise RuntimeError(f"cuDNN FP8 calibration: amax_o = {amax_o}")
  return E4M3_MAX / amax_o


# ---------------------------------------------------------------------------
# jax_flash FP8: the kernel alone
# ---------------------------------------------------------------------------


def _fp8_cuda():
  from jax_flash._src.fp8 import cuda as fp8_cuda
  return fp8_cuda


def capture_forward_call(q, k, v, causal):
  """The (spec, q_seg, kv_seg, out_dtype, arg avals) fp8_attention passes to
  jax_flash._src.fp8.cuda.forward, from lowering (not running) its jitted
  call with `forward` wrapped; None if the wrapper was not reached."""
  fp8_cuda = _fp8_cuda()
  original = fp8_cuda.forward
  seen = []

  def spy(*args, **kwargs):
    seen.append((args, kwargs))
    return original(*args, **kwargs)

  fp8_cuda.forward = spy
  try:
    jax.jit(lambda q, k, v: jax_flash.fp8_attention(
        q, k, v, causal=causal, implementation="cuda")).lower(q, k, v)
  finally:
    fp8_cuda.forward = original
  if not seen:
    return None
  bound = inspect.signature(original).bind(*seen[0][0], **seen[0][1])
  bound.apply_defaults()
  # spec, q8, q_descale, k8, k_descale, v8, v_descale, q_seg, kv_seg, out_dtype
  spec, *args = bound.arguments.values()
  q_seg, kv_seg, out_dtype = args[6], args[7], args[8]
  seg = lambda s: None if s is None else jax.ShapeDtypeStruct(s.shape, s.dtype)
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args[:6]]
  return spec, seg(q_seg), seg(kv_seg), out_dtype, avals


def _candidate_specs(shape):
  from jax_flash._src.core.spec import UNBOUNDED, AttentionSpec
  for dtype in ("bfloat16", "float8_e4m3fn"):
    yield AttentionSpec(
        scale=shape.D**-0.5, causal=shape.causal,
        window_right=0 if shape.causal else UNBOUNDED, batch=shape.B,
        q_len=shape.T, kv_len=shape.S, num_heads=shape.H,
        num_kv_heads=shape.H_kv, head_dim=shape.D, dtype=dtype)


def build_internal_kernel(shape, q, k, v):
  """-> (step, args, meta): cuda.forward alone on cuda.quantize's outputs."""
  fp8_cuda = _fp8_cuda()
  meta = {"via": "jax_flash._src.fp8.cuda.forward"}
  captured = None
  try:
    captured = capture_forward_call(q, k, v, shape.causal)
  except Exception as e:  # e.g. fp8_attention not there yet
    meta["capture_error"] = _err(e)
  if captured is not None:
    spec, q_seg, kv_seg, out_dtype, avals = captured
    meta["spec_from"] = "fp8_attention trace"
  else:
    spec, q_seg, kv_seg, out_dtype, avals = None, None, None, BF16, None
    reasons = []
    for cand in _candidate_specs(shape):
      try:
        fp8_cuda.check(cand, "gpu")
        spec = cand
        break
      except Exception as e:
        reasons.append(_err(e))
    if spec is None:
      raise RuntimeError("no spec for cuda.forward: " + " | ".join(reasons))
    meta["spec_from"] = f"constructed (dtype {spec.dtype})"
  qkv8 = jax.jit(lambda q, k, v: tuple(fp8_cuda.quantize(q, k, v, seed=0)))(
      q, k, v)
  qkv8 = jax.block_until_ready(qkv8)
  if avals is not None:
    got = [(tuple(a.shape), str(a.dtype)) for a in qkv8]
    want = [(tuple(a.shape), str(a.dtype)) for a in avals]
    if got != want:
      meta["arg_mismatch"] = f"quantize gave {got}, forward got {want}"[:500]
  segs = tuple(None if s is None else jnp.zeros(s.shape, s.dtype)
               for s in (q_seg, kv_seg))

  def step(q8, qd, k8, kd, v8, vd, segs):
    return fp8_cuda.forward(spec, q8, qd, k8, kd, v8, vd, segs[0], segs[1],
                            out_dtype)

  return jax.jit(step), (*qkv8, segs), meta


def quantize_tensors(q, k, v, *, rotate=True, seed=0, granularity="block"):
  """Fp8Tensors of q, k, v by jax_flash.quantize_fp8 (jitted when the
  Fp8Tensor is a pytree, eagerly otherwise)."""
  def qt(x, kind):
    return jax_flash.quantize_fp8(x, kind=kind, rotate=rotate, seed=seed,
                                  granularity=granularity)
  try:
    out = jax.jit(lambda q, k, v: (qt(q, "query"), qt(k, "key"),
                                   qt(v, "value")))(q, k, v)
  except TypeError:  # not a pytree: cannot leave jit
    out = (qt(q, "query"), qt(k, "key"), qt(v, "value"))
  return jax.block_until_ready(out)


def build_tensor_kernel(shape, q, k, v, implementation):
  tensors = quantize_tensors(q, k, v)
  step = jax.jit(lambda qt, kt, vt: jax_flash.fp8_attention(
      qt, kt, vt, causal=shape.causal, implementation=implementation))
  return step, tensors, {"via": "fp8_attention(Fp8Tensor)"}


# ---------------------------------------------------------------------------
# The implementations: name -> (step, args, meta)
# ---------------------------------------------------------------------------


def build(impl, shape, q, k, v, platform):
  ours = "cuda" if platform == "gpu" else "xla"
  scale = shape.D**-0.5
  causal = shape.causal
  if impl == "jax_flash_fp8":
    if platform == "gpu":
      try:
        return build_internal_kernel(shape, q, k, v)
      except Exception as e:
        step, args, meta = build_tensor_kernel(shape, q, k, v, ours)
        meta["internal_error"] = _err(e)
        return step, args, meta
    return build_tensor_kernel(shape, q, k, v, ours)
  if impl == "jax_flash_fp8_tensors":
    return build_tensor_kernel(shape, q, k, v, ours)
  if impl == "jax_flash_fp8_e2e":
    step = jax.jit(lambda q, k, v: jax_flash.fp8_attention(
        q, k, v, causal=causal, implementation=ours))
    return step, (q, k, v), {"via": "fp8_attention(bf16)"}
  if impl in PREPASS_IMPLS:
    seed = 0 if impl == "jax_flash_fp8_prepass" else None
    if platform == "gpu":
      fp8_cuda = _fp8_cuda()
      step = jax.jit(
          lambda q, k, v: tuple(fp8_cuda.quantize(q, k, v, seed=seed)))
      return step, (q, k, v), {"via": "jax_flash._src.fp8.cuda.quantize"}
    from jax_flash._src.fp8 import quantize as fp8_quantize
    step = jax.jit(
        lambda q, k, v: fp8_quantize.quantize_qkv(q, k, v, seed=seed))
    return step, (q, k, v), {"via": "jax_flash._src.fp8.quantize.quantize_qkv"}
  if impl in ("cudnn_fp8", "cudnn_fp8_e2e"):
    (q8, dq), (k8, dk), (v8, dv) = jax.block_until_ready(jax.jit(
        lambda q, k, v: (per_tensor_e4m3(q), per_tensor_e4m3(k),
                         per_tensor_e4m3(v)))(q, k, v))
    scale_o = calibrate_cudnn_scale_o(q8, k8, v8, dq, dk, dv, causal=causal,
                                      scale=scale)
    meta = {"via": "fused_attention_stablehlo.dot_product_attention("
                   "use_fp8=True)", "scale_o": round(scale_o, 6)}
    if impl == "cudnn_fp8":
      params = cudnn_fp8_params(dq, dk, dv, scale_o)
      step = jax.jit(lambda q8, k8, v8, p: cudnn_fp8_attention(
          q8, k8, v8, p, causal=causal, scale=scale))
      return step, (q8, k8, v8, params), meta
    scale_o = jnp.asarray(scale_o, jnp.float32)

    def e2e(q, k, v, scale_o):
      (q8, dq), (k8, dk), (v8, dv) = map(per_tensor_e4m3, (q, k, v))
      o8, _, _ = cudnn_fp8_attention(
          q8, k8, v8, cudnn_fp8_params(dq, dk, dv, scale_o), causal=causal,
          scale=scale)
      return (o8.astype(jnp.float32) / scale_o).astype(q.dtype)

    return jax.jit(e2e), (q, k, v, scale_o), meta
  if impl == "cudnn_bf16":
    step = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))
    return step, (q, k, v), {}
  if impl == "jax_flash_bf16":
    step = jax.jit(lambda q, k, v: jax_flash.attention(
        q, k, v, causal=causal, implementation=ours))
    return step, (q, k, v), {}
  raise ValueError(f"unknown impl {impl!r}")


_TRIVIAL_OPS = {"parameter", "tuple", "get-tuple-element", "constant",
                "bitcast"}


def entry_ops(step, args):
  """{opcode: count} of the compiled ENTRY computation, trivial ops left out
  (what XLA runs per call: ideally one custom-call)."""
  text = step.lower(*args).compile().as_text()
  m = re.search(r"^ENTRY .*?\{\n(.*?)^\}", text, re.S | re.M)
  body = m.group(1) if m else text
  ops = {}
  for line in body.splitlines():
    if "=" not in line:
      continue
    rhs = line.split("=", 1)[1]
    op = re.search(r"\b([a-z][a-z0-9\-]*)\(", rhs)
    if op and op.group(1) not in _TRIVIAL_OPS:
      ops[op.group(1)] = ops.get(op.group(1), 0) + 1
  return ops


# ---------------------------------------------------------------------------


def shapes_for(dims, seqs, causals, quick):
  shapes = []
  for D in dims:
    for T in seqs:
      for causal in causals:
        if quick:
          B, H = 1, 2
        else:
          B, H = max(1, 16384 // T), 2048 // D
        shapes.append(ba.Shape(B, T, T, H, H, D, causal))
  return shapes


def make_inputs(shape, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (shape.B, shape.T, shape.H, shape.D), BF16)
  k = jax.random.normal(kk, (shape.B, shape.S, shape.H_kv, shape.D), BF16)
  v = jax.random.normal(kv, (shape.B, shape.S, shape.H_kv, shape.D), BF16)
  return jax.block_until_ready((q, k, v))


def run_shape(shape, impls, platform, *, iters, repeats, warmup, date,
              device, command, verbose, ops=True):
  q, k, v = make_inputs(shape)
  steps, errors, metas = {}, {}, {}
  for impl in impls:
    try:
      step, args, meta = build(impl, shape, q, k, v, platform)
      steps[impl] = (step, args)
      metas[impl] = meta
    except Exception as e:
      errors[impl] = e
      if verbose:
        traceback.print_exc()
  for impl in ("jax_flash_fp8", "jax_flash_fp8_tensors", "jax_flash_fp8_e2e",
               "cudnn_fp8"):
    if ops and impl in steps:
      try:
        metas[impl]["entry_ops"] = entry_ops(*steps[impl])
      except Exception as e:
        metas[impl]["entry_ops_error"] = _err(e)
  timed = ba.time_interleaved(steps, iters=iters, repeats=repeats,
                              warmup=warmup)
  timed.update(errors)
  ours = "cuda" if platform == "gpu" else "xla"
  rows = []
  for impl in impls:
    rec = dict(impl=impl, mode="fwd",
               dtype="float8_e4m3fn" if impl in FP8_IMPLS else "bfloat16",
               B=shape.B, T=shape.T, S=shape.S, H=shape.H, H_kv=shape.H_kv,
               D=shape.D, causal=shape.causal, ms=None, tflops=None,
               quantisation_included=impl in E2E_IMPLS,
               implementation=("cudnn" if impl.startswith("cudnn") else ours),
               date=date, device=device, command=command)
    rec.update(metas.get(impl, {}))
    ms = timed.get(impl)
    if isinstance(ms, Exception):
      rec["error"] = _err(ms)
    elif ms is not None and impl in PREPASS_IMPLS:
      rec["ms"] = float(f"{ms:.6g}")
      read = 2 * shape.D * (shape.B * shape.T * shape.H
                            + 2 * shape.B * shape.S * shape.H_kv)
      rec["gbps"] = float(f"{read / (ms * 1e-3) / 1e9:.6g}")
    elif ms is not None:
      rec["ms"] = float(f"{ms:.6g}")
      rec["tflops"] = float(f"{shape.flops('fwd') / (ms * 1e-3) / 1e12:.6g}")
    rows.append(rec)
    rate = (f"{rec['gbps']:.0f} GB/s" if rec.get("gbps") is not None else
            ba.format_rate(rec["tflops"]) if rec["tflops"] is not None else "")
    status = (f"{ba.format_ms(rec['ms'])}  {rate}"
              if rec["ms"] is not None else rec.get("error", "?")[:150])
    print(f"  {shape.label():34s} {impl:22s} {status}", flush=True)
  by = {r["impl"]: r["tflops"] for r in rows}
  for r in rows:
    peer = by.get("cudnn_fp8_e2e" if r["quantisation_included"]
                  else "cudnn_fp8")
    r["cudnn_fp8_tflops"] = peer
    r["cudnn_bf16_tflops"] = by.get("cudnn_bf16")
    r["bf16_tflops"] = by.get("jax_flash_bf16")
    r["speedup_vs_cudnn_fp8"] = (round(r["tflops"] / peer, 3)
                                 if peer and r["tflops"] else None)
    r["speedup_vs_cudnn_bf16"] = (round(r["tflops"] / by["cudnn_bf16"], 3)
                                  if by.get("cudnn_bf16") and r["tflops"]
                                  else None)
  del steps
  return rows


def print_table(records):
  cols = [("ours", "jax_flash_fp8"), ("ours e2e", "jax_flash_fp8_e2e"),
          ("ours Fp8T", "jax_flash_fp8_tensors"), ("cuDNN8", "cudnn_fp8"),
          ("cuDNN8 e2e", "cudnn_fp8_e2e"), ("cuDNN bf16", "cudnn_bf16"),
          ("ours bf16", "jax_flash_bf16")]
  groups = {}
  for r in records:
    groups.setdefault((r["D"], r["T"], r["causal"], r["B"], r["H"]),
                      {})[r["impl"]] = r
  def tf(r):
    if r and r.get("tflops"):
      x = r["tflops"]
      return f"{x:.1f}" if x >= 1 else f"{x * 1e3:.3g}G"
    return "err" if r and r.get("error") else "-"

  ratio = lambda a, b: (f"{a['tflops'] / b['tflops']:.2f}x"
                        if a and b and a.get("tflops") and b.get("tflops")
                        else "-")
  print("\nTFLOP/s (fwd); ratios: ours/cuDNN fp8 kernel, ours e2e/cuDNN fp8 "
        "e2e, ours fp8/ours bf16, ours fp8/cuDNN bf16")
  head = (f"{'D':>4s} {'T':>6s} {'causal':>6s} " +
          " ".join(f"{c:>10s}" for c, _ in cols) +
          f" {'k/cuDNN8':>9s} {'e2e/e2e':>8s} {'8/bf16':>7s} {'8/cuDNNbf':>9s}")
  print(head)
  for (D, T, causal, _, _), g in sorted(groups.items()):
    print(f"{D:4d} {T:6d} {str(causal):>6s} " +
          " ".join(f"{tf(g.get(i)):>10s}" for _, i in cols) +
          f" {ratio(g.get('jax_flash_fp8'), g.get('cudnn_fp8')):>9s}"
          f" {ratio(g.get('jax_flash_fp8_e2e'), g.get('cudnn_fp8_e2e')):>8s}"
          f" {ratio(g.get('jax_flash_fp8'), g.get('jax_flash_bf16')):>7s}"
          f" {ratio(g.get('jax_flash_fp8'), g.get('cudnn_bf16')):>9s}")
  prepass = [r for r in records
             if r["impl"] in PREPASS_IMPLS and r.get("ms")]
  if prepass:
    print("\nQuantisation alone (jax_flash_fp8_prepass: Q, K rotated; _plain: "
          "not): ms, GB/s of 16-bit q, k, v read")
    for r in sorted(prepass, key=lambda r: (r["D"], r["T"], r["causal"],
                                            r["impl"])):
      print(f"{r['D']:4d} {r['T']:6d} {str(r['causal']):>6s} "
            f"{r['impl']:28s} {r['ms']:10.4f} {r['gbps']:10.4g}")
  errors = [r for r in records if r.get("error")]
  for r in errors:
    print(f"  error D={r['D']} T={r['T']} causal={r['causal']} "
          f"{r['impl']}: {r['error'][:160]}")
  notes = {(r["impl"], k, str(r[k])[:200]) for r in records
           for k in ("internal_error", "capture_error", "arg_mismatch")
           if r.get(k)}
  for impl, k, msg in sorted(notes):
    print(f"  note {impl} {k}: {msg}")
  ops = {}
  for r in records:
    if r.get("entry_ops") is not None:
      ops.setdefault(r["impl"], set()).add(
          ", ".join(f"{k} x{n}" for k, n in sorted(r["entry_ops"].items())))
  for impl, s in ops.items():
    print(f"  compiled ENTRY ops of {impl}: {' | '.join(sorted(s))}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=pathlib.Path, required=True,
                 help="JSON list to merge the rows into")
  p.add_argument("--dims", default="64,128,256")
  p.add_argument("--seqs", default=None,
                 help="T values (default 8192,16384; --quick: 256)")
  p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
  p.add_argument("--impls", default=",".join(ALL_IMPLS),
                 help=f"comma-separated from {', '.join(ALL_IMPLS)}")
  p.add_argument("--iters", type=int, default=None,
                 help="back-to-back calls per round (default 100; quick 3)")
  p.add_argument("--repeats", type=int, default=None,
                 help="rounds per implementation (default 3; quick 2)")
  p.add_argument("--warmup", type=int, default=None,
                 help="warm-up calls (default 3; quick 1)")
  p.add_argument("--quick", action="store_true",
                 help="small shapes, few iterations: a smoke test")
  p.add_argument("--verbose", action="store_true",
                 help="print the traceback of a failing set-up")
  args = p.parse_args(argv)
  quick = args.quick
  iters = args.iters or (3 if quick else 100)
  repeats = args.repeats or (2 if quick else 3)
  warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
  seqs = [int(t) for t in (args.seqs or ("256" if quick else "8192,16384"))
          .split(",")]
  dims = [int(d) for d in args.dims.split(",")]
  causals = {"both": (False, True), "yes": (True,), "no": (False,)}[
      args.causal]
  impls = [i for i in args.impls.split(",") if i]
  unknown = [i for i in impls if i not in ALL_IMPLS]
  if unknown:
    p.error(f"unknown --impls {unknown}; known: {', '.join(ALL_IMPLS)}")

  warnings.filterwarnings("ignore", category=DeprecationWarning)
  platform = jax.default_backend()
  device = jax.devices()[0].device_kind
  if platform != "gpu":
    skipped = [i for i in impls if i in GPU_ONLY]
    if skipped:
      print(f"not on a GPU: skipping {', '.join(skipped)}; jax_flash FP8 "
            "through implementation='xla'")
    impls = [i for i in impls if i not in skipped]
  try:
    ba.check_same_device(args.out, device)
  except ba.OtherDeviceError as e:
    p.error(str(e))
  try:
    from jax._src.lib import cuda_versions
    cudnn = cuda_versions.cudnn_get_version() if cuda_versions else None
  except Exception:
    cudnn = None
  print(f"device: {device} ({platform}), jax {jax.__version__}, cuDNN "
        f"{cudnn}, impls: {', '.join(impls)}; iters {iters} x repeats "
        f"{repeats}", flush=True)
  command = " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])
  date = datetime.date.today().isoformat()
  records = []
  for shape in shapes_for(dims, seqs, causals, quick):
    try:
      rows = run_shape(shape, impls, platform, iters=iters, repeats=repeats,
                       warmup=warmup, date=date, device=device,
                       command=command, verbose=args.verbose,
                       ops=shape.T == seqs[0])
    except Exception as e:  # e.g. out of memory making the inputs
      print(f"  {shape.label()}: {_err(e)}")
      rows = [dict(impl=i, mode="fwd",
                   dtype="float8_e4m3fn" if i in FP8_IMPLS else "bfloat16",
                   B=shape.B, T=shape.T, S=shape.S, H=shape.H,
                   H_kv=shape.H_kv, D=shape.D, causal=shape.causal, ms=None,
                   tflops=None, quantisation_included=i in E2E_IMPLS,
                   error=_err(e), date=date, device=device, command=command)
              for i in impls]
    if cudnn is not None:
      for r in rows:
        r["cudnn_version"] = cudnn
    records += rows
    try:
      ba.merge_into(args.out, rows)
    except Exception as e:
      print(f"  could not merge into {args.out}: {_err(e)}")
  print(f"results merged into {args.out}")
  print_table(records)
  return records


if __name__ == "__main__":
  main()
