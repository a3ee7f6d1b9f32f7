"""Attention dropout timings (TFLOP/s) against cuDNN's dropout, one process.

    python benchmarks/bench_dropout.py --out benchmarks/results/h200_dropout.json
    python benchmarks/bench_dropout.py --quick --out /tmp/dropout_smoke.json  # CPU

Shapes (as the other H200 runs): B*T = 16384 tokens (B=2 at T=8192), H =
2048 / D (D=64: 32, D=128: 16, D=256: 8), H_kv = H, S = T, bf16; every D in
--dims, T in --seqs (default 8192), causal and not (--causal), modes fwd and
fwd_bwd (--modes), dropout rate --rate (default 0.1). --quick: B=1, T=S=128,
H=2 and a few iterations (a smoke test, nothing worth keeping); off a GPU
the xla backend stands in for the CUDA kernels (rows: implementation "xla",
stand_in true) and the cuDNN implementations are left out.

Implementations (--impls), timed side by side on the same random normal
inputs:
  jax_flash_cuda             jax_flash.attention(implementation="cuda",
                             dropout_rate=rate, dropout_rng=key)
  jax_flash_cuda_no_dropout  the same call without dropout (rate 0)
  cudnn_dropout              cuDNN's fused attention with dropout
                             (jax._src.cudnn.fused_attention_stablehlo.
                             dot_product_attention(dropout_rate=rate,
                             seed=SEED, mask_type=CAUSAL or NO_MASK,
                             scale=D**-0.5); its seed is a static int.
                             Its training forward: return_residual=True,
                             so fwd runs with is_training=True and writes
                             the softmax statistics, as jax_flash's forward
                             writes its LSE)
  cudnn_no_dropout           the same without dropout (not by default; with
                             it the cuDNN rows get their own dropout_cost)
  jax_flash_xla              jax_flash.attention(implementation="xla") with
                             dropout, for reference (not by default)
Default: jax_flash_cuda, jax_flash_cuda_no_dropout, cudnn_dropout.

The rates differ slightly: jax_flash realises rates in steps of 1/256
(0.1 -> 26/256 = 0.1016; rows carry `effective_rate`), cuDNN the rate given.
Both regenerate the mask in the backward from their key/seed.

Method: that of bench_attention.py (its make_step and time_interleaved):
fwd is the jitted call, fwd_bwd the gradient of sum(o * do) w.r.t. q, k, v;
every step warmed up, then --repeats rounds of --iters back-to-back calls
between two syncs, the implementations of a (shape, mode) timed round by
round in alternating order (A B C, C B A, ...), median of the rounds.
FLOPs: fwd 4*B*H*T*S*D, halved when causal; fwd_bwd 3.5x that (dropout's
own work is not counted). In fwd mode, after the timing, each dropout row
also gets `rel_diff_vs_no_dropout` = |o - o_no_dropout| / |o_no_dropout|
(Frobenius; o_no_dropout from jax_flash_cuda_no_dropout): about
sqrt(rate / (1 - rate)) when dropout is applied, 1e-2 or less (bf16 rounding)
when it is silently not.

Rows (one per implementation, shape and mode): impl, mode, dtype, B, T, S,
H, H_kv, D, causal, case ("dropout_rate=<rate>": a run's rate, so runs at
other rates are kept side by side), dropout_rate (the rate this
implementation applied: 0 for the no-dropout rows), effective_rate,
implementation (the backend that ran), stand_in, ms, tflops, and the peers'
figures from the same run: cudnn_tflops (cudnn_dropout), no_dropout_tflops
(jax_flash_cuda_no_dropout), speedup_vs_cudnn (tflops / cudnn_tflops),
dropout_cost (1 - tflops / the same implementation's no-dropout tflops:
jax_flash_cuda against jax_flash_cuda_no_dropout, cudnn_dropout against
cudnn_no_dropout when that ran); date, device, command, cudnn_version.
Every failure is recorded in its row (`error`) and the run goes on. With
--out, each (shape, mode)'s rows are merged into the JSON list as soon as
they are measured (bench_attention.merge_into: records with the same impl,
mode, dtype, B, T, S, H, H_kv, D, causal, case are replaced; a file holding
another device's records is refused). A table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
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

from jax_flash._src.core import dropout as dropout_core  # noqa: E402

DTYPE = "bfloat16"
SEED = 42  # the dropout key's seed (ours) and cuDNN's static seed
ALL_IMPLS = ("jax_flash_cuda", "jax_flash_cuda_no_dropout", "cudnn_dropout",
             "cudnn_no_dropout", "jax_flash_xla")
DEFAULT_IMPLS = ("jax_flash_cuda", "jax_flash_cuda_no_dropout",
                 "cudnn_dropout")
GPU_ONLY = {"cudnn_dropout", "cudnn_no_dropout"}
NO_DROPOUT = {"jax_flash_cuda_no_dropout", "cudnn_no_dropout"}
# each implementation's own no-dropout counterpart (for dropout_cost)
COUNTERPART = {"jax_flash_cuda": "jax_flash_cuda_no_dropout",
               "cudnn_dropout": "cudnn_no_dropout"}


def _err(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}"[:500]


# ---------------------------------------------------------------------------
# Implementations: name -> fn(q, k, v, causal) -> o, as bench_attention's
# ---------------------------------------------------------------------------


def _jax_flash(implementation, rate):
  key = jax.random.key(SEED)
  dropout = (dict(dropout_rate=rate, dropout_rng=key) if rate > 0 else {})

  def fn(q, k, v, causal):
    return jax_flash.attention(q, k, v, causal=causal,
                               implementation=implementation, **dropout)
  return fn


def cudnn_attention(q, k, v, causal, rate):
  """cuDNN's fused attention ([B, T, H, D]) with dropout at `rate`, its
  training forward: return_residual=True makes the forward alone run with
  is_training=True (the softmax statistics written, as jax_flash's forward
  always writes its LSE; the inference forward, is_training=False, is not
  what dropout is for). The statistics are dropped here; under jit the
  custom call computes them all the same."""
  from jax._src.cudnn.fused_attention_stablehlo import MaskType
  from jax._src.cudnn.fused_attention_stablehlo import \
      dot_product_attention as cudnn_dpa
  o, _ = cudnn_dpa(q, k, v, scale=q.shape[-1]**-0.5,
                   mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK,
                   seed=SEED, dropout_rate=rate, qkv_layout="BTNH",
                   return_residual=True)
  return o


def _cudnn(rate):
  return lambda q, k, v, causal: cudnn_attention(q, k, v, causal, rate)


def implementation_of(impl: str, platform: str) -> str:
  """The backend an implementation runs on: the jax_flash_cuda rows run on
  "xla" off a GPU (standing in, --quick on a CPU)."""
  if impl.startswith("cudnn"):
    return "cudnn"
  if impl == "jax_flash_xla":
    return "xla"
  return "cuda" if platform == "gpu" else "xla"


def applied_rate(impl: str, rate: float) -> float:
  return 0.0 if impl in NO_DROPOUT else rate


def build_fn(impl: str, rate: float, platform: str):
  r = applied_rate(impl, rate)
  backend = implementation_of(impl, platform)
  if backend == "cudnn":
    return _cudnn(r)
  return _jax_flash(backend, r)


# ---------------------------------------------------------------------------


def shapes_for(dims, seqs, causals, quick):
  shapes = []
  for D in dims:
    for T in seqs:
      for causal in causals:
        B, H = (1, 2) if quick else (max(1, 16384 // T), 2048 // D)
        shapes.append(ba.Shape(B, T, T, H, H, D, causal))
  return shapes


def _rel_diff(a, b) -> float:
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _base_row(impl, shape, mode, rate, platform, *, date, device, command):
  ours = implementation_of(impl, platform)
  r = applied_rate(impl, rate)
  return dict(
      impl=impl, mode=mode, dtype=DTYPE, B=shape.B, T=shape.T, S=shape.S,
      H=shape.H, H_kv=shape.H_kv, D=shape.D, causal=shape.causal,
      case=f"dropout_rate={rate:g}", dropout_rate=r,
      effective_rate=(r if ours == "cudnn" else
                      dropout_core.effective_rate(r)),
      implementation=ours,
      stand_in=impl.startswith("jax_flash_cuda") and ours != "cuda",
      ms=None, tflops=None, date=date, device=device, command=command)


def run_mode(shape, mode, impls, rate, platform, q, k, v, do, *, iters,
             repeats, warmup, date, device, command, verbose):
  """The rows of one (shape, mode): every implementation timed side by side
  (bench_attention.time_interleaved)."""
  steps, errors = {}, {}
  for impl in impls:
    try:
      step, binds = ba.make_step(build_fn(impl, rate, platform), mode,
                                 shape.causal, do)
      steps[impl] = (step, binds(q, k, v))
    except Exception as e:
      errors[impl] = e
      if verbose:
        traceback.print_exc()
  timed = ba.time_interleaved(steps, iters=iters, repeats=repeats,
                              warmup=warmup)
  timed.update(errors)
  checks = {}
  if mode == "fwd":  # dropout is applied: the outputs move by ~sqrt(r/(1-r))
    base = steps.get("jax_flash_cuda_no_dropout")
    if base is not None and not isinstance(
        timed.get("jax_flash_cuda_no_dropout"), Exception):
      try:
        o0 = base[0](*base[1])
        for impl, (step, args) in steps.items():
          if impl in NO_DROPOUT or isinstance(timed.get(impl), Exception):
            continue
          try:
            checks[impl] = {"rel_diff_vs_no_dropout": float(
                f"{_rel_diff(step(*args), o0):.4g}")}
          except Exception as e:
            checks[impl] = {"check_error": _err(e)}
        del o0
      except Exception as e:
        checks = {i: {"check_error": _err(e)} for i in steps}
  del steps  # the inputs bound to them, before the next mode
  rows = []
  for impl in impls:
    rec = _base_row(impl, shape, mode, rate, platform, date=date,
                    device=device, command=command)
    rec.update(checks.get(impl, {}))
    ms = timed.get(impl)
    if isinstance(ms, Exception):
      rec["error"] = _err(ms)
    elif ms is not None:
      rec["ms"] = float(f"{ms:.6g}")
      rec["tflops"] = float(f"{shape.flops(mode) / (ms * 1e-3) / 1e12:.6g}")
    rows.append(rec)
    status = (f"{ba.format_ms(rec['ms'])}  {ba.format_rate(rec['tflops'])}"
              if rec["ms"] is not None else rec.get("error", "?")[:150])
    print(f"  {shape.label():34s} {mode:7s} {impl:26s} {status}", flush=True)
  add_peers(rows)
  return rows


def add_peers(rows):
  """Each row gets the same run's cudnn_tflops, no_dropout_tflops,
  speedup_vs_cudnn and its own dropout_cost."""
  by = {r["impl"]: r.get("tflops") for r in rows}
  cudnn = by.get("cudnn_dropout")
  no_dropout = by.get("jax_flash_cuda_no_dropout")
  for r in rows:
    tf = r.get("tflops")
    r["cudnn_tflops"] = cudnn
    r["no_dropout_tflops"] = no_dropout
    r["speedup_vs_cudnn"] = round(tf / cudnn, 3) if tf and cudnn else None
    peer = by.get(COUNTERPART.get(r["impl"]))
    r["dropout_cost"] = round(1 - tf / peer, 4) if tf and peer else None
    if r["impl"] == "cudnn_dropout" or "cudnn_no_dropout" in by:
      r["cudnn_no_dropout_tflops"] = by.get("cudnn_no_dropout")


def make_inputs(shape, seed=0):
  q, k, v, do = ba.make_inputs(shape, jnp.dtype(DTYPE), seed)
  return jax.block_until_ready((q, k, v, do))


def run(shapes, modes, impls, rate, platform, *, iters, repeats, warmup,
        date, device, command, out=None, verbose=False, cudnn_version=None):
  records = []
  for shape in shapes:
    try:
      q, k, v, do = make_inputs(shape)
    except Exception as e:  # e.g. out of memory
      print(f"  {shape.label()}: {_err(e)}")
      rows = []
      for mode in modes:
        part = [dict(_base_row(i, shape, mode, rate, platform, date=date,
                               device=device, command=command),
                     error=_err(e)) for i in impls]
        add_peers(part)
        rows += part
      q = k = v = do = None
    else:
      rows = []
      for mode in modes:
        rows += run_mode(shape, mode, impls, rate, platform, q, k, v, do,
                         iters=iters, repeats=repeats, warmup=warmup,
                         date=date, device=device, command=command,
                         verbose=verbose)
    del q, k, v, do
    if cudnn_version is not None:
      for r in rows:
        r["cudnn_version"] = cudnn_version
    records += rows
    if out is not None:
      try:
        ba.merge_into(out, rows)
      except Exception as e:
        print(f"  could not merge into {out}: {_err(e)}")
  return records


def print_table(records):
  groups = {}
  for r in records:
    groups.setdefault((r["D"], r["T"], r["causal"], r["mode"], r["B"],
                       r["H"]), {})[r["impl"]] = r

  def tf(r):
    if r and r.get("tflops"):
      x = r["tflops"]
      return f"{x:.1f}" if x >= 1 else f"{x * 1e3:.3g}G"
    return "err" if r and r.get("error") else "-"

  def num(x, fmt):
    return format(x, fmt) if x is not None else "-"

  rates = sorted({r["case"] for r in records})
  stand_in = any(r.get("stand_in") for r in records)
  print(f"\nTFLOP/s ({DTYPE}; {', '.join(rates)}; G = GFLOP/s)"
        + ("; ours = the xla backend standing in (not on a GPU)"
           if stand_in else ""))
  print(f"{'D':>4s} {'T':>6s} {'causal':>6s} {'mode':>7s} {'ours':>8s} "
        f"{'ours r=0':>8s} {'cuDNN':>8s} {'ours/cuDNN':>10s} "
        f"{'drop cost':>9s} {'cuDNN cost':>10s}")
  for (D, T, causal, mode, _, _), g in sorted(groups.items()):
    ours = g.get("jax_flash_cuda") or {}
    cudnn = g.get("cudnn_dropout") or {}
    speedup = ours.get("speedup_vs_cudnn")
    print(f"{D:4d} {T:6d} {str(causal):>6s} {mode:>7s} "
          f"{tf(g.get('jax_flash_cuda')):>8s} "
          f"{tf(g.get('jax_flash_cuda_no_dropout')):>8s} "
          f"{tf(g.get('cudnn_dropout')):>8s} "
          f"{f'{speedup:.2f}x' if speedup else '-':>10s} "
          f"{num(ours.get('dropout_cost'), '.1%'):>9s} "
          f"{num(cudnn.get('dropout_cost'), '.1%'):>10s}")
  for r in records:
    if r.get("error"):
      print(f"  error D={r['D']} T={r['T']} causal={r['causal']} "
            f"{r['mode']} {r['impl']}: {r['error'][:160]}")
    if r.get("check_error"):
      print(f"  output check {r['impl']} D={r['D']}: {r['check_error'][:160]}")
  diffs = {}
  for r in records:
    if r.get("rel_diff_vs_no_dropout") is not None:
      diffs.setdefault(r["impl"], []).append(r["rel_diff_vs_no_dropout"])
  if diffs:
    print("  |o - o_no_dropout| / |o_no_dropout| in fwd (dropout applied: "
          "~sqrt(rate / (1 - rate)); not applied: <= 1e-2): " + ", ".join(
              f"{i} {min(d):.3g}..{max(d):.3g}" for i, d in diffs.items()))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=pathlib.Path,
                 help="merge the rows into this JSON list (default: write "
                 "nothing)")
  p.add_argument("--dims", default="64,128,256")
  p.add_argument("--seqs", default=None,
                 help="T values (default 8192; --quick: 128)")
  p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
  p.add_argument("--modes", default="fwd,fwd_bwd",
                 help="comma-separated from fwd, fwd_bwd")
  p.add_argument("--rate", type=float, default=0.1,
                 help="dropout rate (default 0.1)")
  p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                 help=f"comma-separated from {', '.join(ALL_IMPLS)}")
  p.add_argument("--iters", type=int, default=None,
                 help="back-to-back calls per round (default 100; quick 2)")
  p.add_argument("--repeats", type=int, default=None,
                 help="rounds per implementation (default 5; quick 2)")
  p.add_argument("--warmup", type=int, default=None,
                 help="warm-up calls (default 3; quick 1)")
  p.add_argument("--quick", action="store_true",
                 help="small shapes, few iterations: a smoke test")
  p.add_argument("--verbose", action="store_true",
                 help="print the traceback of a failing set-up")
  args = p.parse_args(argv)
  quick = args.quick
  iters = args.iters or (2 if quick else 100)
  repeats = args.repeats or (2 if quick else 5)
  warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
  seqs = [int(t) for t in (args.seqs or ("128" if quick else "8192"))
          .split(",")]
  dims = [int(d) for d in args.dims.split(",")]
  causals = {"both": (False, True), "yes": (True,), "no": (False,)}[
      args.causal]
  modes = [m for m in args.modes.split(",") if m]
  bad_modes = [m for m in modes if m not in ("fwd", "fwd_bwd")]
  if bad_modes:
    p.error(f"unknown --modes {bad_modes}; known: fwd, fwd_bwd")
  impls = [i for i in args.impls.split(",") if i]
  unknown = [i for i in impls if i not in ALL_IMPLS]
  if unknown:
    p.error(f"unknown --impls {unknown}; known: {', '.join(ALL_IMPLS)}")
  try:
    dropout_core.threshold(args.rate)
  except ValueError as e:
    p.error(str(e))
  if dropout_core.threshold(args.rate) == 0:
    p.error(f"--rate {args.rate} rounds to 0 (rates are steps of 1/256)")

  warnings.filterwarnings("ignore", category=DeprecationWarning)
  platform = jax.default_backend()
  device = jax.devices()[0].device_kind
  if platform != "gpu":
    skipped = [i for i in impls if i in GPU_ONLY]
    if skipped:
      print(f"not on a GPU: skipping {', '.join(skipped)}; jax_flash_cuda "
            "rows through implementation='xla' (stand_in)")
    impls = [i for i in impls if i not in skipped]
  if args.out is not None:  # refuse before timing, not after
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
        f"{cudnn}, {DTYPE}, dropout rate {args.rate:g} (ours: "
        f"{dropout_core.effective_rate(args.rate):.4g}), impls: "
        f"{', '.join(impls)}; iters {iters} x repeats {repeats}", flush=True)
  command = " ".join([os.path.basename(sys.argv[0])] +
                     (list(argv) if argv is not None else sys.argv[1:]))
  date = datetime.date.today().isoformat()
  records = run(shapes_for(dims, seqs, causals, quick), modes, impls,
                args.rate, platform, iters=iters, repeats=repeats,
                warmup=warmup, date=date, device=device, command=command,
                out=args.out, verbose=args.verbose, cudnn_version=cudnn)
  print(f"results merged into {args.out}" if args.out is not None else
        "results not written (pass --out FILE to keep them)")
  print_table(records)
  return records


if __name__ == "__main__":
  main()
