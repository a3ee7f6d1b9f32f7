#!/usr/bin/env bash
# Learnable sinks, dropout (ring blocks included), unread-input safety and
# one-call prefill on an H200, from the repo root, with a prebuilt extension
# in .ab/jax_flash/ (and the peers' wheels in .whl/), as tools/gpu/carried.sh
# sets them up:
#   tools/gpu/features_check.sh [selftest] [test] [sanitize] [bench] [generate]
# selftest: cuda/tests/selftest.cu (sm80: sinks, dropout at a nonzero
#   origin) and selftest_sm90 (the sm90 forward's sinks; built by
#   tools/build/build_sm90_tests.sh), run with filters;
# test: their GPU tests, outputs NaN-poisoned (-v: one PASSED/FAILED line
#   per test, so a timeout still leaves the results);
# sanitize: compute-sanitizer memcheck and racecheck over
#   tools/gpu/sanitize_case.py's sinks, packed, ring_dropout, dropout, fp8;
# bench: the sinks' cost (bench_attention.py: jax_flash_cuda beside
#   jax_flash_cuda_sinks) and dropout against cuDNN's (bench_dropout.py),
#   sustained rounds, into the results file;
# generate: examples/generate.py (one-call prefill, then decode) against
#   Flax's decode.
# Environment: GPU_TESTS, PYTEST_K, TEST_TIMEOUT, SANITIZE_CASES,
#   SANITIZE_TIMEOUT, BENCH_TIMEOUT, GEN_TIMEOUT.
# Logs and the results file go to $OUT (or ./gpu_out); a table is printed last.
DEFAULT_STAGES="test sanitize bench"
source "$(dirname "$0")/carried.sh" "$@"
SUMMARY=()
if has selftest; then
  t0=$SECONDS
  nvcc -O3 -std=c++17 --expt-relaxed-constexpr --use_fast_math --threads 8 \
    -gencode=arch=compute_90,code=sm_90 -Icuda/include -Icuda cuda/tests/selftest.cu \
    cuda/sm80/dispatch.cu cuda/instantiations/*_sm80.cu -o "$OUT/selftest" 2>&1 | tail -5
  for f in sinks dropout; do
    timeout 120 "$OUT/selftest" "$f" 2>&1 | tee -a "$OUT/selftest.log" | tail -3
  done
  SUMMARY+=("selftest sm80: $(grep -cE 'PASS$' "$OUT/selftest.log") PASS, $(grep -cE 'FAIL$' "$OUT/selftest.log") FAIL ($((SECONDS-t0)) s)")
  t0=$SECONDS
  [[ -x build_carry/selftest_sm90 ]] || tools/build/build_sm90_tests.sh >"$OUT/sm90_build.log" 2>&1
  timeout 200 build_carry/selftest_sm90 sinks 2>&1 | tee "$OUT/selftest_sm90.log" | tail -8
  SUMMARY+=("selftest sm90 sinks: $(grep -E 'passed, [0-9]+ failed' "$OUT/selftest_sm90.log" | tail -1) ($((SECONDS-t0)) s)")
fi
if has test; then
  t0=$SECONDS
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_FLASH_POISON_OUTPUTS=1 timeout ${TEST_TIMEOUT:-420} \
    python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider \
    ${GPU_TESTS:-tests/test_sinks_value_dim.py tests/test_unseen_inputs.py tests/test_ring_dropout.py tests/test_decode_cuda.py tests/test_cuda.py tests/test_dropout.py} \
    ${PYTEST_K:+-k "$PYTEST_K"} >"$OUT/test.log" 2>&1
  grep -E "FAILED|ERROR" "$OUT/test.log" | head -30
  SUMMARY+=("test: $(grep -c ' PASSED' "$OUT/test.log") passed, $(grep -c ' FAILED' "$OUT/test.log") failed, $(tail -1 "$OUT/test.log" | cut -c1-80) ($((SECONDS-t0)) s)")
fi
if has sanitize; then
  for tool in memcheck racecheck; do
    t0=$SECONDS
    timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 1 \
      python3 tools/gpu/sanitize_case.py ${SANITIZE_CASES:-sinks mla packed ring_dropout decode dropout fp8} \
      >"$OUT/sanitize_$tool.log" 2>&1
    SUMMARY+=("$tool: rc=$? $(grep -E 'SUMMARY' "$OUT/sanitize_$tool.log" | tail -1) $(grep -E '^== case .*: ' "$OUT/sanitize_$tool.log" | tr '\n' ' ') ($((SECONDS-t0)) s)")
  done
fi
if has bench; then
  cp benchmarks/results/h200.json "$OUT/h200.json"
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_attention.py --sweep --dims 64,128 \
    --seqs 1024,4096,8192 --impls jax_flash_cuda,jax_flash_cuda_sinks --iters 100 \
    --out "$OUT/h200.json" 2>&1 | tee "$OUT/bench_sinks.log" | tail -30
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_dropout.py --out "$OUT/h200.json" \
    2>&1 | tee "$OUT/bench_dropout.log" | tail -30
fi
if has generate; then
  timeout ${GEN_TIMEOUT:-300} python3 examples/generate.py 2>&1 | tee "$OUT/generate.log" | tail -12
  SUMMARY+=("generate: rc=${PIPESTATUS[0]} $(grep -E 'tokens/s|identical|FAILED' "$OUT/generate.log" | tr '\n' ';')")
fi
printf '%s\n' "${SUMMARY[@]}"
