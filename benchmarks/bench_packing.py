"""Packed sequences side by side (ms, useful TF/s) in one process.

    python benchmarks/bench_packing.py                       # both cases
    python benchmarks/bench_packing.py --out benchmarks/results/h200.json

Cases (bf16, H=16 query heads on --kv-heads KV heads, D=128, each mask of
--masks: causal and/or none):
  packed_8x1k   B=2 rows of T=8192, each 8 documents of 1,024 tokens, as
                segment ids (jax_flash.attention) and as varlen offsets
                (jax_flash.varlen_attention, flash-attn3-jax's
                flash_mha_varlen), against the same documents as a batch
                of 16 x 1,024 (batched_ms).
  mixed_40      40 sequences of long-tailed lengths (seeded log-normal, at
                most 4,096, summing to 16,384 tokens): varlen, the same packing as segment ids
                (B=1, T=16,384), and flash_mha_varlen (fa3_varlen_ms).
  mixed_40_6k   40 sequences, heavier tail (sigma 2.4): 13 .. 6,000 tokens.
  mixed_23_6k   23 sequences (sigma 2.0): 375 .. 6,000 tokens.
Every varlen case runs varlen_attention three ways in one process:
jax_flash_cuda_varlen (the defaults: the per-sequence sm90 forward, the packed
backward), jax_flash_cuda_varlen_packed (JAX_FLASH_VARLEN_KERNEL=0: the packed
segment-id kernels both ways) and jax_flash_cuda_varlen_kernel
(JAX_FLASH_VARLEN_BWD_KERNEL=1 too: the per-sequence forward and backward).
Modes: fwd, fwd_bwd (gradient of sum(o * do) w.r.t. q, k, v).

Useful FLOPs count each sequence on its own: 4 * H * D * l^2 / 2 per causal
sequence of l tokens (4 * H * D * l^2 without a mask) (x3.5 for fwd_bwd), whatever the packing. Timing as
bench_attention.py: warm-up, rounds of --iters back-to-back calls between two
syncs (>= 100: the card runs at its power cap), the implementations of a case
interleaved round by round in alternating order, median of --repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402

jax_flash = ba.jax_flash
H, D = 16, 128


def mixed_lengths(n=40, total=16384, cap=4096, seed=0, floor=1, sigma=1.2):
  """n long-tailed lengths (seeded log-normal; at least `floor`, at most
  `cap`) summing to `total`."""
  rng = np.random.default_rng(seed)
  w = rng.lognormal(0.0, sigma, n)
  lens = np.maximum(floor, np.floor(w / w.sum() * total)).astype(int)
  while lens.max() > cap:  # cut the longest, spread the excess over the rest
    i = int(np.argmax(lens))
    extra, lens[i] = lens[i] - cap, cap
    lens[np.arange(n) != i] += extra // (n - 1)
  lens[np.argmin(lens)] += total - lens.sum()
  return [int(x) for x in lens]


CASE_ROWS = {"packed_8x1k": 2}  # rows of the segment-id form; others 1


def case_lengths(name):
  """The documents' lengths of a named case."""
  return {"packed_8x1k": lambda: [1024] * 16,
          "mixed_40": mixed_lengths,
          "mixed_40_6k": lambda: mixed_lengths(cap=6000, seed=2, floor=8,
                                               sigma=2.4),
          "mixed_23_6k": lambda: mixed_lengths(23, cap=6000, seed=3, floor=8,
                                               sigma=2.0)}[name]()


def useful_flops(lens, mode, causal=True):
  f = sum(4.0 * H * D * l * l / (2 if causal else 1) for l in lens)
  return f * {"fwd": 1.0, "fwd_bwd": 3.5}[mode]


def _fa3():
  try:
    from flash_attn3_jax import flash_mha_varlen
    return flash_mha_varlen
  except Exception as e:  # noqa: BLE001 - report why the peer is absent
    print(f"flash-attn3-jax unavailable: {type(e).__name__}: {e}")
    return None


@contextlib.contextmanager
def _varlen_knobs(fwd: bool | None, bwd: bool | None):
  """JAX_FLASH_VARLEN_KERNEL / _BWD_KERNEL while a call is traced
  (varlen_attention reads them then); None: the default."""
  knobs = {"JAX_FLASH_VARLEN_KERNEL": fwd, "JAX_FLASH_VARLEN_BWD_KERNEL": bwd}
  old = {n: os.environ.get(n) for n in knobs}
  for n, on in knobs.items():
    if on is None:
      os.environ.pop(n, None)
    else:
      os.environ[n] = "1" if on else "0"
  try:
    yield
  finally:
    for n, value in old.items():
      if value is None:
        os.environ.pop(n, None)
      else:
        os.environ[n] = value


def impls_for(case, lens, rows, causal=True):
  """{name: (fn(q, k, v) -> o, layout)}; layout 'packed' [total, H, D] or
  'rows' [rows, total / rows, H, D] or 'batch' [n, l, H, D]."""
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  lmax = max(lens)
  T = sum(lens) // rows
  seg = np.concatenate([np.full(l, i, np.int32) for i, l in enumerate(lens)])
  seg = jnp.asarray(seg.reshape(rows, T))

  def varlen(fwd, bwd):
    def fn(q, k, v):
      with _varlen_knobs(fwd, bwd):
        return jax_flash.varlen_attention(
            q, k, v, cu, cu, max_seqlen_q=lmax, max_seqlen_k=lmax,
            causal=causal, implementation="cuda")
    return fn
  out = {
      "jax_flash_cuda_segment_ids": (lambda q, k, v: jax_flash.attention(
          q, k, v, causal=causal, segment_ids=seg, implementation="cuda"),
                                     "rows"),
      "jax_flash_cuda_varlen": (varlen(None, None), "packed"),
      "jax_flash_cuda_varlen_packed": (varlen(False, False), "packed"),
      "jax_flash_cuda_varlen_kernel": (varlen(True, True), "packed"),
  }
  fa3 = _fa3()
  if fa3 is not None:
    out["fa3_varlen"] = (lambda q, k, v: fa3(
        q, k, v, cu, cu, max_seqlen_q=lmax, max_seqlen_k=lmax,
        is_causal=causal), "packed")
  if len(set(lens)) == 1:
    out["jax_flash_cuda_batched"] = (lambda q, k, v: jax_flash.attention(
        q, k, v, causal=causal, implementation="cuda"), "batch")
  return out


def _layout(x, layout, lens, rows):
  if layout == "packed":
    return x
  if layout == "rows":
    return x.reshape(rows, -1, *x.shape[1:])
  return x.reshape(len(lens), lens[0], *x.shape[1:])


def _step(fn, layout, mode, lens, rows, do):
  def f(q, k, v):
    o = fn(*(_layout(x, layout, lens, rows) for x in (q, k, v)))
    return o.reshape(-1, H, D)
  if mode == "fwd":
    return jax.jit(f)

  def loss(q, k, v):
    return jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def run(cases, modes, *, iters, repeats, warmup, command, device, out=None,
        masks=("causal",), kv_heads=H):
  date = datetime.date.today().isoformat()
  records = []
  for (case, lens, rows), causal in ((c, m == "causal") for c in cases
                                     for m in masks):
    total = sum(lens)
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(x, (total, H, D), jnp.bfloat16)
             for x in (kq, kd))
    k, v = (jax.random.normal(x, (total, kv_heads, D), jnp.bfloat16)
            for x in (kk, kv))
    impls = impls_for(case, lens, rows, causal)
    for mode in modes:
      steps = {}
      for name, (fn, layout) in impls.items():
        steps[name] = (_step(fn, layout, mode, lens, rows, do), (q, k, v))
      timed = ba.time_interleaved(steps, iters=iters, repeats=repeats,
                                  warmup=warmup)
      ms_of = lambda n: (float(f"{timed[n]:.6g}")
                         if isinstance(timed.get(n), float) else None)
      rows_out = []
      for name in impls:
        ms = timed[name]
        rec = dict(impl=name, mode=mode, case=case, dtype="bfloat16",
                   B=1 if name.endswith("varlen") else
                   (len(lens) if name.endswith("batched") else rows),
                   T=total, S=total, H=H, H_kv=kv_heads, D=D, causal=causal,
                   num_seqs=len(lens), max_seqlen=max(lens), ms=None,
                   tflops=None, date=date, command=command, device=device)
        if name.endswith("batched"):
          rec.update(T=lens[0], S=lens[0])
        elif not name.endswith("varlen"):
          rec.update(T=total // rows, S=total // rows)
        if isinstance(ms, Exception):
          rec["error"] = f"{type(ms).__name__}: {ms}"[:500]
        else:
          rec.update(ms=float(f"{ms:.6g}"), tflops=float(
              f"{useful_flops(lens, mode, causal) / (ms * 1e-3) / 1e12:.6g}"))
        rec["batched_ms"] = ms_of("jax_flash_cuda_batched")
        rec["fa3_varlen_ms"] = ms_of("fa3_varlen")
        rec["varlen_ms"] = ms_of("jax_flash_cuda_varlen")
        rows_out.append(rec)
        status = (f"{ba.format_ms(rec['ms'])}  {ba.format_rate(rec['tflops'])}"
                  if rec["ms"] is not None else rec["error"][:120])
        mask = "causal" if causal else "none"
        print(f"  {case:12s} {mask:6s} {mode:7s} {name:28s} {status}",
              flush=True)
      records += rows_out
      if out is not None:
        ba.merge_into(out, rows_out)
  return records


def _mask(r):
  return "causal" if r["causal"] else "none"


def print_table(records):
  print()
  print(f"{'case':12s} {'mask':6s} {'mode':7s} {'impl':28s} {'ms':>9s} {'TF/s':>7s} "
        f"{'vs batched':>10s} {'vs FA3':>7s} {'vs varlen':>9s}")
  for r in records:
    if r["ms"] is None:
      print(f"{r['case']:12s} {_mask(r):6s} {r['mode']:7s} {r['impl']:28s} failed: "
            f"{r['error'][:50]}")
      continue
    rel = lambda key: (f"{r[key] / r['ms']:.2f}x" if r.get(key) else "-")
    print(f"{r['case']:12s} {_mask(r):6s} {r['mode']:7s} {r['impl']:28s} {r['ms']:9.4f} "
          f"{r['tflops']:7.1f} {rel('batched_ms'):>10s} "
          f"{rel('fa3_varlen_ms'):>7s} {rel('varlen_ms'):>9s}")
  print("(ratios: the other's time / this one's, > 1 = this one faster)")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cases", default="packed_8x1k,mixed_40")
  p.add_argument("--modes", default="fwd,fwd_bwd")
  p.add_argument("--iters", type=int, default=200)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--masks", default="causal",
                 help="comma-separated: causal, none")
  p.add_argument("--kv-heads", type=int, default=H,
                 help=f"KV heads (GQA; {H} query heads)")
  p.add_argument("--out", type=pathlib.Path)
  a = p.parse_args(argv)
  cases = [(c, case_lengths(c), CASE_ROWS.get(c, 1))
           for c in a.cases.split(",")]
  device = jax.devices()[0].device_kind
  command = "python benchmarks/bench_packing.py " + " ".join(argv or
                                                             sys.argv[1:])
  if a.out is not None:
    ba.check_same_device(a.out, device)
  for name, lens, _ in cases:
    if name.startswith("mixed"):
      print(f"{name} lengths: {lens}")
  records = run(cases, a.modes.split(","), iters=a.iters, repeats=a.repeats,
                warmup=a.warmup, command=command.strip(), device=device,
                out=a.out, masks=a.masks.split(","), kv_heads=a.kv_heads)
  print_table(records)


if __name__ == "__main__":
  main()
