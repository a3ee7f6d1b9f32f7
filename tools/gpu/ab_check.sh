#!/usr/bin/env bash
# A/B check of two builds of the extension on one H200, from the repo root:
#   tools/gpu/ab_check.sh [ab] [test] [sanitize]        (default: all three)
# Builds: A (the reference) in .ab/A/, B (the candidate) in .ab/B/, each
# `_jax_flash_cuda*.so.xz` and `_build.json` (tools/gpu/pack_ab.sh fills
# them); the Python source is this tree's. tools/gpu/carried.sh does the rest
# of the set-up.
# ab: the benchmarks, each build in processes of its own (one module name),
#   one process per turn, turns in the order $AB_ORDER ("A B B A"), each
#   running (tools/gpu/ab_benches.py, peers from .whl/ left out):
#     bench_attention.py  T=8192 B=2, D=64/128/256 (H=32/16/8), causal and
#                         not, fwd and fwd+bwd, beside cuDNN; D=128 T=1024 B=16
#     bench_packing.py    both cases, fwd and fwd+bwd
#     bench_decode.py     the four shapes, contiguous and paged (cuDNN beside)
#     bench_fp8.py        the kernel rows (jax_flash_fp8), D=64/128/256, T=8192
#   The turns share a JAX compilation cache, so cuDNN's and XLA's programs
#   compile once (jax_flash's calls, custom-partitioned, compile in every
#   process and run the kernels of that process's build). Last, the table of
#   tools/gpu/ab_table.py: case, A, B, B/A, within +-$AB_TOL % (1.5); rows
#   beside cuDNN are judged by their ratio to cuDNN. JSON: $OUT/ab.json, the
#   turns' rows and logs in $OUT/ab/N_BUILD/.
# test: with build $CHECK_BUILD (B), tests/test_decode_cuda.py,
#   test_fp8_cuda.py, test_varlen.py and test_cuda.py (`-m gpu $TEST_ARGS`,
#   default -x, outputs NaN-poisoned, -n $TEST_WORKERS (8)), each suite within
#   its share of the stage; one line per suite.
# sanitize: with build $CHECK_BUILD, compute-sanitizer ($SANITIZERS: memcheck,
#   racecheck) on tools/gpu/sanitize_case.py: the cases sm90_fwd, sm90_bwd,
#   varlen, decode and fp8 in one process per tool, and sm80
#   (JAX_FLASH_CUDA_FAMILY=sm80) in another; one line per run with the
#   sanitizer's summary, one per case with the reports printed during it
#   (and how many of them name a jax_flash kernel: XLA's own kernels are
#   checked too).
# Each stage runs whatever the others gave. Time: the stages stop at
# AB_STAGE_S (300), TEST_STAGE_S (110) and the rest of AB_BUDGET_S (530: the
# whole script, so that `ab test sanitize` fits in 9 minutes); inside a stage
# each turn / suite / run gets an equal share of what is left.
# Environment: AB_ORDER, AB_TOL, AB_ATTN_ARGS, AB_ATTN_1K_ARGS, AB_PACKING_ARGS,
# AB_DECODE_ARGS, AB_FP8_ARGS (the benchmarks' arguments; "skip" leaves one out), AB_STAGE_S,
# TEST_STAGE_S, AB_BUDGET_S, CHECK_BUILD, TESTS (pytest paths), TEST_ARGS, TEST_WORKERS,
# SANITIZERS, SANITIZE_CASES.
# Logs and results go to $OUT (default ./gpu_out); the summary is printed
# last, then the A/B table.
DEFAULT_STAGES="ab test sanitize"
source "$(dirname "$0")/carried.sh" "$@"
BUDGET=${AB_BUDGET_S:-530}
BUILDS=${TMPDIR:-/tmp}/jax_flash_ab
SUMMARY=()
note() { SUMMARY+=("$1"); echo "== $1"; }
# end_of SECONDS_FROM_NOW: that moment, or the end of the budget if sooner.
end_of() { local e=$((SECONDS + $1)) b=$((BUDGET - 10)); echo $((e < b ? e : b)); }
# share END N: seconds for the next of N steps that must finish by END (>= 5).
share() { local s=$(( ($1 - SECONDS) / $2 )); echo $((s < 5 ? 5 : s)); }
# use_build A|B: that build's extension in jax_flash/ (the previous one removed).
use_build() {
  [[ -d $BUILDS/$1 ]] || return 1
  rm -f jax_flash/_jax_flash_cuda*.so jax_flash/_build.json
  install_build "$BUILDS/$1"
}
ext_id() { sha256sum jax_flash/_jax_flash_cuda*.so 2>/dev/null | cut -c1-12 | paste -sd' ' -; }

# Both builds unpacked once, then swapped in per process.
rm -rf "$BUILDS"
for b in A B; do
  if compgen -G ".ab/$b/_jax_flash_cuda*.so*" >/dev/null; then
    mkdir -p "$BUILDS/$b" && install_build ".ab/$b" "$BUILDS/$b"
    echo "build $b: $(cd "$BUILDS/$b" && sha256sum _jax_flash_cuda*.so | cut -c1-12) $(cat "$BUILDS/$b/_build.json" 2>/dev/null | tr -d '\n' | cut -c1-200)"
  else
    echo "build $b: none in .ab/$b/"
  fi
done

if has ab; then
  t_stage=$SECONDS
  end=$(end_of "${AB_STAGE_S:-300}")
  read -r -a ORDER <<< "${AB_ORDER:-A B B A}"
  SPECS=(
    "attention:${AB_ATTN_ARGS:---sweep --seqs 8192 --impls jax_flash_cuda,cudnn --modes fwd,fwd_bwd --iters 20 --repeats 3}"
    "attention:${AB_ATTN_1K_ARGS:---sweep --seqs 1024 --dims 128 --impls jax_flash_cuda,cudnn --modes fwd,fwd_bwd --iters 100 --repeats 3}"
    "packing:${AB_PACKING_ARGS:---iters 50 --repeats 3}"
    "decode:${AB_DECODE_ARGS:---iters 50 --repeats 3}"
    "fp8:${AB_FP8_ARGS:---impls jax_flash_fp8 --dims 64,128,256 --seqs 8192 --causal both --iters 20 --repeats 3}"
  )
  # A bench whose arguments are "skip" is left out.
  for i in "${!SPECS[@]}"; do [[ ${SPECS[$i]#*:} == skip ]] && unset "SPECS[$i]"; done
  SPECS=("${SPECS[@]}")
  rm -rf "$OUT/ab" "$OUT/ab.json" "$OUT/ab_table.txt"
  if [[ ! -d $BUILDS/A || ! -d $BUILDS/B ]]; then
    note "ab: skipped (needs .ab/A and .ab/B: tools/gpu/pack_ab.sh)"
  else
    for i in "${!ORDER[@]}"; do
      b=${ORDER[$i]} n=$((i + 1)) t0=$SECONDS
      dir=$OUT/ab/${n}_$b
      if [[ $b != [AB] ]] || ! use_build "$b"; then
        note "ab turn $n: no build '$b' (AB_ORDER holds A and B)"; continue
      fi
      mkdir -p "$dir"
      limit=$(share "$end" $((${#ORDER[@]} - i)))
      # PYTHONPATH without /tmp/site: the peers' wheels stay out of these runs.
      PYTHONPATH=$PWD JAX_COMPILATION_CACHE_DIR=$BUILDS/jax_cache \
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
        timeout -k 10 "$limit" python3 tools/gpu/ab_benches.py "$dir" "${SPECS[@]}" >"$dir/log" 2>&1
      rc=$?
      # "attention ok 41 s, packing ok 12 s, ..." from the driver's lines
      benches=$(sed -nE 's/^== bench_([a-z0-9]+)\.py (ok|FAILED).*\(([0-9]+ s)\)$/\1 \2 \3/p' "$dir/log" |
                paste -sd, - | sed 's/,/, /g')
      note "ab turn $n ($b, $(ext_id)): rc=$rc$( ((rc == 124)) && echo " (stopped at its ${limit} s)"): ${benches:-no benchmark finished} ($((SECONDS - t0)) s)"
    done
    python3 tools/gpu/ab_table.py "$OUT/ab" --tol "${AB_TOL:-1.5}" --json "$OUT/ab.json" >"$OUT/ab_table.txt" 2>&1
    note "ab: $(tail -1 "$OUT/ab_table.txt") ($((SECONDS - t_stage)) s; table last)"
  fi
fi

if has test; then
  t_stage=$SECONDS
  end=$(end_of "${TEST_STAGE_S:-110}")
  use_build "${CHECK_BUILD:-B}" || note "test: no build ${CHECK_BUILD:-B} in .ab/; testing jax_flash/ as it is ($(ext_id))"
  read -r -a SUITES <<< "${TESTS:-tests/test_decode_cuda.py tests/test_fp8_cuda.py tests/test_varlen.py tests/test_cuda.py}"
  for i in "${!SUITES[@]}"; do
    s=${SUITES[$i]} t0=$SECONDS
    log=$OUT/$(basename "$s" .py).log
    limit=$(share "$end" $((${#SUITES[@]} - i)))
    # SIGINT at the limit: pytest stops and still prints its counts.
    XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_FLASH_POISON_OUTPUTS=1 timeout -s INT -k 15 "$limit" \
      python3 -m pytest -q -p no:cacheprovider -m gpu ${TEST_ARGS--x} -n "${TEST_WORKERS:-8}" "$s" >"$log" 2>&1
    rc=$?
    counts=$(grep -E '[0-9]+ (passed|failed|error|errors|skipped|deselected)|no tests ran' "$log" | tail -1)
    note "test $s: rc=$rc$( ((rc == 124)) && echo " (stopped at its ${limit} s)") ${counts:-no counts, see $log} ($((SECONDS - t0)) s)"
  done
fi

if has sanitize; then
  end=$(end_of "$BUDGET")
  use_build "${CHECK_BUILD:-B}" || note "sanitize: no build ${CHECK_BUILD:-B} in .ab/; checking jax_flash/ as it is ($(ext_id))"
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  read -r -a TOOLS <<< "${SANITIZERS:-memcheck racecheck}"
  CASE_GROUPS=("${SANITIZE_CASES:-sm90_fwd sm90_bwd varlen decode fp8}" "sm80")
  if [[ -z $SAN ]]; then
    note "sanitize: compute-sanitizer not found"
  else
    runs=$((${#TOOLS[@]} * ${#CASE_GROUPS[@]})) k=0
    for tool in "${TOOLS[@]}"; do
      for cases in "${CASE_GROUPS[@]}"; do
        t0=$SECONDS k=$((k + 1))
        log=$OUT/sanitize_${tool}_${cases// /_}.log
        limit=$(share "$end" $((runs - k + 1)))
        family=; [[ $cases == sm80 ]] && family=sm80
        # Platform allocator: every buffer its own cudaMalloc, so memcheck sees the edges.
        JAX_FLASH_CUDA_FAMILY=$family XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \
          JAX_FLASH_POISON_OUTPUTS=1 timeout -k 10 "$limit" "$SAN" --tool "$tool" --error-exitcode 1 \
          python3 tools/gpu/sanitize_case.py $cases >"$log" 2>&1
        rc=$?
        note "$tool [$cases]: rc=$rc$( ((rc == 124)) && echo " (stopped at its ${limit} s)") $(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1 | sed 's/^=* *//') ($((SECONDS - t0)) s)"
        # Per case: the sanitizer's reports (a line "========= X", X not indented,
        # and the indented lines after it) between the case's marker and the
        # next one, and how many of them name a jax_flash kernel or function.
        while IFS= read -r line; do note "  $tool $line"; done < <(awk '
          function close_report() { if (open) { n[cur]++; if (ours) m[cur]++; open = 0 } }
          /^== case [A-Za-z0-9_]+$/ { close_report(); c = $3; order[++k] = c; next }
          /^== case [A-Za-z0-9_]+: / { close_report(); name = $3; sub(/:$/, "", name)
                                        st[name] = substr($0, index($0, ": ") + 2); next }
          /^========= (COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|Target application)/ { close_report(); next }
          /^========= [^ ]/ { close_report(); open = 1; ours = /jax_flash/; cur = (c == "" ? "(before the first case)" : c); next }
          /^=========  / { if (open && /jax_flash/) ours = 1; next }
          END {
            close_report()
            if (n["(before the first case)"]) print "before the first case: " n["(before the first case)"] " reports"
            for (i = 1; i <= k; i++) {
              c = order[i]; s = "did not finish"
              if (c in st) s = st[c]
              print c ": " s ", " (n[c] + 0) " reports (" (m[c] + 0) " naming jax_flash)"
            }
          }' "$log")
      done
    done
  fi
fi

echo; echo "==== summary ($SECONDS s) ===="
printf '%s\n' "${SUMMARY[@]}"
if [[ -s $OUT/ab_table.txt ]]; then
  echo; echo "==== A/B (build A: reference, B: candidate) ===="
  cat "$OUT/ab_table.txt"
fi
