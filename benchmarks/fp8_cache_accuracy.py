"""FP8 KV-cache accuracy: decoding against an e4m3 cache vs the bf16 cache.

    python benchmarks/fp8_cache_accuracy.py                       # CPU: xla path
    python benchmarks/fp8_cache_accuracy.py --out benchmarks/results/h200.json

One decoding step (B=4 rows, 1 and 4 new tokens, 32 query heads on 8 KV
heads, D=128, cache fills of 4096 and 16384 keys, ragged per row) against
caches drawn from three distributions:

  normal           q, k, v ~ N(0, 1);
  outlier_channels what trained models' caches look like: keys with a few
                   massive channels (4 of 128 per head at 20x, the queries
                   aligned with them at 5x), per-token key norms spread
                   log-normally, values heavy-tailed (Student t, 3 degrees
                   of freedom) with an attention-sink token (position 0)
                   whose key and value are 8x;
  sink_peaked      outlier_channels with sharper attention (scores x 4): a
                   few keys take most of each row's weight.

Each cache is rounded to bfloat16 first; the reference is exact attention of
those values in float64. Rows: the bf16 cache (attention_with_kvcache on the
16-bit cache), the FP8 cache (quantize_kv_cache: e4m3 + one float32 descale
per key and head) and the FP8 cache with rotate=True (the Hadamard rotation
before the scales). Reported: relative RMS error ||O - O_ref|| / ||O_ref||
and the ratio to the bf16 cache's. --implementation picks the backend
(default: the library's choice: the CUDA kernels on a GPU, xla on a CPU).

--out merges rows {case: fp8_cache_accuracy_<distribution>_s<S>_t<T_new>,
impl, cache: bf16|fp8|fp8_rotated, rel_rms, rel_rms_vs_bf16, B, S, T_new, H,
H_kv, D, date, device, command} into a results JSON list.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402

B, H, H_KV, D = 4, 32, 8, 128


def draw(dist: str, S: int, T: int, rng):
  """q [B, T, H, D], k, v [B, S, H_kv, D] (float32) of one distribution."""
  q = rng.standard_normal((B, T, H, D))
  k = rng.standard_normal((B, S, H_KV, D))
  v = rng.standard_normal((B, S, H_KV, D))
  if dist == "normal":
    return q, k, v
  chans = np.stack([rng.choice(D, 4, replace=False) for _ in range(H_KV)])
  for h in range(H_KV):
    k[:, :, h, chans[h]] *= 20.0
    for g in range(H // H_KV):
      q[:, :, h * (H // H_KV) + g, chans[h]] *= 5.0
  k *= np.exp(0.5 * rng.standard_normal((B, S, H_KV, 1)))
  v = rng.standard_t(3, (B, S, H_KV, D))
  k[:, 0] *= 8.0
  v[:, 0] *= 8.0
  if dist == "sink_peaked":
    q *= 4.0
  return q, k, v


def reference(q, k, v, lens, scale):
  """Exact attention of the new tokens (causal within them, bottom-right)
  against each row's first lens[b] + T keys (the cache holds the new
  tokens' keys too), float64."""
  T = q.shape[1]
  g = H // H_KV
  out = np.zeros(q.shape, np.float64)
  for b in range(B):
    n = int(lens[b]) + T
    kb = np.repeat(k[b, :n], g, axis=1)  # [n, H, D]
    vb = np.repeat(v[b, :n], g, axis=1)
    s = np.einsum("thd,shd->hts", q[b], kb, optimize=True) * scale
    vis = np.arange(n)[None, :] <= (int(lens[b]) + np.arange(T))[:, None]
    s = np.where(vis[None], s, -np.inf)
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    out[b] = np.einsum("hts,shd->thd", p, vb, optimize=True)
  return out


def run(dists, fills, t_news, implementation, seed=0):
  rng = np.random.default_rng(seed)
  scale = 1.0 / np.sqrt(D)
  rows = []
  for dist in dists:
    for S in fills:
      for T in t_news:
        q, k, v = draw(dist, S, T, rng)
        lens = np.asarray([S - T - int(x) for x in rng.integers(0, S // 8, B)],
                          np.int32)
        lens[0] = S - T  # one row full
        # Slots past a row's tokens hold garbage no query may read.
        for b in range(B):
          k[b, lens[b] + T:] = np.nan
          v[b, lens[b] + T:] = np.inf
        bf = lambda x: jnp.asarray(x, jnp.bfloat16)
        q16, k16, v16 = bf(q), bf(k), bf(v)
        ref = reference(*(np.asarray(x, np.float64) for x in (q16, k16, v16)),
                        lens, scale)
        caches = {
            "bf16": (k16, v16),
            "fp8": (jax_flash.quantize_kv_cache(k16),
                    jax_flash.quantize_kv_cache(v16)),
            "fp8_rotated": (jax_flash.quantize_kv_cache(k16, rotate=True),
                            jax_flash.quantize_kv_cache(v16, rotate=True)),
        }
        errs = {}
        for name, (kc, vc) in caches.items():
          o = jax_flash.attention_with_kvcache(
              q16, kc, vc, jnp.asarray(lens + T), causal=True,
              implementation=implementation)
          o = np.asarray(o, np.float64)
          if not np.isfinite(o).all():
            raise AssertionError(f"{dist} S={S} T={T} {name}: non-finite "
                                 "output (an unread slot reached it)")
          errs[name] = float(np.sqrt(np.mean((o - ref) ** 2)) /
                             np.sqrt(np.mean(ref ** 2)))
        for name, e in errs.items():
          rows.append(dict(case=f"fp8_cache_accuracy_{dist}_s{S}_t{T}",
                           cache=name, rel_rms=e,
                           rel_rms_vs_bf16=e / errs["bf16"], B=B, S=S,
                           T_new=T, H=H, H_kv=H_KV, D=D))
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dists", default="normal,outlier_channels,sink_peaked")
  p.add_argument("--fills", default="4096,16384")
  p.add_argument("--t-new", default="1,4")
  p.add_argument("--implementation", default=None)
  p.add_argument("--out", type=pathlib.Path)
  a = p.parse_args(argv)
  device = jax.devices()[0].device_kind
  if a.out is not None:
    ba.check_same_device(a.out, device)
  rows = run(a.dists.split(","), [int(x) for x in a.fills.split(",")],
             [int(x) for x in a.t_new.split(",")], a.implementation)
  impl = "jax_flash" + (f"_{a.implementation}" if a.implementation else "")
  command = "python benchmarks/fp8_cache_accuracy.py " + " ".join(
      argv if argv is not None else sys.argv[1:])
  for r in rows:
    r.update(impl=impl, mode="decode", date=str(datetime.date.today()),
             device=device, command=command.strip())
  print(f"{'case':44s} {'cache':12s} {'rel RMS':>9s} {'vs bf16':>8s}")
  for r in rows:
    print(f"{r['case']:44s} {r['cache']:12s} {r['rel_rms']:9.2e} "
          f"{r['rel_rms_vs_bf16']:7.2f}x")
  if a.out is not None:
    ba.merge_into(a.out, rows)


if __name__ == "__main__":
  main()
