"""Side-by-side attention timings (TFLOP/s) in one process.

    python benchmarks/bench_attention.py                    # reference shape
    python benchmarks/bench_attention.py --sweep --plot sweep.png
    python benchmarks/bench_attention.py --shapes tiny      # CPU smoke test
    python benchmarks/bench_attention.py --preset mla       # DeepSeek MLA
    python benchmarks/bench_attention.py --preset sinks     # learnable sinks

Nothing is written unless --out names a file. The tracked H200 results are
benchmarks/results/h200.json: pass it as --out only on an H200 (a file whose
records come from another device is refused, so a CPU smoke test can never
mix its rows into it).

Implementations (--impls, comma separated):
  jax_flash_cuda     jax_flash.attention(implementation="cuda")
  jax_flash_cuda_det   the same with deterministic=True
  jax_flash_cuda_sinks the same with learnable sinks (sinks=[H])
  jax_flash_cuda_softcap the same with softcap=SOFTCAP (50, Gemma 2's)
  jax_flash_pallas   jax_flash.attention(implementation="pallas")
  jax_flash_pallas_sinks, jax_flash_xla_sinks   the same with sinks
  jax_flash_xla      jax_flash.attention(implementation="xla")
  cudnn              jax.nn.dot_product_attention(implementation="cudnn")
  xla                jax.nn.dot_product_attention(implementation="xla")
  jax_pallas_triton  jax.experimental.pallas.ops.gpu.attention.mha
  fa3                flash-attn3-jax's flash_mha
  tokamax            tokamax.dot_product_attention(implementation="mosaic")
Default: every one that can run on this platform (GPU: jax_flash_cuda,
jax_flash_pallas, cudnn, xla, jax_pallas_triton; CPU: jax_flash_pallas,
jax_flash_xla, xla). The peers (benchmarks/peers.py) get the same q, k, v;
one that refuses a shape (jax.nn for a value head dim of its own) is recorded
with its error, its TF/s field None.

Shapes: --shapes names a set (PRESETS); --dv N gives v and the output head
dim N on every shape (default: the set's, D but in mla). --preset NAME fills --shapes, --modes and
--impls for a study (RUN_PRESETS; options given on the command line win):
  mla    DeepSeek MLA, D=192, D_v=128, H=16, T=8192 (B=2) and 16384 (B=1),
         causal and not, fwd/bwd/fwd_bwd: jax_flash_cuda(_sinks), cudnn, tokamax
  sinks  the cost of sinks: D=64 (H=32) and 128 (H=16), T=4096 and 8192 at
         B*T=16k, fwd/bwd/fwd_bwd: jax_flash_cuda and jax_flash_cuda_sinks
  softcap  the cost of softcap: the sweep's D=64/128/256 at T=8192 (B=2),
         causal and not, fwd and fwd_bwd: jax_flash_cuda and
         jax_flash_cuda_softcap

Method: random normal inputs, jit, warm up, then N back-to-back
calls between two `block_until_ready` syncs, median over repeats; the
implementations of one shape and mode are timed round by round, in
alternating order (A B C, C B A, ...), so that clock / power drift and the
previous kernel's effect on the clock hit all of them alike; use --iters so
that a round lasts ~0.3 s or more for sustained figures. FLOPs:
fwd = 2*B*H*T*S*(D + D_v) (QK^T and PV; 4*B*H*T*S*D when D_v = D; halved
when causal), fwd_bwd = 3.5x fwd, where fwd_bwd is
the gradient of sum(o * do) w.r.t. q, k, v (forward included), bwd = 2.5x fwd:
the backward alone (the VJP applied to do, the forward's residuals computed
once before the timing). A failing
implementation is recorded with its error and the run goes on. With --out,
results are merged into a JSON list, replacing records with the same
(impl, mode, dtype, B, T, S, H, H_kv, D, D_v, causal; a record without D_v
has D_v = D); every record says D_v and whether sinks were on (`sinks`), and
carries the peers' TF/s of the same run (`cudnn_tflops`, and `fa3_tflops`,
`tokamax_tflops` when they ran) with its ratio to each; a table is printed last,
in TF/s, or GF/s below 1 TF/s (small shapes, CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp

try:
  import jax_flash
except ImportError:  # run from a checkout without installing
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import jax_flash

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import peers  # noqa: E402  (benchmarks/peers.py)

TRACKED_RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "h200.json"
KEY_FIELDS = ("impl", "mode", "dtype", "B", "T", "S", "H", "H_kv", "D",
              "D_v", "causal", "case")  # case: named packings (bench_packing.py)


@dataclasses.dataclass(frozen=True)
class Shape:
  B: int
  T: int
  S: int
  H: int
  H_kv: int
  D: int
  causal: bool
  D_v: int | None = None  # v's and the output's head dim; None: D

  def __post_init__(self):
    if self.D_v is None:
      object.__setattr__(self, "D_v", self.D)

  def flops(self, mode: str) -> float:
    f = 2.0 * self.B * self.H * self.T * self.S * (self.D + self.D_v)
    if self.causal:
      f /= 2
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]

  def label(self) -> str:
    kv = f"/{self.H_kv}" if self.H_kv != self.H else ""
    dv = f" Dv{self.D_v}" if self.D_v != self.D else ""
    return (f"B{self.B} T{self.T} S{self.S} H{self.H}{kv} D{self.D}{dv}"
            f"{' causal' if self.causal else ''}")

  @classmethod
  def of_record(cls, r):
    """The shape of a results record (one without D_v has D_v = D)."""
    return cls(r["B"], r["T"], r["S"], r["H"], r["H_kv"], r["D"], r["causal"],
               r.get("D_v"))


def _reference_shapes():
  return [Shape(2, 8192, 8192, 16, 16, 128, c) for c in (False, True)]


def _sweep_shapes():
  """D=64 (H=32), D=128 (H=16), D=256 (H=8); seq 512..16k at B*T = 16k."""
  shapes = []
  for D, H in ((64, 32), (128, 16), (256, 8)):
    for causal in (False, True):
      seq = 512
      while seq <= 16384:
        shapes.append(Shape(16384 // seq, seq, seq, H, H, D, causal))
        seq *= 2
  return shapes


def _mla_shapes():
  """DeepSeek MLA's head dims (D=192, D_v=128), H=16, B*T = 16k."""
  return [Shape(16384 // T, T, T, 16, 16, 192, c, D_v=128)
          for T in (8192, 16384) for c in (False, True)]


def _sinks_shapes():
  """D=64 (H=32) and D=128 (H=16), T=4096 and 8192 at B*T = 16k."""
  return [Shape(16384 // T, T, T, H, H, D, c)
          for D, H in ((64, 32), (128, 16)) for T in (4096, 8192)
          for c in (False, True)]


PRESETS = {
    "reference": _reference_shapes,
    "sweep": _sweep_shapes,
    "tiny": lambda: [Shape(1, 128, 128, 2, 2, 64, c) for c in (False, True)],
    "gqa": lambda: [Shape(2, 8192, 8192, 32, 8, 128, c) for c in (False,
                                                                    True)],
    "mla": _mla_shapes,
    "sinks": _sinks_shapes,
}

# --preset NAME: the options of a study, as if given on the command line
# (those that are given win).
RUN_PRESETS = {
    "mla": dict(shapes="mla", modes="fwd,bwd,fwd_bwd",
                impls="jax_flash_cuda,jax_flash_cuda_sinks,cudnn,tokamax"),
    "sinks": dict(shapes="sinks", modes="fwd,bwd,fwd_bwd",
                  impls="jax_flash_cuda,jax_flash_cuda_sinks"),
    "softcap": dict(shapes="sweep", seqs="8192", modes="fwd,fwd_bwd",
                    impls="jax_flash_cuda,jax_flash_cuda_softcap"),
}


# ---------------------------------------------------------------------------
# Implementations: name -> fn(q, k, v, causal) -> o   ([B, T, H, D] layout)
# ---------------------------------------------------------------------------


def _sinks(num_heads):
  """Learnable sinks, one logit per head, spread around the scores' range."""
  return jnp.linspace(-1.0, 2.0, num_heads, dtype=jnp.float32)


SOFTCAP = 50.0  # Gemma 2's attention logit cap


def _jax_flash(impl, *, sinks=False, softcap=None):
  """jax_flash.attention(implementation=impl); with sinks or softcap: timed
  beside the call without, their cost."""
  def fn(q, k, v, causal):
    return jax_flash.attention(q, k, v, causal=causal, implementation=impl,
                               sinks=_sinks(q.shape[2]) if sinks else None,
                               softcap=softcap)
  return fn


def _jax_flash_deterministic(q, k, v, causal):
  return jax_flash.attention(q, k, v, causal=causal, implementation="cuda",
                             deterministic=True)


IMPLS = {
    "jax_flash_cuda": _jax_flash("cuda"),
    "jax_flash_cuda_det": _jax_flash_deterministic,
    "jax_flash_cuda_sinks": _jax_flash("cuda", sinks=True),
    "jax_flash_cuda_softcap": _jax_flash("cuda", softcap=SOFTCAP),
    "jax_flash_pallas": _jax_flash("pallas"),
    "jax_flash_pallas_sinks": _jax_flash("pallas", sinks=True),
    "jax_flash_xla": _jax_flash("xla"),
    "jax_flash_xla_sinks": _jax_flash("xla", sinks=True),
    **peers.PEERS,
}


def default_impls(platform: str) -> list[str]:
  if platform != "gpu":
    return ["jax_flash_pallas", "jax_flash_xla", "xla"]
  impls = ["jax_flash_pallas", "cudnn", "xla", "jax_pallas_triton"]
  if "cuda" in jax_flash.available_implementations():
    impls.insert(0, "jax_flash_cuda")
  return impls


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def make_inputs(shape: Shape, dtype, seed=0):
  """q, k, v and the output's cotangent do (head dim D_v, as the output)."""
  kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (shape.B, shape.T, shape.H, shape.D), dtype)
  k = jax.random.normal(kk, (shape.B, shape.S, shape.H_kv, shape.D), dtype)
  v = jax.random.normal(kv, (shape.B, shape.S, shape.H_kv, shape.D_v), dtype)
  do = jax.random.normal(kd, (shape.B, shape.T, shape.H, shape.D_v), dtype)
  return q, k, v, do


def make_step(fn, mode: str, causal: bool, do):
  """-> (step, binds): step(*binds(q, k, v)) runs the timed work."""
  if mode == "fwd":
    return jax.jit(lambda q, k, v: fn(q, k, v, causal)), lambda *qkv: qkv
  if mode == "bwd":
    # The VJP closure (a pytree holding the forward's residuals) is an
    # argument, so the jitted step runs the backward kernels only.
    def binds(q, k, v):
      _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal), q, k, v)
      return vjp, do
    return jax.jit(lambda vjp, do: vjp(do)), binds

  def loss(q, k, v):
    o = fn(q, k, v, causal)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), lambda *qkv: qkv


def _timed_round(step, args, iters: int) -> float:
  """ms per call of `iters` back-to-back calls between two syncs."""
  jax.block_until_ready(args)
  t0 = time.perf_counter()
  out = None
  for _ in range(iters):
    out = step(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) * 1e3 / iters


def time_ms(step, args, *, iters: int, repeats: int, warmup: int) -> float:
  """One implementation alone: warm-up, then the median of `repeats` rounds."""
  for _ in range(warmup):
    jax.block_until_ready(step(*args))
  return statistics.median(_timed_round(step, args, iters) for _ in range(repeats))


def time_interleaved(steps, *, iters: int, repeats: int, warmup: int):
  """{name: median ms} for several (step, args), the implementations timed
  round by round rather than one after another, so that a clock or power
  drift during the run hits all of them alike; the order alternates (A B C,
  C B A, A B C, ...) because a kernel's clock also depends on what ran just
  before it (a 4-way run with cuDNN always after the lighter Pallas kernel
  favoured cuDNN by ~8%, benchmarks/NOTES.md). Every step is warmed up
  first; a step that raises is reported as that exception."""
  ready, result = {}, {}
  for name, (step, args) in steps.items():
    try:
      for _ in range(warmup):
        jax.block_until_ready(step(*args))
      ready[name] = (step, args)
    except Exception as e:  # one failure must not end the run
      result[name] = e
  samples = {name: [] for name in ready}
  order = list(ready)
  for r in range(repeats):
    for name in (order if r % 2 == 0 else order[::-1]):
      step, args = ready[name]
      samples[name].append(_timed_round(step, args, iters))
  for name, ms in samples.items():
    result[name] = statistics.median(ms)
  return result


def run(impls, shapes, modes, dtype_name, *, iters, repeats, warmup,
        command, device, out=None):
  """Times every (shape, mode, impl), the impls of a (shape, mode)
  interleaved (time_interleaved); with `out`, merges each shape/mode's rows
  into that file as soon as they are measured (a run cut short by a time
  limit keeps what it measured)."""
  dtype = jnp.dtype(dtype_name)
  date = datetime.date.today().isoformat()
  records = []
  for shape in shapes:
    q, k, v, do = make_inputs(shape, dtype)
    for mode in modes:
      steps, errors = {}, {}
      for impl in impls:
        try:
          step, binds = make_step(IMPLS[impl], mode, shape.causal, do)
          steps[impl] = (step, binds(q, k, v))
        except Exception as e:
          errors[impl] = e
      timed = time_interleaved(steps, iters=iters, repeats=repeats,
                               warmup=warmup)
      timed.update(errors)
      rows = []
      for impl in impls:
        rec = dict(impl=impl, mode=mode, dtype=dtype.name, B=shape.B,
                   T=shape.T, S=shape.S, H=shape.H, H_kv=shape.H_kv,
                   D=shape.D, D_v=shape.D_v, causal=shape.causal,
                   sinks=impl.endswith("_sinks"),
                   softcap=SOFTCAP if impl.endswith("_softcap") else None,
                   ms=None, tflops=None,
                   date=date, command=command, device=device)
        ms = timed[impl]
        if isinstance(ms, Exception):
          rec["error"] = f"{type(ms).__name__}: {ms}"[:500]
        else:
          rec.update(ms=float(f"{ms:.6g}"),
                     tflops=float(f"{shape.flops(mode) / (ms * 1e-3) / 1e12:.6g}"))
        rows.append(rec)
        status = (f"{format_ms(rec['ms'])}  {format_rate(rec['tflops'])}"
                  if rec["ms"] is not None else rec["error"][:120])
        print(f"  {shape.label():36s} {mode:7s} {impl:22s} {status}",
              flush=True)
      del steps  # the bwd residuals of every impl
      add_peer_fields(rows)
      records += rows
      if out is not None:
        merge_into(out, rows)
  return records


def add_peer_fields(rows):
  """Gives every row of one (shape, mode) the reference peers' TF/s and its
  ratio to each: cuDNN's always (None where it did not run or refused the
  shape), the others' where they were among the impls (None if they failed)."""
  for impl, tflops_field, ratio_field in peers.REFERENCE_PEERS:
    peer = next((r for r in rows if r["impl"] == impl), None)
    if peer is None and impl != "cudnn":
      continue
    theirs = peer["tflops"] if peer is not None else None
    for r in rows:
      r[tflops_field] = theirs
      r[ratio_field] = (round(r["tflops"] / theirs, 3)
                        if theirs and r["tflops"] else None)


# ---------------------------------------------------------------------------
# Results file, table, plot
# ---------------------------------------------------------------------------


def format_rate(tflops: float) -> str:
  """TF/s with one decimal, or GF/s when below 1 TF/s (tiny shapes, CPU)."""
  if tflops >= 1:
    return f"{tflops:.1f} TF/s"
  return f"{tflops * 1e3:.3g} GF/s"


def format_ms(ms: float) -> str:
  return f"{ms:.3f} ms" if ms >= 0.1 else f"{ms * 1e3:.1f} us"


def _key(r):
  """A record's identity; a record without D_v (older rows, the other
  benchmarks) has D_v = D."""
  return tuple(r.get(f, r.get("D")) if f == "D_v" else r.get(f)
               for f in KEY_FIELDS)


class OtherDeviceError(ValueError):
  """The results file holds another device's measurements."""


def _check_device(path, old, device):
  theirs = {r.get("device") for r in old} - {None}
  if theirs and device not in theirs:
    raise OtherDeviceError(
        f"{path} holds results of {', '.join(sorted(theirs))}, not of "
        f"{device}: pass another --out (e.g. one named after the device)")


def check_same_device(path: pathlib.Path, device: str):
  """Raises OtherDeviceError if `path` holds results of another device."""
  if path.exists():
    try:
      _check_device(path, json.loads(path.read_text()), device)
    except (json.JSONDecodeError, OSError):
      pass  # merge_into warns and starts afresh


def merge_into(path: pathlib.Path, records):
  """Merges `records` into the JSON list at `path`. Refuses (OtherDeviceError)
  when the file already holds records of another device, so that, e.g., a
  CPU run never lands in the H200 results."""
  old = []
  if path.exists():
    try:
      old = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError) as e:
      print(f"warning: could not read {path} ({e}); starting afresh")
  for device in {r.get("device") for r in records} - {None}:
    _check_device(path, old, device)
  new_keys = {_key(r) for r in records}
  merged = [r for r in old if _key(r) not in new_keys] + list(records)
  merged.sort(key=lambda r: tuple(str(x) for x in _key(r)))
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(merged, indent=1) + "\n")


def print_table(records):
  """One line per record; ratios to cuDNN, and to tokamax where it ran."""
  peers_shown = [("cudnn", "vs cuDNN")]
  if any("ratio_vs_tokamax" in r for r in records):
    peers_shown.append(("tokamax", "vs tokamax"))
  print()
  print(f"{'shape':42s} {'mode':7s} {'impl':22s} {'time':>11s} {'rate':>12s} "
        + " ".join(f"{title:>10s}" for _, title in peers_shown))
  for r in records:
    head = f"{Shape.of_record(r).label():42s} {r['mode']:7s} {r['impl']:22s}"
    if r["ms"] is None:
      print(f"{head} {'failed':>9s}  {r['error'][:60]}")
      continue
    ratios = [f"{r[f'ratio_vs_{peer}']:.2f}x"
              if r.get(f"ratio_vs_{peer}") else "-" for peer, _ in peers_shown]
    print(f"{head} {format_ms(r['ms']):>11s} {format_rate(r['tflops']):>12s} "
          + " ".join(f"{x:>10s}" for x in ratios))


def plot_sweep(records, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed; no plot")
    return
  panels = sorted({(r["D"], r.get("D_v", r["D"]), r["causal"], r["mode"])
                   for r in records})
  if not panels:
    return
  cols = 4
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows),
                           squeeze=False)
  for ax, (D, D_v, causal, mode) in zip(axes.flat, panels):
    sel = [r for r in records if (r["D"], r.get("D_v", r["D"]), r["causal"],
                                  r["mode"]) == (D, D_v, causal, mode)
           and r["tflops"]]
    for impl in sorted({r["impl"] for r in sel}):
      pts = sorted((r["T"], r["tflops"]) for r in sel if r["impl"] == impl)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
              label=impl)
    ax.set_xscale("log", base=2)
    dv = f", D_v={D_v}" if D_v != D else ""
    ax.set_title(f"{mode}, D={D}{dv}{', causal' if causal else ''}",
                 fontsize=9)
    ax.set_xlabel("seq (B*T = 16k)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"plot: {path}")


# ---------------------------------------------------------------------------


def _selected_shapes(args):
  shapes = PRESETS["sweep" if args.sweep else args.shapes]()
  if args.dims:
    shapes = [s for s in shapes if s.D in {int(d) for d in
                                            args.dims.split(",")}]
  if args.seqs:
    shapes = [s for s in shapes if s.T in {int(t) for t in
                                            args.seqs.split(",")}]
  if args.causal != "both":
    shapes = [s for s in shapes if s.causal == (args.causal == "yes")]
  if args.dv is not None:
    shapes = [dataclasses.replace(s, D_v=args.dv) for s in shapes]
  return shapes


def replot(args):
  if not args.plot or not args.out:
    raise SystemExit("--replot needs --plot PATH and --out RESULTS.json "
                     "(the records to plot)")
  shapes = set(_selected_shapes(args))
  impls = set(args.impls.split(",")) if args.impls else None
  modes = set(args.modes.split(","))
  records = [r for r in json.loads(args.out.read_text())
             if Shape.of_record(r) in shapes and r["mode"] in modes
             and r["dtype"] == args.dtype
             and (impls is None or r["impl"] in impls)]
  plot_sweep(records, args.plot)


def parse_args(argv=None):
  """-> (parser, options), a --preset's values filled in where the command
  line gives none."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--impls", help="comma-separated; default: all that can "
                 f"run here. Known: {', '.join(IMPLS)}")
  p.add_argument("--shapes", default="reference",
                 help=f"preset: {', '.join(PRESETS)}")
  p.add_argument("--sweep", action="store_true",
                 help="the seq/head-dim sweep (same as --shapes sweep)")
  p.add_argument("--preset", choices=RUN_PRESETS,
                 help="a study's --shapes, --modes and --impls (those given "
                 "win): " + "; ".join(
                     f"{name}: " + " ".join(f"--{k} {v}" for k, v in o.items())
                     for name, o in RUN_PRESETS.items()))
  p.add_argument("--dims", help="only these head dims, e.g. 128 or 64,256")
  p.add_argument("--seqs", help="only these T, e.g. 4096,8192")
  p.add_argument("--dv", type=int,
                 help="value (and output) head dim; default: the shape's "
                 "(D, or the preset's, e.g. 128 for --shapes mla)")
  p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
  p.add_argument("--modes", default="fwd,fwd_bwd",
                 help="comma-separated from fwd, bwd, fwd_bwd")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--iters", type=int, default=20,
                 help="back-to-back calls per timing (>= 20 for results)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--out", type=pathlib.Path,
                 help="merge the results into this JSON file (default: write "
                 "nothing); the tracked H200 results are "
                 f"{TRACKED_RESULTS.relative_to(TRACKED_RESULTS.parents[2])}")
  p.add_argument("--plot", type=pathlib.Path,
                 help="PNG of TFLOP/s against seq (for the sweep)")
  p.add_argument("--replot", action="store_true",
                 help="no timing: plot --plot from the records in --out "
                 "that match the shapes, --impls and --modes")
  args = p.parse_args(argv)
  if args.preset:  # the preset's values become defaults: given options win
    p.set_defaults(**RUN_PRESETS[args.preset])
    args = p.parse_args(argv)
  return p, args


def main(argv=None):
  p, args = parse_args(argv)
  if args.replot:
    return replot(args)

  warnings.filterwarnings("ignore", category=DeprecationWarning)
  platform = jax.default_backend()
  device = jax.devices()[0].device_kind
  impls = (args.impls.split(",") if args.impls else default_impls(platform))
  unknown = [i for i in impls if i not in IMPLS]
  if unknown:
    p.error(f"unknown --impls {unknown}; known: {', '.join(IMPLS)}")
  if platform != "gpu":
    skipped = [i for i in impls if i.startswith("jax_flash_cuda")
               or i in peers.GPU_ONLY]
    if skipped:
      print(f"not on a GPU: skipping {', '.join(skipped)}")
    impls = [i for i in impls if i not in skipped]
  preset = "sweep" if args.sweep else args.shapes
  if preset not in PRESETS:
    p.error(f"unknown --shapes {preset!r}; known: {', '.join(PRESETS)}")
  shapes = _selected_shapes(args)
  modes = args.modes.split(",")
  command = " ".join([os.path.basename(sys.argv[0] if argv is None else
                                        __file__)]
                      + (sys.argv[1:] if argv is None else list(argv)))
  print(f"device: {device} ({platform}), jax {jax.__version__}, "
        f"{args.dtype}, impls: {', '.join(impls)}")
  if args.out is not None:  # refuse before timing, not after
    try:
      check_same_device(args.out, device)
    except OtherDeviceError as e:
      p.error(str(e))

  records = run(impls, shapes, modes, args.dtype, iters=args.iters,
                repeats=args.repeats, warmup=args.warmup, command=command,
                device=device, out=args.out)
  print(f"results merged into {args.out}" if args.out is not None else
        "results not written (pass --out FILE to keep them)")
  if args.plot:
    plot_sweep(records, args.plot)
  print_table(records)
  return records


if __name__ == "__main__":
  main()
