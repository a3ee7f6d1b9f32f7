"""KV-cache decoding side by side: achieved K+V read bandwidth in one process.

    python benchmarks/bench_decode.py                        # the four shapes
    python benchmarks/bench_decode.py --out benchmarks/results/h200.json
    # bf16 and FP8 caches side by side (speedup column), two shapes:
    python benchmarks/bench_decode.py --shapes b8_s32k_t1,b1_s128k_t1 \
        --contiguous-only
    # where a chunk of new tokens should leave the decoding kernels:
    python benchmarks/bench_decode.py --prefill-sweep --out benchmarks/results/h200.json

Shapes (bf16, D=128, every sequence's cache full; 32 query heads on 8 KV
heads unless named): B=8 S=32k T_new=1, B=1 S=128k T_new=1, B=64 S=4k
T_new=1, B=8 S=32k T_new=8, B=16 S=16k T_new=1 with 64 query heads on 8
(b16_h64_s16k_t1), B=4 S=64k T_new=4 with 32 query heads on 4 (b4_kv4_s64k_t4);
each contiguous and paged (page size 64, pages shuffled).

Implementations: jax_flash.attention_with_kvcache (the CUDA decoding kernels,
split count from their policy), cuDNN through jax.nn.dot_product_attention
(key_value_seq_lengths; contiguous only), flash-attn3-jax's
flash_mha_with_kvcache with num_splits 8 and with the split count our policy
picks (the better of the two is its figure). T_new > 1: causal, aligned to the
end, for jax_flash and FA3; cuDNN's is_causal aligns to the start, so it runs
unmasked there (the bytes read are the same).

Bandwidth = bytes of K and V read (B * S * H_kv * D * 2 tensors * 2 bytes)
/ time; jax_flash_cuda_fp8 reads the same cache quantised to e4m3 (one byte
per element and a float32 descale per key and head), counted as those bytes. Timing as bench_attention.py: warm-up, rounds of --iters
back-to-back calls between two syncs, implementations interleaved round by
round in alternating order, median of --repeats.

--prefill-sweep: the two routes of `attention_with_kvcache` for a chunk of
T_new new tokens, side by side: the decoding kernels and the dense path
(`attention(..., kv_seq_lengths=)`, the dense forward kernels), each forced
by setting decode/cuda.py's PREFILL_MIN_TOKENS to T_new (kernels) or 0
(dense) while the call is traced (implementation="cuda" on a GPU, so that a
route that cannot run raises rather than falling back). T_new in --t-new
(1, 2, 4, ..., 512) at each of --prefill-shapes (B x S: 8 x 32k and
1 x 128k), bf16, H=32 on H_kv=8, D=128, causal, a contiguous cache whose
every sequence is full (its S - T_new older keys and the T_new new ones:
no k_new, as writing them costs both routes the same and an undonated cache
would be copied whole by each call). Same timing as above. It prints T_new,
the microseconds of each route and the faster one, then the largest T_new up
to which the decoding kernels are at least as fast at every shape and every
smaller T_new: that is the value for PREFILL_MIN_TOKENS (chunks of more
tokens go to the dense path). When the routes cross between two points of
the sweep, time the gap (e.g. --t-new 64,80,96,112,128) and take the last
T_new the kernels win. With --out: one row per shape, T_new and route, `case`
prefill_route_b{B}_s{S}_t{T_new}_{route}, mode "prefill_route", `route`,
`T_new`, `us`, both routes' `decode_kernels_us` and `dense_us`, `faster`,
and the PREFILL_MIN_TOKENS in force (`prefill_min_tokens`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402

jax_flash = ba.jax_flash
H, H_KV, D = 32, 8, 128
SHAPES = {  # name: (B, S, T_new, H, H_kv)
    "b8_s32k_t1": (8, 32768, 1, H, H_KV),
    "b1_s128k_t1": (1, 131072, 1, H, H_KV),
    "b64_s4k_t1": (64, 4096, 1, H, H_KV),
    "b8_s32k_t8": (8, 32768, 8, H, H_KV),
    "b16_h64_s16k_t1": (16, 16384, 1, 64, 8),
    "b4_kv4_s64k_t4": (4, 65536, 4, 32, 4),
}
PAGE = 64


def _fa3():
  try:
    from flash_attn3_jax import flash_mha_with_kvcache
    return flash_mha_with_kvcache
  except Exception as e:  # noqa: BLE001 - report why the peer is absent
    print(f"flash-attn3-jax unavailable: {type(e).__name__}: {e}")
    return None


def inputs(B, S, T, paged, seed=0, heads=H, kv_heads=H_KV):
  """(q, k_cache, v_cache, seqlens, page_table or None), random bf16."""
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (B, T, heads, D), jnp.bfloat16)
  if paged:
    n = S // PAGE
    shape = (B * n, PAGE, kv_heads, D)
    table = jnp.asarray(np.random.default_rng(seed).permutation(B * n)
                        .reshape(B, n).astype(np.int32))
  else:
    shape, table = (B, S, kv_heads, D), None
  k = jax.random.normal(kk, shape, jnp.bfloat16)
  v = jax.random.normal(kv, shape, jnp.bfloat16)
  return q, k, v, jnp.full((B,), S, jnp.int32), table


def impls_for(B, S, T, paged, ours_splits, split_sweep=()):
  """{name: fn(q, k, v, seqlens, table) -> o}."""
  causal = T > 1
  out = {"jax_flash_cuda": lambda q, k, v, s, t: jax_flash.attention_with_kvcache(
      q, k, v, s, page_table=t, causal=causal, implementation="cuda"),
         # The same cache in e4m3 (quantised outside the timed call).
         "jax_flash_cuda_fp8": lambda q, k, v, s, t: jax_flash.attention_with_kvcache(
             q, k, v, s, page_table=t, causal=causal, implementation="cuda")}
  for n in split_sweep:  # the split policy's alternatives
    out[f"jax_flash_cuda_splits{n}"] = (
        lambda q, k, v, s, t, n=n: jax_flash.attention_with_kvcache(
            q, k, v, s, page_table=t, causal=causal, num_splits=n,
            implementation="cuda"))
  if not paged:
    out["cudnn"] = lambda q, k, v, s, t: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=s, implementation="cudnn")
  fa3 = _fa3()
  if fa3 is not None:
    for splits in sorted({8, ours_splits}):
      out[f"fa3_splits{splits}"] = (
          lambda q, k, v, s, t, n=splits: fa3(
              q, k, v, cache_seqlens=s, page_table=t, is_causal=causal,
              num_splits=n))
  return out


def run(names, *, iters, repeats, warmup, command, device, out=None,
        split_sweep=(), pagings=(False, True)):
  from jax_flash._src.decode import cuda as decode_cuda
  date = datetime.date.today().isoformat()
  records = []
  for name in names:
    B, S, T, heads, kv_heads = SHAPES[name]
    gb = B * S * kv_heads * D * 2 * 2 / 1e9
    ours_splits = decode_cuda.num_splits_for(B, T, heads, kv_heads, D, S)
    fp8_splits = decode_cuda.num_splits_for(B, T, heads, kv_heads, D, S,
                                            fp8=True)
    for paged in pagings:
      args = inputs(B, S, T, paged, heads=heads, kv_heads=kv_heads)
      impls = impls_for(B, S, T, paged, ours_splits, split_sweep)
      q, k, v, s, t = args
      fp8_args = (q, jax_flash.quantize_kv_cache(k),
                  jax_flash.quantize_kv_cache(v), s, t)
      steps = {n: (jax.jit(fn), fp8_args if n.endswith("fp8") else args)
               for n, fn in impls.items()}
      timed = ba.time_interleaved(steps, iters=iters, repeats=repeats,
                                  warmup=warmup)
      # e4m3 rows plus a float32 descale per row: the bytes that FP8 reads.
      gb_of = lambda n: gb * (D + 4) / (2 * D) if n.endswith("fp8") else gb
      gbps = {n: gb_of(n) / (ms * 1e-3) for n, ms in timed.items()
              if isinstance(ms, float)}
      fa3 = max((g for n, g in gbps.items() if n.startswith("fa3")),
                default=None)
      case = f"decode_{name}" + (f"_paged{PAGE}" if paged else "")
      for n in impls:
        ms = timed[n]
        rec = dict(impl=n, mode="decode", case=case, dtype="bfloat16", B=B,
                   S=S, T=T, T_new=T, H=heads, H_kv=kv_heads, D=D,
                   causal=T > 1,
                   paged=paged, page_size=PAGE if paged else None,
                   us=None, gbps=None, cudnn_gbps=gbps.get("cudnn"),
                   fa3_gbps=fa3, splits={"jax_flash_cuda": ours_splits,
                                         "jax_flash_cuda_fp8": fp8_splits}.get(n),
                   date=date, command=command, device=device)
        if isinstance(ms, Exception):
          rec["error"] = f"{type(ms).__name__}: {ms}"[:500]
        else:
          rec.update(us=float(f"{ms * 1e3:.5g}"),
                     gbps=float(f"{gbps[n]:.5g}"))
        for key in ("cudnn_gbps", "fa3_gbps"):
          if rec[key] is not None:
            rec[key] = float(f"{rec[key]:.5g}")
        records.append(rec)
        status = (f"{rec['us']:9.1f} us {rec['gbps']:8.1f} GB/s"
                  if rec["us"] is not None else rec["error"][:120])
        print(f"  {case:28s} {n:18s} {status}", flush=True)
      if out is not None:
        ba.merge_into(out, [r for r in records if r["case"] == case])
  return records


def print_table(records):
  print()
  print(f"{'case':28s} {'impl':18s} {'us':>9s} {'GB/s':>8s} {'vs cuDNN':>9s} "
        f"{'vs FA3':>7s} {'splits':>6s} {'speedup':>8s}")
  bf16_us = {r["case"]: r["us"] for r in records
             if r["impl"] == "jax_flash_cuda" and r["us"] is not None}
  for r in records:
    if r["us"] is None:
      print(f"{r['case']:28s} {r['impl']:18s} failed: {r['error'][:60]}")
      continue
    rel = lambda key: f"{r['gbps'] / r[key]:.2f}x" if r.get(key) else "-"
    # The FP8 cache against the bf16 one: time of bf16 / time of FP8.
    speedup = (f"{bf16_us[r['case']] / r['us']:.2f}x"
               if r["impl"] == "jax_flash_cuda_fp8" and r["case"] in bf16_us
               else "-")
    splits = "-" if r.get("splits") is None else str(r["splits"])
    print(f"{r['case']:28s} {r['impl']:18s} {r['us']:9.1f} {r['gbps']:8.1f} "
          f"{rel('cudnn_gbps'):>9s} {rel('fa3_gbps'):>7s} {splits:>6s} "
          f"{speedup:>8s}")
  print("(ratios: this one's bandwidth / the peer's; FA3 = its better split "
        "count; speedup: the FP8 cache's time against the bf16 cache's)")


PREFILL_T_NEW = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PREFILL_SHAPES = ((8, 32768), (1, 131072))  # (B, S)
ROUTES = ("decode_kernels", "dense")


@contextlib.contextmanager
def _prefill_threshold(n):
  """decode/cuda.py's PREFILL_MIN_TOKENS set to n (the route is chosen when
  attention_with_kvcache is traced)."""
  from jax_flash._src.decode import cuda as decode_cuda
  old = decode_cuda.PREFILL_MIN_TOKENS
  decode_cuda.PREFILL_MIN_TOKENS = n
  try:
    yield
  finally:
    decode_cuda.PREFILL_MIN_TOKENS = old


def routed_step(route, args, implementation):
  """attention_with_kvcache(q, k, v, lengths) compiled on `route`: the
  decoding kernels (a threshold of T_new keeps the chunk there) or the dense
  path (a threshold of 0 sends every chunk there)."""
  T = args[0].shape[1]
  step = jax.jit(lambda q, k, v, s: jax_flash.attention_with_kvcache(
      q, k, v, s, causal=True, implementation=implementation))
  with _prefill_threshold(T if route == "decode_kernels" else 0):
    lowered = step.lower(*args)
  return lowered.compile()


def run_prefill_sweep(shapes, t_news, *, iters, repeats, warmup, command,
                      device, implementation, out=None):
  """Times both routes at each (B, S) and T_new; -> the rows (module
  docstring), merged into `out` shape by shape."""
  from jax_flash._src.decode import cuda as decode_cuda
  date = datetime.date.today().isoformat()
  impl = ("jax_flash" if implementation is None else
          f"jax_flash_{implementation}")
  records = []
  for B, S in shapes:
    q_all, k, v, lengths, _ = inputs(B, S, max(t_news), paged=False)
    rows = []
    for T in t_news:
      args = (q_all[:, :T], k, v, lengths)
      steps, errors = {}, {}
      for route in ROUTES:
        try:
          steps[route] = (routed_step(route, args, implementation), args)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
          errors[route] = e
      timed = ba.time_interleaved(steps, iters=iters, repeats=repeats,
                                  warmup=warmup)
      timed.update(errors)
      us = {r: float(f"{t * 1e3:.5g}") if isinstance(t, float) else None
            for r, t in timed.items()}
      faster = min(ROUTES, key=us.get) if None not in us.values() else None
      for route in ROUTES:
        rec = dict(impl=impl, mode="prefill_route",
                   case=f"prefill_route_b{B}_s{S}_t{T}_{route}", route=route,
                   dtype="bfloat16", B=B, S=S, T=T, T_new=T, H=H, H_kv=H_KV,
                   D=D, causal=True, paged=False, us=us[route],
                   decode_kernels_us=us["decode_kernels"],
                   dense_us=us["dense"], faster=faster,
                   prefill_min_tokens=decode_cuda.PREFILL_MIN_TOKENS,
                   implementation=implementation, date=date,
                   command=command, device=device)
        if us[route] is None:
          e = timed[route]
          rec["error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(rec)
      print(f"  B{B} S{S} T_new {T:4d}: " + "  ".join(
          f"{r} {us[r]:.1f} us" if us[r] is not None else
          f"{r} failed: {str(timed[r])[:80]}" for r in ROUTES), flush=True)
    records += rows
    if out is not None:
      ba.merge_into(out, rows)
  return records


def suggested_prefill_threshold(records) -> int:
  """The largest T_new up to which the decoding kernels are at least as fast
  as the dense path at every shape and every smaller T_new of the sweep (0
  if they lose at the smallest)."""
  by_t = {}
  for r in records:
    by_t.setdefault(r["T_new"], []).append((r["decode_kernels_us"],
                                            r["dense_us"]))
  best = 0
  for T in sorted(by_t):
    if any(d is None or n is None or d > n for d, n in by_t[T]):
      break
    best = T
  return best


def print_prefill_table(records):
  print()
  print(f"{'B':>3s} {'S':>7s} {'T_new':>6s} {'kernels us':>11s} "
        f"{'dense us':>10s} {'faster':>15s}")
  fmt = lambda x: "failed" if x is None else f"{x:.1f}"
  for r in records:
    if r["route"] != ROUTES[0]:
      continue  # one line per shape and T_new
    print(f"{r['B']:3d} {r['S']:7d} {r['T_new']:6d} "
          f"{fmt(r['decode_kernels_us']):>11s} {fmt(r['dense_us']):>10s} "
          f"{r['faster'] or '-':>15s}")
  if records:
    print(f"PREFILL_MIN_TOKENS from this sweep: "
          f"{suggested_prefill_threshold(records)} (the largest T_new up to "
          f"which the decoding kernels win at every shape; now "
          f"{records[0]['prefill_min_tokens']})")


def _ints(text):
  return [int(x) for x in text.split(",") if x]


def _shapes_bxs(text):
  """"8x32768,1x131072" -> [(8, 32768), (1, 131072)]."""
  return [tuple(int(n) for n in item.split("x")) for item in text.split(",")]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default=",".join(SHAPES))
  p.add_argument("--iters", type=int, default=100)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--out", type=pathlib.Path)
  p.add_argument("--splits", default="",
                 help="also time jax_flash with these fixed num_splits")
  p.add_argument("--contiguous-only", action="store_true")
  p.add_argument("--prefill-sweep", action="store_true",
                 help="time the decoding kernels against the dense path "
                 "over T_new (PREFILL_MIN_TOKENS)")
  p.add_argument("--t-new", type=_ints, default=list(PREFILL_T_NEW),
                 help="--prefill-sweep's T_new values (default: "
                 f"{','.join(map(str, PREFILL_T_NEW))})")
  p.add_argument("--prefill-shapes", type=_shapes_bxs,
                 default=list(PREFILL_SHAPES),
                 help="--prefill-sweep's BxS cache shapes (default: "
                 f"{','.join(f'{b}x{s}' for b, s in PREFILL_SHAPES)})")
  a = p.parse_args(argv)
  device = jax.devices()[0].device_kind
  command = "python benchmarks/bench_decode.py " + " ".join(argv or
                                                            sys.argv[1:])
  if a.out is not None:
    ba.check_same_device(a.out, device)
  if a.prefill_sweep:
    if jax.default_backend() != "gpu":
      print("not on a GPU: both routes run jax_flash's dense path here (the "
            "decoding kernels are CUDA)")
    if any(not 1 <= T <= S for T in a.t_new for _, S in a.prefill_shapes):
      p.error("--t-new values must be >= 1 and fit the caches (T_new <= S)")
    records = run_prefill_sweep(
        a.prefill_shapes, a.t_new, iters=a.iters, repeats=a.repeats,
        warmup=a.warmup, command=command.strip(), device=device,
        implementation="cuda" if jax.default_backend() == "gpu" else None,
        out=a.out)
    print_prefill_table(records)
    return records
  records = run(a.shapes.split(","), iters=a.iters, repeats=a.repeats,
                warmup=a.warmup, command=command.strip(), device=device,
                out=a.out,
                split_sweep=[int(x) for x in a.splits.split(",") if x],
                pagings=(False,) if a.contiguous_only else (False, True))
  print_table(records)
  return records


if __name__ == "__main__":
  main()
