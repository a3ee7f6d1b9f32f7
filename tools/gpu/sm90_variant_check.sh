#!/usr/bin/env bash
# Runs the sm90 forward's test binaries on the H200, in the order that stops
# early on a broken kernel, and measures the ablation table at the power cap:
#   tools/gpu/sm90_variant_check.sh DIR [CONFIG]
# DIR holds sm90_primitives and selftest_sm90 built by tools/build/build_sm90_tests.sh
# (e.g. build_carry, or a candidate branch's binaries copied into an ignored
# build_carry_* dir of this checkout). CONFIG
# is the column to compare with "default" (a name of selftest_sm90 --list, or
# of a candidate configuration added to cuda/tests/sm90_fwd_ablation.h).
# Logs go to $OUT (or ./gpu_out).
#   1. sm90_primitives               unit tests of the PTX building blocks (exact)
#   2. selftest_sm90 --quick, then the full self-test: the production kernel
#      and every ablation of every case against the float64 reference,
#      outputs NaN-poisoned
#   3. compute-sanitizer racecheck + synccheck on one small persistent case
#      ($SAN_CASE: another self-test case filter; NO_BENCH=1 skips step 4)
#   4. selftest_sm90 --bench --launches=300 --rows=2: the D=128 rows with the
#      GPU at its power cap (as a sustained JAX run is), configurations
#      interleaved: the ablation table of cuda/sm90/README.md;
#      then --rows=2 with the default 10 launches (below the cap)
# A step that fails skips the benchmark; the summary is printed last.
set -uo pipefail
DIR=${1:?usage: tools/gpu/sm90_variant_check.sh DIR [CONFIG]}
CONFIG=${2:-default}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
declare -a SUMMARY=()
ok=1
step() {  # name timeout cmd...
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  SUMMARY+=("$name: rc=$rc $(tail -1 "$OUT/$name.log") ($((SECONDS - t0)) s)")
  echo "== ${SUMMARY[-1]}"
  [[ $rc == 0 ]] || ok=0
}
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
cat "$DIR/COMMIT" 2>/dev/null
step primitives 60 "$DIR/sm90_primitives"
[[ $ok == 1 ]] && step selftest_quick 120 "$DIR/selftest_sm90" --quick
[[ $ok == 1 ]] && step selftest_full 300 "$DIR/selftest_sm90"
if [[ $ok == 1 ]]; then
  for tool in racecheck synccheck; do
    step "san_$tool" 120 compute-sanitizer --tool $tool --error-exitcode 1 "$DIR/selftest_sm90" "${SAN_CASE:-d128 persistent 1 CTA}"
  done
fi
if [[ $ok == 1 && -z ${NO_BENCH:-} ]]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 200 >"$OUT/smi.csv" &
  smi=$!
  step bench_capped 240 "$DIR/selftest_sm90" --bench --launches=300 --rows=2
  step bench_burst 120 "$DIR/selftest_sm90" --bench --rows=2
  kill $smi
  for b in bench_capped bench_burst; do
    echo "-- $b"; grep -E "^(D |128 )" "$OUT/$b.log"
  done
  echo "(column $CONFIG is the candidate; compare with the default column, row by row)"
fi
echo; echo "==== summary"; printf '%s\n' "${SUMMARY[@]}"
[[ $ok == 1 ]]
