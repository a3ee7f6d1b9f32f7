#!/usr/bin/env bash
# The training step on an H200, from the repo root, with a prebuilt extension
# in .ab/jax_flash/ and the flash-attn3-jax wheel in .whl/ (the peer), as
# tools/gpu/carried.sh sets them up:
#   tools/gpu/bwd_check.sh [test] [bench]
# test: the CUDA suite's gradient and deterministic cases, NaN-poisoned;
# bench: bench_attention.py's sweep (B*T = 16k) at the head dims of $DIMS
# with jax_flash (default and deterministic), FA3 and cuDNN interleaved,
# modes $MODES, into $OUT/h200.json.
# Environment: DIMS (128), SEQS (512,1024,2048,4096,8192,16384), MODES
# (fwd_bwd,bwd), CAUSAL (both), IMPLS, ITERS (100), REPEATS (5),
# TEST_TIMEOUT, BENCH_TIMEOUT, PYTEST_K.
DEFAULT_STAGES="test bench"
source "$(dirname "$0")/carried.sh" "$@"
SUMMARY=()
if has test; then
  t0=$SECONDS
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_FLASH_POISON_OUTPUTS=1 timeout ${TEST_TIMEOUT:-200} \
    python3 -m pytest -q -m gpu -n 8 tests/test_cuda.py -k "${PYTEST_K:-grad or bwd or determin}" 2>&1 \
    | tee "$OUT/test.log" | tail -15
  SUMMARY+=("test: $(tail -1 "$OUT/test.log") ($((SECONDS-t0)) s)")
fi
if has bench; then
  cp benchmarks/results/h200.json "$OUT/h200.json"
  timeout ${BENCH_TIMEOUT:-360} python3 benchmarks/bench_attention.py --sweep --dims "${DIMS:-128}" \
    --seqs "${SEQS:-512,1024,2048,4096,8192,16384}" --causal "${CAUSAL:-both}" \
    --modes "${MODES:-fwd_bwd,bwd}" --impls "${IMPLS:-jax_flash_cuda,jax_flash_cuda_det,fa3,cudnn}" \
    --iters "${ITERS:-100}" --repeats "${REPEATS:-5}" --out "$OUT/h200.json" 2>&1 \
    | grep -v Warning | tee "$OUT/bench.log" | tail -60
fi
printf '%s\n' "${SUMMARY[@]}"
