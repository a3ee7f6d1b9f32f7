#!/usr/bin/env bash
# The FP8 check, run on an H200 from the repo root in one command:
#   tests      JAX_FLASH_POISON_OUTPUTS=1 pytest -q -m gpu tests/test_fp8.py tests/test_fp8_cuda.py
#   sanitizer  compute-sanitizer memcheck and racecheck on tools/gpu/sanitize_case.py fp8
#              (fp8_attention(implementation="cuda") at T=200 S=333, D = 64, 128, 256: the
#              quantisation pre-pass and the FP8 forward), separate device allocations,
#              outputs NaN-poisoned
#   accuracy   benchmarks/fp8_accuracy.py --out $OUT/fp8_accuracy.json
#   bench      benchmarks/bench_fp8.py --out $OUT/h200_fp8.json
#   gap        tools/gpu/fp8_sim_gap.py: kernel vs simulation as S grows (not in the default steps)
# each step's output in $OUT/<step>.log, the next step run whatever the last one gave,
# a short summary printed last. Usage:
#   tools/gpu/fp8_check.sh                       # all four steps
#   FP8_STEPS=tests,sanitizer tools/gpu/fp8_check.sh
# The extension is found as gpu_check.sh's build stage finds it: a prebuilt
# jax_flash/_jax_flash_cuda*.so (PYTHONPATH=repo root), else an installed jax_flash with
# "cuda" (PYTHONSAFEPATH=1 keeps the source tree off sys.path), else pip install . from
# cuda/CMakeLists.txt, else pure Python.
# Knobs: FP8_STEPS, PYTHON, FP8_BUILD=0 (never pip install), FP8_TESTS (pytest paths; default
# tests/test_fp8.py and tests/test_fp8_cuda.py, those present), FP8_PYTEST_ARGS, FP8_ACCURACY_ARGS,
# FP8_BENCH_ARGS, FP8_BUDGET_S (wall-clock budget of the whole script, default 570: each
# step's timeout is cut to what is left, so the summary is printed inside a 600 s call),
# TESTS_TIMEOUT, SANITIZER_TIMEOUT, ACCURACY_TIMEOUT, BENCH_TIMEOUT (per-step limits).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
STEPS=",${FP8_STEPS:-tests,sanitizer,accuracy,bench},"
PY=${PYTHON:-python3}
BUDGET=${FP8_BUDGET_S:-570}
declare -a SUMMARY=()
note() { SUMMARY+=("$1"); echo "== $1"; }
has() { [[ $STEPS == *",$1,"* ]]; }
# limit STEP_DEFAULT -> seconds for the next step: its default, or what is left of the budget
limit() { local left=$((BUDGET - SECONDS - 10)); ((left < 5)) && left=5; echo $(($1 < left ? $1 : left)); }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"

t0=$SECONDS
if compgen -G "jax_flash/_jax_flash_cuda*.so" >/dev/null; then
  # Prebuilt elsewhere (same nvcc, jax 0.11.2 FFI headers) and unpacked here.
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  note "extension: prebuilt $(ls jax_flash/_jax_flash_cuda*.so)"
elif (cd /tmp && $PY -c "import sys, jax_flash; sys.exit('cuda' not in jax_flash.available_implementations())") 2>/dev/null; then
  export PYTHONSAFEPATH=1
  note "extension: installed jax_flash ($(cd /tmp && $PY -c 'import jax_flash, os; print(os.path.dirname(jax_flash.__file__))'))"
elif [[ -f cuda/CMakeLists.txt && ${FP8_BUILD:-1} != 0 ]]; then
  export PYTHONSAFEPATH=1
  if timeout "$(limit 400)" $PY -m pip install --no-build-isolation --no-deps -q . >"$OUT/build.log" 2>&1; then
    note "extension: pip install ok ($((SECONDS - t0)) s)"
  else
    tail -40 "$OUT/build.log"; note "extension: pip install FAILED (see build.log)"
  fi
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  note "extension: none (pure Python: no cuda/CMakeLists.txt, or FP8_BUILD=0)"
fi
(cd /tmp && $PY -c "import jax, jax_flash; print('jax', jax.__version__, jax.devices(), 'jax_flash', jax_flash.available_implementations(), 'fp8_attention' in dir(jax_flash))") 2>&1 | tee "$OUT/env.txt"

if has tests; then
  t0=$SECONDS
  tests=${FP8_TESTS:-$(ls tests/test_fp8.py tests/test_fp8_cuda.py 2>/dev/null | tr '\n' ' ')}
  if [[ -n ${tests// /} ]] && compgen -G "${tests%% *}" >/dev/null; then
    JAX_FLASH_POISON_OUTPUTS=1 timeout -k 10 "$(limit ${TESTS_TIMEOUT:-200})" $PY -m pytest -q -p no:cacheprovider -m gpu \
        $tests ${FP8_PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -25
    rc=${PIPESTATUS[0]}
    note "tests: rc=$rc $(grep -E '[0-9]+ (passed|failed|error|skipped|deselected)' "$OUT/tests.log" | tail -1) ($((SECONDS - t0)) s)"
  else
    note "tests: ${tests:-tests/test_fp8.py} not found, skipped"
  fi
fi

if has sanitizer; then
  # tools/gpu/sanitize_case.py fp8: the pre-pass and the FP8 forward (V transposed
  # in shared memory) at D = 64, 128, 256; memcheck and racecheck.
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [[ -z $SAN ]]; then
    note "sanitizer: compute-sanitizer not found, skipped"
  else
    for tool in memcheck racecheck; do
      t0=$SECONDS
      # Platform allocator: every buffer its own cudaMalloc, so memcheck sees the edges.
      XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_FLASH_POISON_OUTPUTS=1 \
        timeout -k 10 "$(limit ${SANITIZER_TIMEOUT:-150})" "$SAN" --tool "$tool" --error-exitcode 1 \
        $PY tools/gpu/sanitize_case.py fp8 2>&1 | tee "$OUT/sanitizer_$tool.log" | tail -8
      rc=${PIPESTATUS[0]}
      note "sanitizer ($tool): rc=$rc $(grep -E '(ERROR|RACECHECK) SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1) $(grep -cE '^== case fp8: ok' "$OUT/sanitizer_$tool.log") case ok ($((SECONDS - t0)) s)"
    done
  fi
fi

if has accuracy; then
  t0=$SECONDS
  timeout -k 10 "$(limit ${ACCURACY_TIMEOUT:-150})" $PY benchmarks/fp8_accuracy.py --out "$OUT/fp8_accuracy.json" \
      ${FP8_ACCURACY_ARGS:-} 2>&1 | tee "$OUT/accuracy.log" | tail -40
  rc=${PIPESTATUS[0]}
  note "accuracy: rc=$rc $(grep -E '^outliers_0.1pct, ' "$OUT/accuracy.log" | tail -1) ($((SECONDS - t0)) s)"
fi

if has bench; then
  t0=$SECONDS
  timeout -k 10 "$(limit ${BENCH_TIMEOUT:-400})" $PY benchmarks/bench_fp8.py --out "$OUT/h200_fp8.json" \
      ${FP8_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -45
  rc=${PIPESTATUS[0]}
  note "bench: rc=$rc, $(grep -c '"impl"' "$OUT/h200_fp8.json" 2>/dev/null || echo 0) rows in h200_fp8.json ($((SECONDS - t0)) s)"
fi

if has gap; then
  t0=$SECONDS
  timeout -k 10 "$(limit ${GAP_TIMEOUT:-150})" $PY tools/gpu/fp8_sim_gap.py ${FP8_GAP_ARGS:-} 2>&1 \
      | tee "$OUT/gap.log" | tail -8
  note "gap: rc=${PIPESTATUS[0]} ($((SECONDS - t0)) s), table in gap.log"
fi

echo; echo "==== summary ($SECONDS s) ===="
printf '%s\n' "${SUMMARY[@]}"
