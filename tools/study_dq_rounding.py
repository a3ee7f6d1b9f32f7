"""Where the FA-style backward's dQ error comes from, for the GPU suite case
`window_both_long` (B=2, T=S=300, H=2, Hk=1, D=128, window (40, 70), with a
dLSE cotangent), simulated in numpy on the CPU.

The kernels compute P, dP and dS in fp32 but (1) take delta = rowsum(dO * O)
from the bf16 output O and (2) round dS to bf16 for the dQ = dS K GEMM. This
replays that arithmetic (float64 GEMMs over the rounded operands, fp32 / bf16
roundings where the kernels round) with each rounding switched off in turn,
and prints each variant's max |dq - ref64| as a fraction of the suite's bound
2 * max |dq_XLA_bf16 - ref64| (XLA on this CPU; the GPU's XLA baseline is
more accurate, so the GPU bound is tighter).

    python tools/study_dq_rounding.py [seeds]

Result (2026-11-30, 12 seeds): fa 0.29-0.63 of the bound, fp32 O for delta
0.30-0.63 (no change), fp32 dS 0.18-0.46: the bf16 dS of the dQ GEMM is the
dominant term, the bf16 O of delta is not. On the H200 the case failed by 7%
(7.43e-3 vs 6.95e-3) with the sm90 forward and passed with the sm80 one.
The cause was the GPU baseline, not the kernels: XLA:GPU dropped the
baseline's bf16 rounding of dS (tools/check_baseline_rounding.py); with
that fixed in tests/reference.py the case passes on the H200.
"""
import numpy as np, jax, jax.numpy as jnp, sys
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1] / 'tests'))
import reference
bf = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
B, T, H, Hk, D = 2, 300, 2, 1, 128
wl, wr = 40, 70
scale = D ** -0.5
def run(seed):
  rng = np.random.default_rng(seed)
  q = bf(rng.standard_normal((B, T, H, D))); k = bf(rng.standard_normal((B, T, Hk, D))); v = bf(rng.standard_normal((B, T, Hk, D)))
  do = bf(rng.standard_normal((B, T, H, D))); dlse = rng.standard_normal((B, H, T)).astype(np.float32).astype(np.float64)
  kk = np.repeat(k, H // Hk, axis=2); vv = np.repeat(v, H // Hk, axis=2)
  i = np.arange(T)[:, None]; j = np.arange(T)[None, :]
  mask = (j >= i - wl) & (j <= i + wr)
  s = np.einsum('bthd,bshd->bhts', q, kk) * scale
  s = np.where(mask, s, -np.inf)
  lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
  p = np.exp(s - lse[..., None])
  o = np.einsum('bhts,bshd->bthd', p, vv)
  dp = np.einsum('bthd,bshd->bhts', do, vv)
  delta_exact = np.einsum('bthd,bthd->bht', do, o) - dlse
  ds = p * (dp - delta_exact[..., None])
  dq_ref = np.einsum('bhts,bshd->bthd', ds, kk) * scale
  out = {}
  for name, o_used, round_ds in [('fa', bf(o), True), ('fp32 O', o.astype(np.float32), True), ('fp32 dS', bf(o), False), ('both', o.astype(np.float32), False)]:
    delta = (np.einsum('bthd,bthd->bht', do, o_used) - dlse).astype(np.float32)
    dsx = (p.astype(np.float32) * (dp.astype(np.float32) - delta[..., None]))
    if round_ds: dsx = bf(dsx)
    dq = bf(np.einsum('bhts,bshd->bthd', dsx.astype(np.float64), kk).astype(np.float32) * scale)
    out[name] = np.abs(dq - dq_ref).max()
  # same-dtype XLA baseline (CPU)
  qj, kj, vj, doj = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
  def f(q, k, v):
    o, l = reference.dense_attention_jax(q, k, v, window=(wl, wr))
    return o, l
  (o_b, l_b), vjp = jax.vjp(f, qj, kj, vj)
  dqb = vjp((doj, jnp.asarray(dlse, l_b.dtype)))[0]
  base = np.abs(np.asarray(dqb.astype(jnp.float32), np.float64) - dq_ref).max()
  return base, out
fails = {}
for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 10):
  base, out = run(seed)
  print(seed, f"base {base:.2e}", " ".join(f"{k}: {v/(2*base):.2f}" for k, v in out.items()), flush=True)
