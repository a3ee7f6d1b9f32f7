#!/usr/bin/env bash
# The GPU check, run on the H200 (device machine) from the repo root:
#   build -> GPU test suite (outputs poisoned with NaN) -> sanitizer -> benchmark
# and a short table printed last. Stages can be chosen: tools/gpu_check.sh [build] [test] [sanitize] [bench] [sweep]
# Logs and results go to $OUT (the device tool brings them back) or ./gpu_out.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
STAGES=${*:-build test bench}
PY=${PYTHON:-python3}
declare -a SUMMARY=()
note() { SUMMARY+=("$1"); echo "== $1"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"

if has build; then
  t0=$SECONDS
  if [[ -d build_carry/lib ]]; then
    # Built on the CPU machine and carried: just put it on the path.
    export PYTHONPATH=$PWD:$PWD/build_carry/lib${PYTHONPATH:+:$PYTHONPATH}
    note "build: using carried build_carry/lib"
  elif [[ -f cuda/CMakeLists.txt ]]; then
    if $PY -m pip install --no-build-isolation --no-deps -q . >"$OUT/build.log" 2>&1; then
      note "build: pip install ok ($((SECONDS-t0)) s)"
      cd /tmp && $PY -c "import jax_flash; print(jax_flash.available_implementations())"; cd - >/dev/null
    else
      tail -40 "$OUT/build.log"; note "build: FAILED (see build.log)"
    fi
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    note "build: pure Python (no cuda/CMakeLists.txt)"
  fi
fi

if has test; then
  t0=$SECONDS
  # Poison every output buffer with NaN so unwritten elements fail the tests.
  JAX_FLASH_POISON_OUTPUTS=1 $PY -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/test_pallas.py tests/test_composition.py} \
      -x --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  rc=${PIPESTATUS[0]}
  note "tests: rc=$rc $(grep -E '[0-9]+ (passed|failed)' "$OUT/gpu_tests.log" | tail -1) ($((SECONDS-t0)) s)"
fi

if has sanitize && [[ -f tools/sanitize_case.py ]]; then
  t0=$SECONDS
  compute-sanitizer --tool memcheck --error-exitcode 1 $PY tools/sanitize_case.py >"$OUT/memcheck.log" 2>&1
  note "memcheck: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) ($((SECONDS-t0)) s)"
fi

if has bench; then
  $PY benchmarks/bench_attention.py ${BENCH_ARGS:-} --out "$OUT/h200.json" 2>&1 | tee "$OUT/bench.log" | tail -40
  note "bench: rc=${PIPESTATUS[0]}"
fi
if has sweep; then
  $PY benchmarks/bench_attention.py --sweep ${SWEEP_ARGS:-} --out "$OUT/h200.json" --plot "$OUT/h200_sweep.png" 2>&1 | tee "$OUT/sweep.log" | tail -60
  note "sweep: rc=${PIPESTATUS[0]}"
fi

echo; echo "==== summary ===="
printf '%s\n' "${SUMMARY[@]}"
