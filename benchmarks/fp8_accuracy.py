"""FP8 attention accuracy: RMSE of each quantisation scheme against float64.

    python benchmarks/fp8_accuracy.py --out benchmarks/results/fp8_accuracy.json
    python benchmarks/fp8_accuracy.py --quick --out /tmp/fp8_accuracy.json

FlashAttention-3's setting (Shah et al. 2024, section 4.3): Q, K, V entries
from N(0, 1) ("normal"), and the same with 0.1% of the entries replaced by
N(0, 10^2) draws ("outliers_0.1pct", the outliers of real activations).
B=2, T=S=4096 (--quick: 512), H=8, D=128, scale 1/sqrt(D), non-causal and
causal. The inputs are rounded to bfloat16 first; the reference is exact
attention of those bf16 values in float64 (on the default device with jax's
x64, chunked over query rows; numpy if that fails), so each RMSE is the error
of the method alone (output rounding to its output dtype included).

Methods:
  per_tensor            fp8_attention on Fp8Tensors of quantize_fp8(...,
                        granularity="tensor", rotate=False)
  per_block             fp8_attention(rotate=False): Q per 64 rows, K per k_block
                        keys, V per channel (scheme.py)
  per_block_hadamard    fp8_attention defaults (the random Hadamard rotation
                        of Q and K, then block scales)
  cudnn_per_tensor      cuDNN's FP8 attention (GPU only), per-tensor scales
                        from the amaxes of q, k, v, P scaled by 448 (its amax
                        is 1), e4m3 output scaled by 448 / amax(O) (amax from
                        a first call), upcast and descaled
  bf16                  jax_flash.attention in bf16 (the 16-bit baseline)
Ours run with implementation="cuda" on a GPU, and also "xla" (the simulated
reference of the kernel: rows with simulated=true); "xla" only elsewhere.
implementation="inputs_only_f64" rows (non-causal): the inputs quantised with
jax_flash._src.fp8.quantize (per tensor; per block; rotated + per block;
rotated + V per block of k_block keys instead of per channel, the variant the API
does not offer), dequantised, then exact float64 attention: the part of the
error due to quantising Q, K, V (P is not quantised there).

The JSON file (--out) is overwritten (after every distribution, so a run cut
short keeps what it measured): a list of {method, distribution, rmse,
implementation, simulated, B, T, S, H, D, causal, out_dtype, rel_rmse,
max_abs_err, date, device, error?}. A table is printed last, and whether
per_block_hadamard meets FA3's 9.1e-3 and is at most half of per_tensor on
the outlier inputs (informational).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time
import traceback
import warnings

import numpy as np

import jax
import jax.numpy as jnp

try:
  import jax_flash
except ImportError:  # run from a checkout without installing
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import jax_flash

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
FA3_RMSE = 9.1e-3  # FA3's FP8 (block quantisation + incoherent processing)
FP8_PARAM_NAMES = (
    "amax_dQ", "amax_dK", "amax_dV", "amax_dP", "descale_q", "descale_k",
    "descale_v", "descale_s", "scale_s", "scale_o", "descale_o", "descale_dO",
    "descale_dP", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")


def _err(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}"[:500]


# ---------------------------------------------------------------------------
# Inputs and the float64 reference
# ---------------------------------------------------------------------------


def make_inputs(distribution, B, T, S, H, D, seed):
  """(q, k, v) bf16 jax arrays, and their values as float64 numpy arrays."""
  rng = np.random.default_rng(seed)
  out = []
  for n in (T, S, S):
    x = rng.standard_normal((B, n, H, D), dtype=np.float32)
    if distribution == "outliers_0.1pct":
      hit = rng.random(x.shape) < 1e-3
      x[hit] = 10.0 * rng.standard_normal(int(hit.sum()), dtype=np.float32)
    elif distribution != "normal":
      raise ValueError(distribution)
    out.append(jnp.asarray(x, jnp.bfloat16))
  host = [np.asarray(x.astype(jnp.float32), np.float64) for x in out]
  return out, host


def _attention_rows_np(q, k, v, causal, scale, start):
  s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  if causal:
    T, S = q.shape[1], k.shape[1]
    i = np.arange(start, start + q.shape[1])[:, None] + (k.shape[1] - T)
    s = np.where(np.arange(S)[None, :] <= i, s, -np.inf)
  s = s - s.max(-1, keepdims=True)
  p = np.exp(s)
  o = np.einsum("bhqk,bkhd->bqhd", p, v)
  return o / p.sum(-1).transpose(0, 2, 1)[..., None]


def _attention_rows_jnp(q, k, v, causal, scale, start, total_q):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
  if causal:
    S = k.shape[1]
    i = jnp.arange(start, start + q.shape[1])[:, None] + (S - total_q)
    s = jnp.where(jnp.arange(S)[None, :] <= i, s, -jnp.inf)
  s = s - s.max(-1, keepdims=True)
  p = jnp.exp(s)
  o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
  return o / p.sum(-1).transpose(0, 2, 1)[..., None]


def reference_f64(q, k, v, *, causal, scale, chunk=1024):
  """Exact attention in float64 of numpy float64 [B, T, H, D] inputs:
  on jax's default device with x64 on, chunked over query rows (numpy if
  that fails). -> (numpy float64 output, where it ran)."""
  T = q.shape[1]
  try:
    with jax.enable_x64(True):
      kj, vj = jnp.asarray(k, jnp.float64), jnp.asarray(v, jnp.float64)
      parts = []
      for start in range(0, T, chunk):
        qj = jnp.asarray(q[:, start:start + chunk], jnp.float64)
        parts.append(np.asarray(_attention_rows_jnp(qj, kj, vj, causal, scale,
                                                    start, T)))
      out = np.concatenate(parts, axis=1)
    if out.dtype != np.float64:
      raise TypeError(f"reference came back as {out.dtype}")
    return out, f"jax float64 on {jax.default_backend()}"
  except Exception as e:
    print(f"  (jax float64 reference failed: {_err(e)[:200]}; numpy)")
  parts = [_attention_rows_np(q[:, s:s + chunk], k, v, causal, scale, s)
           for s in range(0, T, chunk)]
  return np.concatenate(parts, axis=1), "numpy float64"


def errors_vs(ref, o):
  if not isinstance(o, np.ndarray):  # float64 numpy stays float64
    o = np.asarray(jnp.asarray(o).astype(jnp.float32))
  o = np.asarray(o, np.float64)
  if o.shape != ref.shape:
    raise ValueError(f"output shape {o.shape}, reference {ref.shape}")
  d = o - ref
  rmse = float(np.sqrt(np.mean(d * d)))
  return dict(rmse=rmse,
              rel_rmse=rmse / float(np.sqrt(np.mean(ref * ref))),
              max_abs_err=float(np.max(np.abs(d))),
              finite=bool(np.all(np.isfinite(o))))


# ---------------------------------------------------------------------------
# Methods: each returns the output array (or raises)
# ---------------------------------------------------------------------------


def _jit_or_eager(fn, *args):
  """jit(fn)(*args); eagerly where the arguments are no pytrees of arrays."""
  try:
    return jax.jit(fn)(*args)
  except TypeError as e:
    if "not a valid JAX type" not in str(e) and "pytree" not in str(e):
      raise
    return fn(*args)


def ours(method, q, k, v, *, causal, implementation, notes):
  if method == "per_block_hadamard":
    return jax.jit(lambda q, k, v: jax_flash.fp8_attention(
        q, k, v, causal=causal, implementation=implementation))(q, k, v)
  if method == "per_block":
    return jax.jit(lambda q, k, v: jax_flash.fp8_attention(
        q, k, v, causal=causal, rotate=False,
        implementation=implementation))(q, k, v)
  if method == "per_tensor":
    def tensors(q, k, v):
      return tuple(jax_flash.quantize_fp8(x, kind=kind, rotate=False,
                                          granularity="tensor")
                   for x, kind in ((q, "query"), (k, "key"), (v, "value")))
    qt, kt, vt = _jit_or_eager(tensors, q, k, v)

    def attend(qt, kt, vt):
      return jax_flash.fp8_attention(qt, kt, vt, causal=causal, rotate=False,
                                     implementation=implementation)
    try:
      return _jit_or_eager(attend, qt, kt, vt)
    except (TypeError, ValueError) as e:
      if "rotate" not in str(e):
        raise
      notes["rotate_kwarg_refused"] = _err(e)  # the tensors carry it
      return _jit_or_eager(lambda qt, kt, vt: jax_flash.fp8_attention(
          qt, kt, vt, causal=causal, implementation=implementation),
          qt, kt, vt)
  raise ValueError(method)


def bf16(q, k, v, *, causal, implementation):
  return jax.jit(lambda q, k, v: jax_flash.attention(
      q, k, v, causal=causal, implementation=implementation))(q, k, v)


def cudnn_fp8_params(descale_q, descale_k, descale_v, scale_o,
                     scale_s=E4M3_MAX):
  """cuDNN's fp8_params (17 float32 [1, 1, 1, 1] entries; the backward's 1):
  Q = q8 descale_q etc.; P8 = e4m3(P scale_s) with P = exp(S - rowmax) <= 1;
  O8 = e4m3(O scale_o)."""
  one = jnp.ones((1, 1, 1, 1), jnp.float32)
  f = lambda x: jnp.asarray(x, jnp.float32).reshape(1, 1, 1, 1)
  params = {name: one for name in FP8_PARAM_NAMES}
  params.update(descale_q=f(descale_q), descale_k=f(descale_k),
                descale_v=f(descale_v), scale_s=f(scale_s),
                descale_s=f(1.0 / scale_s), scale_o=f(scale_o),
                descale_o=f(1.0 / scale_o))
  return params


def per_tensor_e4m3(x):
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  amax = jnp.where(amax > 0, amax, 1.0)
  x8 = jnp.clip(x.astype(jnp.float32) * (E4M3_MAX / amax), -E4M3_MAX,
                E4M3_MAX).astype(E4M3)
  return x8, amax / E4M3_MAX


def cudnn_per_tensor(q, k, v, *, causal, notes):
  from jax._src.cudnn.fused_attention_stablehlo import MaskType
  from jax._src.cudnn.fused_attention_stablehlo import \
      dot_product_attention as cudnn_dpa
  scale = q.shape[-1]**-0.5

  @jax.jit
  def call(q8, k8, v8, params):
    return cudnn_dpa(q8, k8, v8, fp8_params=params, scale=scale,
                     mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK,
                     qkv_layout="BTNH", use_fp8=True)

  (q8, dq), (k8, dk), (v8, dv) = jax.jit(
      lambda q, k, v: tuple(map(per_tensor_e4m3, (q, k, v))))(q, k, v)
  _, amax_s, amax_o = call(q8, k8, v8, cudnn_fp8_params(dq, dk, dv, 1.0))
  amax_o = float(jnp.max(amax_o))
  if not amax_o > 0:
    raise RuntimeError(f"cuDNN FP8 calibration call: amax_o = {amax_o}")
  scale_o = E4M3_MAX / amax_o
  o8, amax_s2, amax_o2 = call(q8, k8, v8, cudnn_fp8_params(dq, dk, dv,
                                                           scale_o))
  notes.update(amax_s=float(jnp.max(amax_s)), amax_o=amax_o,
               amax_o_second_call=float(jnp.max(amax_o2)),
               scale_o=scale_o, descale_q=float(dq), descale_k=float(dk),
               descale_v=float(dv))
  return o8.astype(jnp.float32) / scale_o


def inputs_only(method, q, k, v, *, seed=0):
  """The dequantised (float64 numpy) q, k, v of a scheme: the rotation of Q
  and K cancels in Q K^T, so exact attention of these is the scheme's error
  from quantising its inputs alone."""
  from jax_flash._src.fp8 import quantize as Q
  from jax_flash._src.fp8 import scheme

  def deq_blocks(x8, descale, block):
    n = x8.shape[1]
    d = jnp.repeat(descale.transpose(0, 2, 1), block, axis=1)[:, :n]
    return x8.astype(jnp.float32) * d[..., None]

  def per_tensor(x):
    x8, d = per_tensor_e4m3(x.astype(jnp.float32))
    return x8.astype(jnp.float32) * d

  @jax.jit
  def run(q, k, v):
    if method == "per_tensor":
      return per_tensor(q), per_tensor(k), per_tensor(v)
    if method in ("per_block_hadamard", "per_block_hadamard_vblock"):
      q, k = Q.rotate(q, seed), Q.rotate(k, seed)
    elif method != "per_block":
      raise ValueError(method)
    qd = deq_blocks(*Q.quantize_blocks(q, scheme.Q_BLOCK), scheme.Q_BLOCK)
    kb = scheme.k_block(k.shape[-1])
    kd = deq_blocks(*Q.quantize_blocks(k, kb), kb)
    if method == "per_block_hadamard_vblock":
      vd = deq_blocks(*Q.quantize_v_blocks(v, kb), kb)
    else:
      v8, dv = Q.quantize_channels(v)
      vd = v8.astype(jnp.float32) * dv[:, None]
    return qd, kd, vd

  return [np.asarray(x, np.float64) for x in run(q, k, v)]


# ---------------------------------------------------------------------------


OURS = ("per_tensor", "per_block", "per_block_hadamard")
SIMS = ("per_tensor", "per_block", "per_block_hadamard",
        "per_block_hadamard_vblock")


def study(dist, causal, shape, *, platform, device, date, sims, verbose):
  B, T, S, H, D = shape
  (q, k, v), host = make_inputs(dist, B, T, S, H, D,
                                seed=1 if dist == "normal" else 2)
  scale = D**-0.5
  t0 = time.perf_counter()
  ref, where = reference_f64(*host, causal=causal, scale=scale)
  print(f"  {dist} causal={causal}: reference ({where}) "
        f"{time.perf_counter() - t0:.1f} s", flush=True)
  rows = []

  def record(method, implementation, fn, **extra):
    row = dict(method=method, distribution=dist, rmse=None,
               implementation=implementation,
               simulated=implementation == "xla" and method != "bf16",
               B=B, T=T, S=S, H=H, D=D, causal=causal, date=date,
               device=device, reference=where)
    row.update(extra)
    notes = {}
    t = time.perf_counter()
    try:
      o = fn(notes)
      row["out_dtype"] = str(getattr(o, "dtype", "float64"))
      row.update(errors_vs(ref, o))
    except Exception as e:
      row["error"] = _err(e)
      if verbose:
        traceback.print_exc()
    row.update(notes)
    row["seconds"] = round(time.perf_counter() - t, 2)
    rows.append(row)
    shown = (f"rmse {row['rmse']:.3e}" if row["rmse"] is not None
             else row["error"][:150])
    print(f"    {method:26s} {implementation:16s} {shown}", flush=True)

  impls = ["cuda", "xla"] if platform == "gpu" else ["xla"]
  for implementation in impls:
    for method in OURS:
      record(method, implementation,
             lambda notes, m=method, i=implementation: ours(
                 m, q, k, v, causal=causal, implementation=i, notes=notes))
  if platform == "gpu":
    record("cudnn_per_tensor", "cudnn",
           lambda notes: cudnn_per_tensor(q, k, v, causal=causal,
                                          notes=notes))
  record("bf16", impls[0],
         lambda notes: bf16(q, k, v, causal=causal,
                            implementation=impls[0]))
  if sims and not causal:
    for method in SIMS:
      def sim(notes, m=method):
        qd, kd, vd = inputs_only(m, q, k, v)
        return reference_f64(qd, kd, vd, causal=causal, scale=scale)[0]
      record(method, "inputs_only_f64", sim)
  return rows


def print_table(rows, primary):
  keys = sorted({(r["distribution"], r["causal"]) for r in rows},
                key=lambda x: (x[0] != "normal", x[1]))
  methods = []
  for r in rows:
    if (r["method"], r["implementation"]) not in methods:
      methods.append((r["method"], r["implementation"]))
  by = {(r["method"], r["implementation"], r["distribution"], r["causal"]): r
        for r in rows}
  print("\nRMSE vs float64 (B={B} T={T} S={S} H={H} D={D})".format(**rows[0]))
  head = f"{'method':26s} {'implementation':16s} " + " ".join(
      f"{d + (' causal' if c else ''):>22s}" for d, c in keys)
  print(head)
  for m, i in methods:
    cells = []
    for d, c in keys:
      r = by.get((m, i, d, c))
      cells.append("-" if r is None else
                   (f"{r['rmse']:.3e}" if r["rmse"] is not None else "error"))
    print(f"{m:26s} {i:16s} " + " ".join(f"{x:>22s}" for x in cells))
  for r in rows:
    if r.get("error"):
      print(f"  error {r['method']} {r['implementation']} "
            f"{r['distribution']} causal={r['causal']}: {r['error'][:160]}")
  for causal in (False, True):
    h = by.get(("per_block_hadamard", primary, "outliers_0.1pct", causal))
    t = by.get(("per_tensor", primary, "outliers_0.1pct", causal))
    if h is None or h["rmse"] is None:
      continue
    line = (f"outliers_0.1pct{' causal' if causal else ''}, {primary}: "
            f"per_block_hadamard {h['rmse']:.3e} <= {FA3_RMSE:.1e} (FA3): "
            f"{'yes' if h['rmse'] <= FA3_RMSE else 'NO'}")
    if t is not None and t["rmse"] is not None:
      line += (f"; <= half of per_tensor ({t['rmse']:.3e}): "
               f"{'yes' if h['rmse'] <= 0.5 * t['rmse'] else 'NO'} "
               f"(ratio {h['rmse'] / t['rmse']:.3f})")
    print(line)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=pathlib.Path, required=True,
                 help="JSON file to write (overwritten)")
  p.add_argument("--quick", action="store_true", help="T=S=512")
  p.add_argument("--seq", type=int, default=None,
                 help="T = S (default 4096; --quick 512)")
  p.add_argument("--no-causal", action="store_true",
                 help="non-causal only")
  p.add_argument("--no-sims", action="store_true",
                 help="skip the inputs_only_f64 rows")
  p.add_argument("--verbose", action="store_true")
  args = p.parse_args(argv)
  warnings.filterwarnings("ignore", category=DeprecationWarning)
  T = args.seq or (512 if args.quick else 4096)
  shape = (2, T, T, 8, 128)
  platform = jax.default_backend()
  device = jax.devices()[0].device_kind
  primary = "cuda" if platform == "gpu" else "xla"
  date = datetime.date.today().isoformat()
  print(f"device: {device} ({platform}), jax {jax.__version__}; B=2 T=S={T} "
        f"H=8 D=128; ours through {primary}"
        f"{' and xla (simulated)' if platform == 'gpu' else ''}", flush=True)
  rows = []
  args.out.parent.mkdir(parents=True, exist_ok=True)
  for dist in ("normal", "outliers_0.1pct"):
    for causal in ((False,) if args.no_causal else (False, True)):
      try:
        rows += study(dist, causal, shape, platform=platform, device=device,
                      date=date, sims=not args.no_sims, verbose=args.verbose)
      except Exception as e:
        print(f"  {dist} causal={causal}: {_err(e)}")
        if args.verbose:
          traceback.print_exc()
      args.out.write_text(json.dumps(rows, indent=1) + "\n")
  print(f"results written to {args.out}")
  if rows:
    print_table(rows, primary)
  return rows


if __name__ == "__main__":
  main()
