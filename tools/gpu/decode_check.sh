#!/usr/bin/env bash
# KV-cache decoding on an H200, from the repo root, with a prebuilt extension
# in .ab/jax_flash/ and the flash-attn3-jax wheel in .whl/ (the peer of the
# benchmark), as tools/gpu/carried.sh sets them up:
#   tools/gpu/decode_check.sh [selftest] [kbench] [test] [bench]
# selftest: cuda/tests/selftest_decode.cu built with nvcc and run;
# kbench: its --bench (kernels alone: production, both combine kernels, the
# split counts of KBENCH_SPLITS, every variant; after selftest, which builds
# it); test: the decoding GPU tests (NaN-poisoned outputs) and the generation
# example; bench: benchmarks/bench_decode.py into the results file.
# Environment: TEST_TIMEOUT, GEN_TIMEOUT, BENCH_ARGS, BENCH_TIMEOUT,
# KBENCH_SPLITS (default 16,24,44,66), KBENCH_TIMEOUT.
# Logs and the results file go to $OUT (or ./gpu_out); a table is printed last.
DEFAULT_STAGES="selftest test bench"
source "$(dirname "$0")/carried.sh" "$@"
SUMMARY=()
if has selftest; then
  t0=$SECONDS
  nvcc -O3 -std=c++17 --expt-relaxed-constexpr --use_fast_math -gencode=arch=compute_90,code=sm_90 \
    -Icuda/include -Icuda cuda/tests/selftest_decode.cu cuda/decode/*.cu \
    -o "$OUT/selftest_decode" 2>&1 | tail -5
  timeout ${SELFTEST_TIMEOUT:-300} "$OUT/selftest_decode" 2>&1 | tee "$OUT/selftest_decode.log" | tail -20
  SUMMARY+=("selftest: $(grep -E 'passed' "$OUT/selftest_decode.log" | tail -1) ($((SECONDS-t0)) s)")
fi
if has kbench; then
  timeout ${KBENCH_TIMEOUT:-400} "$OUT/selftest_decode" --bench --iters 20 --rounds 9 \
    --splits ${KBENCH_SPLITS:-16,24,44,66} 2>&1 | tee "$OUT/kbench.log" | tail -150
fi
if has test; then
  t0=$SECONDS
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_FLASH_POISON_OUTPUTS=1 timeout ${TEST_TIMEOUT:-300} \
    python3 -m pytest -q -m gpu -n 4 tests/test_decode_cuda.py 2>&1 | tee "$OUT/test.log" | tail -20
  SUMMARY+=("test: $(tail -1 "$OUT/test.log") ($((SECONDS-t0)) s)")
  timeout ${GEN_TIMEOUT:-120} python3 examples/generate.py --dtype bfloat16 --implementation cuda 2>&1 | tee "$OUT/generate.log" | tail -5
  SUMMARY+=("generate: $(grep -E 'tokens/s|FAILED' "$OUT/generate.log" | tr '\n' ';')")
fi
if has bench; then
  cp benchmarks/results/h200.json "$OUT/h200.json"
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_decode.py --out "$OUT/h200.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -30
fi
printf '%s\n' "${SUMMARY[@]}"
