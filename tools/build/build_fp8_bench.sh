#!/usr/bin/env bash
# Builds build_carry/bench_fp8_sm90 (cuda/tests/bench_fp8_sm90.cu: the FP8
# forward's production configuration beside its ablations, TF/s and max|dO|),
# to be copied to an H100/H200 host and run there:
#   tools/build/build_fp8_bench.sh        (from anywhere; one translation unit)
#   build_carry/bench_fp8_sm90 [--launches=N] [filter]
# The ptxas report (registers, spills per kernel) is kept in
# build/obj_fp8_bench/bench_fp8_sm90.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=build_carry
OBJ=build/obj_fp8_bench
mkdir -p "$OBJ" "$OUTDIR"
NVCC=${NVCC:-nvcc}
t0=$SECONDS
"$NVCC" -O3 -std=c++17 --expt-relaxed-constexpr -lineinfo --use_fast_math \
  -gencode=arch=compute_90a,code=sm_90a -Icuda/include -Icuda -Xptxas -v \
  cuda/tests/bench_fp8_sm90.cu -o "$OUTDIR/bench_fp8_sm90" >"$OBJ/bench_fp8_sm90.log" 2>&1 \
  || { cat "$OBJ/bench_fp8_sm90.log"; exit 1; }
echo "built $OUTDIR/bench_fp8_sm90 in $((SECONDS - t0)) s"
grep -E "spill stores|Used [0-9]+ registers" "$OBJ/bench_fp8_sm90.log" | grep -B1 -E "[1-9][0-9]* bytes spill" | head -40 || true
