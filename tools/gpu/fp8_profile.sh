#!/usr/bin/env bash
# Nsight Compute profile of the FP8 forward beside the 16-bit forward (same
# shape, same process), from the repo root on an H100/H200:
#   tools/gpu/fp8_profile.sh [DIMS]         (default "128 64 256")
# For each head dim D in DIMS: B=2, T=S=8192, H=2048/D, not causal; one
# fp8_attention call on pre-quantised Fp8Tensors and one attention call
# (implementation="cuda"), each warmed up, profiled once. Sections: speed of
# light, compute workload (tensor pipe), warp state (issue-stall reasons),
# scheduler, memory workload tables (shared-memory bank conflicts), launch
# statistics and occupancy. Reports in $OUT/fp8_profile_D*.ncu-rep (open with
# ncu-ui), text in $OUT/fp8_profile_D*.txt; a short table of the key metrics
# per kernel is printed last. Clocks are left alone (--clock-control none).
# SourceCounters: the SASS of each kernel with its warp-stall samples
# ($OUT/fp8_profile_D*_sass_K.csv, K = 0 for the FP8 kernel, 1 for the
# 16-bit one) and the hottest instructions printed per kernel.
DEFAULT_STAGES=""
source "$(dirname "$0")/carried.sh"
DIMS=${*:-128 64 256}
METRICS=(
  gpu__time_duration.sum
  sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
  sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active
  smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
  smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
  smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio
  smsp__average_warps_issue_stalled_wait_per_issue_active.ratio
  smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio
  smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio
  smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
  smsp__inst_executed.sum
  smsp__issue_active.avg.pct_of_peak_sustained_active
  sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
  sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
  sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active
  sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
  launch__registers_per_thread
)
for D in $DIMS; do
  cat > /tmp/fp8_profile_case.py <<PY
import jax, jax.numpy as jnp, numpy as np, jax_flash
D = $D; B, T, H = 2, 8192, 2048 // D
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16) for _ in range(3))
q8, k8, v8 = (jax_flash.quantize_fp8(x, kind=n) for x, n in
              ((q, "query"), (k, "key"), (v, "value")))
fp8 = jax.jit(lambda a, b, c: jax_flash.fp8_attention(a, b, c, implementation="cuda"))
bf16 = jax.jit(lambda a, b, c: jax_flash.attention(a, b, c, implementation="cuda"))
for _ in range(3):
  fp8(q8, k8, v8).block_until_ready(); bf16(q, k, v).block_until_ready()
print("profiled", fp8(q8, k8, v8).block_until_ready().shape, bf16(q, k, v).block_until_ready().shape)
PY
  # The last two launches of the forward kernels are the profiled calls.
  timeout 240 ncu --clock-control none --target-processes all \
    -k regex:'fwd_kernel' --launch-skip 6 --launch-count 2 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis_Tables \
    --section LaunchStats --section Occupancy --section SourceCounters \
    --metrics "$(IFS=,; echo "${METRICS[*]}")" \
    -o "$OUT/fp8_profile_D$D" -f python3 /tmp/fp8_profile_case.py >"$OUT/fp8_profile_D$D.log" 2>&1
  echo "D=$D: ncu exit $?"
  ncu -i "$OUT/fp8_profile_D$D.ncu-rep" --page details >"$OUT/fp8_profile_D$D.txt" 2>&1
  ncu -i "$OUT/fp8_profile_D$D.ncu-rep" --page raw --csv \
    --metrics "$(IFS=,; echo "${METRICS[*]}")" >"$OUT/fp8_profile_D$D.csv" 2>&1
  python3 - "$OUT/fp8_profile_D$D.csv" "$D" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
if head is None:
  print("".join(open(sys.argv[1]).readlines()[-5:])); sys.exit()
names = rows[head]
for r in rows[head + 2:]:
  d = dict(zip(names, r))
  kind = "fp8" if "e4m3" in d["Kernel Name"] or "float_e4m3" in d["Kernel Name"] or "fp8" in d["Kernel Name"].lower() else "16-bit"
  short = {k.split("__", 1)[-1][:48]: v for k, v in d.items() if "__" in k}
  print(f"D={sys.argv[2]} {kind:6s} " + "  ".join(f"{k}={v}" for k, v in short.items()))
PY
  ncu -i "$OUT/fp8_profile_D$D.ncu-rep" --page source --csv --print-source sass \
    >"$OUT/fp8_profile_D${D}_sass.csv" 2>&1
  python3 - "$OUT/fp8_profile_D${D}_sass.csv" "$D" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
heads = [i for i, r in enumerate(rows) if any("Sampling" in c for c in r)]
if not heads:
  print("no source page:", "".join(open(sys.argv[1]).readlines()[:3])[:300]); sys.exit()
def num(x):
  try: return float(x.replace(",", ""))
  except ValueError: return 0.0
for k, head in enumerate(heads):  # one section per profiled kernel (FP8 first)
  names = rows[head]
  col = next((i for i, c in enumerate(names) if "Sampling" in c and "All" in c),
             next(i for i, c in enumerate(names) if "Sampling" in c))
  src = next((i for i, c in enumerate(names) if c.strip().lower() in ("source", "sass")), 1)
  end = heads[k + 1] if k + 1 < len(heads) else len(rows)
  body = [r for r in rows[head + 1:end] if len(r) > max(col, src)]
  total = sum(num(r[col]) for r in body) or 1.0
  print(f"D={sys.argv[2]} kernel {k}: {len(body)} SASS lines, column {names[col]!r}")
  for r in sorted(body, key=lambda r: -num(r[col]))[:25]:
    print(f"  {100 * num(r[col]) / total:5.1f}%  {r[src][:90]}")
  by = {}
  for r in body:
    w = [t for t in r[src].split() if not t.startswith("@")]
    op = w[0].split(".")[0] if w else "?"
    by[op] = by.get(op, 0.0) + num(r[col])
  print("  by opcode:", ", ".join(f"{o} {100 * v / total:.1f}%" for o, v in
                                   sorted(by.items(), key=lambda kv: -kv[1])[:14]))
PY
done
