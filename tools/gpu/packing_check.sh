#!/usr/bin/env bash
# Packed sequences on an H200, from the repo root, with a prebuilt extension
# in .ab/jax_flash/ and the flash-attn3-jax wheel in .whl/ (the peer of the
# benchmark), as tools/gpu/carried.sh sets them up:
#   tools/gpu/packing_check.sh [test] [bench]
# test: the GPU tests of varlen / segment ids and the CUDA suite, outputs
# NaN-poisoned; bench: benchmarks/bench_packing.py into the results file.
# Environment: GPU_TESTS (pytest paths), PYTEST_K (a -k expression),
# TEST_TIMEOUT, BENCH_ARGS, BENCH_TIMEOUT.
# Logs and the results file go to $OUT (or ./gpu_out); a table is printed last.
DEFAULT_STAGES="test bench"
source "$(dirname "$0")/carried.sh" "$@"
SUMMARY=()
if has test; then
  t0=$SECONDS
  # (-n 8 processes share the GPU: no preallocation)
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_FLASH_POISON_OUTPUTS=1 timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -m gpu -n 8 \
    ${GPU_TESTS:-tests/test_varlen.py tests/test_cuda.py} ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/test.log" | tail -30
  SUMMARY+=("test: $(tail -1 "$OUT/test.log") ($((SECONDS-t0)) s)")
fi
if has bench; then
  cp benchmarks/results/h200.json "$OUT/h200.json"
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_packing.py --out "$OUT/h200.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40
fi
printf '%s\n' "${SUMMARY[@]}"
