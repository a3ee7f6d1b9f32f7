#!/usr/bin/env bash
# A/B of two builds of the extension via JAX, on the GPU, each beside cuDNN:
#   benchmarks/ab_extensions.sh A.so B.so ROUNDS [bench_attention.py args...]
# The two builds cannot share a process (same module name), so each round runs
# one bench_attention.py process per build, A then B, then B then A in the next
# round (ABBA...), and the ratio to cuDNN measured in the same process is what
# gets compared: cuDNN is the yardstick for the clock / power state of that run.
# JSON and logs go to $OUT (or ./gpu_out); a table of ratios is printed last.
set -euo pipefail
A=${1:?usage: ab_extensions.sh A.so B.so ROUNDS [bench args]}
B=${2:?}
ROUNDS=${3:?}
shift 3
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
SO=jax_flash/_jax_flash_cuda$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
[[ -e $SO ]] && cp "$SO" "$OUT/.original.so"
for ((i = 1; i <= ROUNDS; i++)); do
  order="A B"; (( i % 2 == 0 )) && order="B A"
  for tag in $order; do
    src=$A; [[ $tag == B ]] && src=$B
    cp "$src" "$SO"
    python3 benchmarks/bench_attention.py "$@" --out "$OUT/ab_${tag}_$i.json" >"$OUT/ab_${tag}_$i.log" 2>&1
    echo "round $i $tag done"
  done
done
[[ -e $OUT/.original.so ]] && cp "$OUT/.original.so" "$SO"
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, pathlib, statistics, sys
out, rounds = pathlib.Path(sys.argv[1]), int(sys.argv[2])
rows = {}
for tag in "AB":
  for i in range(1, rounds + 1):
    for r in json.loads((out / f"ab_{tag}_{i}.json").read_text()):
      if r["impl"] == "jax_flash_cuda" and "ratio_vs_cudnn" in r:
        key = (r["mode"], r["D"], r["T"], r["causal"])
        rows.setdefault(key, {"A": [], "B": []})[tag].append(
            (r["ratio_vs_cudnn"], r["tflops"], r["cudnn_tflops"]))
print("mode     D    T      causal  build  ratios vs cuDNN (per round)        median  TF/s med  cuDNN med")
for key, by in sorted(rows.items()):
  for tag in "AB":
    v = by[tag]
    print(f"{key[0]:8s} {key[1]:<4d} {key[2]:<6d} {str(key[3]):7s} {tag:5s}  "
          + " ".join(f"{x[0]:.3f}" for x in v).ljust(35)
          + f" {statistics.median(x[0] for x in v):.3f}  {statistics.median(x[1] for x in v):7.1f}"
          + f"  {statistics.median(x[2] for x in v):7.1f}")
PY
