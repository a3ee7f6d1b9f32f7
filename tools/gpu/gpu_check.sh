#!/usr/bin/env bash
# The GPU check, run on an H200 from the repo root:
#   build -> GPU test suite (outputs poisoned with NaN) -> sanitizer -> benchmark
# and a short table printed last. Stages can be chosen:
#   tools/gpu/gpu_check.sh [build] [selftest] [sm90] [test] [sanitize] [sanitize_sm90] [sanitize_jax] [bench] [sweep] [ring]
# Environment knobs: GPU_TESTS (pytest paths), PYTEST_ARGS, TEST_TIMEOUT, BENCH_ARGS, BENCH_TIMEOUT,
# SM90_SELFTEST (binary, default build_carry/selftest_sm90), SM90_BENCH=1 (ablation table),
# SWEEP_ARGS, RING_ARGS, SANITIZERS, SANITIZE_TIMEOUT, SANITIZE_SM90_FWD / SANITIZE_SM90_BWD
# (self-test filters of the sanitize_sm90 stage).
# Logs and results go to $OUT (default ./gpu_out).
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
  if compgen -G "jax_flash/_jax_flash_cuda*.so" >/dev/null; then
    # Prebuilt elsewhere (same nvcc, jax 0.11.2 FFI headers) and unpacked here.
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    note "build: using the prebuilt extension $(ls jax_flash/_jax_flash_cuda*.so)"
  elif [[ -f cuda/CMakeLists.txt ]]; then
    # Installed copy only: PYTHONSAFEPATH keeps the source tree (no .so) off sys.path.
    export PYTHONSAFEPATH=1
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

if has selftest; then
  # Standalone kernel self-test (no JAX): odd sizes, all features, NaN-poisoned outputs.
  if [[ ! -x build_carry/selftest ]]; then
    mkdir -p build_carry
    nvcc -O3 -std=c++17 --expt-relaxed-constexpr --threads 8 -gencode=arch=compute_90,code=sm_90 \
      -Icuda/include -Icuda cuda/tests/selftest.cu cuda/sm80/dispatch.cu cuda/instantiations/*_sm80.cu \
      -o build_carry/selftest >"$OUT/selftest_build.log" 2>&1 || tail -20 "$OUT/selftest_build.log"
  fi
  t0=$SECONDS
  timeout ${SELFTEST_TIMEOUT:-120} build_carry/selftest >"$OUT/selftest.log" 2>&1
  rc=$?
  tail -60 "$OUT/selftest.log"
  note "selftest: rc=$rc $(tail -1 "$OUT/selftest.log") ($((SECONDS-t0)) s)"
fi

if has sm90; then
  # Hopper kernels without JAX: primitive unit tests, then the forward against
  # a float64 reference for every kept tuning configuration (tools/build/build_sm90_tests.sh).
  t0=$SECONDS
  bin=${SM90_SELFTEST:-build_carry/selftest_sm90}
  timeout 60 build_carry/sm90_primitives >"$OUT/sm90.log" 2>&1
  rc1=$?
  if [[ -x build_carry/sm90_bwd_primitives ]]; then  # the backward's building blocks
    timeout 60 build_carry/sm90_bwd_primitives >>"$OUT/sm90.log" 2>&1
    note "sm90 backward primitives: rc=$?"
  fi
  timeout 200 $bin >>"$OUT/sm90.log" 2>&1
  rc2=$?
  if [[ -n "${SM90_BENCH:-}" ]]; then timeout 200 $bin --bench >>"$OUT/sm90.log" 2>&1; fi
  if [[ -x build_carry/selftest_sm90_bwd ]]; then  # the FA3-style backward
    timeout 300 build_carry/selftest_sm90_bwd >>"$OUT/sm90.log" 2>&1
    note "sm90 backward: rc=$? $(grep -E 'passed, [0-9]+ failed' "$OUT/sm90.log" | tail -1)"
    if [[ -n "${SM90_BENCH:-}" ]]; then timeout 300 build_carry/selftest_sm90_bwd --bench >>"$OUT/sm90.log" 2>&1; fi
  fi
  grep -v PASS "$OUT/sm90.log" | tail -25
  note "sm90: primitives rc=$rc1, $bin rc=$rc2 $(grep -E 'passed, [0-9]+ failed' "$OUT/sm90.log" | tail -1) ($((SECONDS-t0)) s)"
fi

if has test; then
  t0=$SECONDS
  # Poison every output buffer with NaN so unwritten elements fail the tests.
  JAX_FLASH_POISON_OUTPUTS=1 timeout ${TEST_TIMEOUT:-1200} $PY -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/test_pallas.py tests/test_composition.py} \
      ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  rc=${PIPESTATUS[0]}
  note "tests: rc=$rc $(grep -E '[0-9]+ (passed|failed)' "$OUT/gpu_tests.log" | tail -1) ($((SECONDS-t0)) s)"
fi

if has sanitize; then
  for tool in ${SANITIZERS:-memcheck racecheck synccheck}; do
    t0=$SECONDS
    timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 1 build_carry/selftest --quick >"$OUT/$tool.log" 2>&1
    note "$tool (selftest --quick): rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/$tool.log" | tail -1) ($((SECONDS-t0)) s)"
  done
fi
if has sanitize_sm90; then
  # The Hopper self-tests on small cases (filters: every tuning configuration of the
  # forward on persistent / dynamic-scheduler tiles, a multi-block backward).
  for tool in ${SANITIZERS:-memcheck racecheck synccheck}; do
    for t in "selftest_sm90:${SANITIZE_SM90_FWD:-persistent 1 CTA causal GQA}" \
             "selftest_sm90_bwd:${SANITIZE_SM90_BWD:-multiblock MQA causal}"; do
      bin=build_carry/${t%%:*}
      [[ -x $bin ]] || continue
      t0=$SECONDS
      timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 1 $bin "${t#*:}" \
        >"$OUT/${t%%:*}_$tool.log" 2>&1
      note "$tool (${t%%:*} '${t#*:}'): rc=$? $(grep -E 'SUMMARY' "$OUT/${t%%:*}_$tool.log" | tail -1) ($((SECONDS-t0)) s)"
    done
  done
fi
if has sanitize_jax; then
  t0=$SECONDS
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 $PY tools/gpu/sanitize_case.py >"$OUT/memcheck_jax.log" 2>&1
  note "memcheck (jax, tools/gpu/sanitize_case.py): rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_jax.log" | tail -1) ($((SECONDS-t0)) s)"
fi

if has bench; then
  timeout ${BENCH_TIMEOUT:-900} $PY benchmarks/bench_attention.py ${BENCH_ARGS:-} --out "$OUT/h200.json" 2>&1 | tee "$OUT/bench.log" | tail -40
  note "bench: rc=${PIPESTATUS[0]}"
fi
if has sweep; then
  timeout ${SWEEP_TIMEOUT:-1200} $PY benchmarks/bench_attention.py --sweep ${SWEEP_ARGS:-} --out "$OUT/h200.json" 2>&1 | tee "$OUT/sweep.log" | tail -60
  note "sweep: rc=${PIPESTATUS[0]}"
fi

if has ring; then
  # Context parallelism: one long causal attention on 1 GPU vs ring over all.
  timeout ${RING_TIMEOUT:-300} $PY benchmarks/bench_ring.py ${RING_ARGS:-} --out "$OUT/ring.json" 2>&1 | tail -8
  note "ring: rc=${PIPESTATUS[0]}"
fi

echo; echo "==== summary ===="
printf '%s\n' "${SUMMARY[@]}"
