#!/usr/bin/env bash
# Ring attention across the GPUs of one host, from the repo root, with a
# prebuilt extension in .ab/jax_flash/ (tools/gpu/carried.sh):
#   tools/gpu/ring_scaling.sh [test] [bench]
# test: tests/test_multi_gpu.py (NaN-poisoned outputs) on every GPU;
# bench: benchmarks/bench_ring.py over device counts 1, 2, 4, 8 (those
# present), T = 128k and 256k (and 1M on 8 GPUs), causal and full, GQA 32q/8kv,
# D=128, fwd and fwd+bwd, into $OUT/ring_h200.json with the scaling plot.
# Environment: SEQS (default 131072,262144), DEVICES, MASKS, MODES, BENCH_TIMEOUT (per configuration),
# TRACE=1 (profiler traces of the multi-GPU runs into $OUT/trace).
DEFAULT_STAGES="test bench"
source "$(dirname "$0")/carried.sh" "$@"
N=$(nvidia-smi -L | wc -l)
SUMMARY=()
if has test; then
  t0=$SECONDS
  JAX_FLASH_POISON_OUTPUTS=1 timeout 400 python3 -m pytest -q -m gpu tests/test_multi_gpu.py 2>&1 \
    | tee "$OUT/test.log" | tail -15
  SUMMARY+=("test ($N GPUs): $(tail -1 "$OUT/test.log") ($((SECONDS-t0)) s)")
fi
if has bench; then
  cp benchmarks/results/ring_h200.json "$OUT/ring_h200.json" 2>/dev/null
  DEVS=${DEVICES:-$(for d in 1 2 4 8; do (( d <= N )) && printf '%s,' $d; done | sed 's/,$//')}
  python3 benchmarks/bench_ring.py --seqs "${SEQS:-131072,262144}" --devices "$DEVS" \
    --masks "${MASKS:-causal,full}" --modes "${MODES:-fwd,fwd_bwd}" --heads 32 --kv-heads 8 \
    --timeout "${BENCH_TIMEOUT:-240}" --out "$OUT/ring_h200.json" --plot "$OUT/ring_h200.png" \
    ${TRACE:+--trace "$OUT/trace"} 2>&1 | tee "$OUT/bench.log" | tail -40
  # The all-gather strategy at the first length, for the comparison.
  FIRST=${SEQS:-131072,262144}
  python3 benchmarks/bench_ring.py --seqs "${FIRST%%,*}" --devices "$DEVS" \
    --masks causal --modes fwd,fwd_bwd --heads 32 --kv-heads 8 --strategy all_gather \
    --timeout "${BENCH_TIMEOUT:-240}" --out "$OUT/ring_h200.json" 2>&1 | tee -a "$OUT/bench.log" | tail -8
  if (( N >= 8 )); then  # 1M tokens: 8 GPUs only
    python3 benchmarks/bench_ring.py --seqs 1048576 --devices 8 --masks causal \
      --modes fwd,fwd_bwd --heads 32 --kv-heads 8 --iters 2 --repeats 2 \
      --timeout "${BENCH_TIMEOUT:-240}" --out "$OUT/ring_h200.json" 2>&1 | tee -a "$OUT/bench.log" | tail -8
  fi
fi
printf '%s\n' "${SUMMARY[@]}"
