#!/usr/bin/env bash
# Builds the Hopper (sm_90a) test binaries into build_carry/ (git-ignored), to
# be copied to an H100/H200 host and run there:
#   build_carry/sm90_primitives   unit tests of TMA / wgmma / mbarrier / pingpong
#   build_carry/selftest_sm90     forward vs float64 reference (--quick, filter),
#                                 --bench: TF/s of the production kernel, every
#                                 ablation and sm80; --list: the ablations
# selftest_sm90 is the forward's tuning / ablation target: besides the
# production instantiations (cuda/instantiations/fwd_*_sm90.cu) it compiles the
# ablation configurations of cuda/tests/sm90_fwd_ablation.h (one object per
# head-dim bucket, cuda/tests/fwd_ablation_hdim*_sm90.cu), and the sm80
# forward (for the benchmark comparison) without its backward.
# Usage: tools/build/build_sm90_tests.sh [-j N]   (from anywhere; ~3-6 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
JOBS=$(nproc)
if [[ "${1:-}" == "-j" ]]; then JOBS=$2; fi
OUTDIR=build_carry
OBJ=build/obj_sm90_tests  # objects and ptxas logs (git-ignored, not needed on the GPU host)
mkdir -p "$OBJ" "$OUTDIR"
NVCC=${NVCC:-nvcc}
FLAGS=(-O3 -std=c++17 --expt-relaxed-constexpr -lineinfo --use_fast_math
       -gencode=arch=compute_90a,code=sm_90a -Icuda/include -Icuda
       -DJAX_FLASH_DISABLE_BACKWARD -Xptxas -v)
SOURCES=(cuda/tests/selftest_sm90.cu cuda/sm90/fwd/dispatch.cu cuda/instantiations/fwd_*_sm90.cu
         cuda/tests/fwd_ablation_hdim*_sm90.cu cuda/sm80/dispatch.cu cuda/instantiations/fwd_*_sm80.cu)

compile() {  # src -> obj, ptxas report kept next to it
  local src=$1 obj
  obj=$OBJ/$(echo "${1%.cu}" | tr / _).o  # cuda_sm80_dispatch.o, cuda_sm90_dispatch.o, ...
  "$NVCC" "${FLAGS[@]}" -c "$src" -o "$obj" >"$obj.log" 2>&1 || { cat "$obj.log"; return 1; }
  if grep -q -i "warning" "$obj.log"; then grep -i -B2 -A2 "warning" "$obj.log"; fi
}
export -f compile
export NVCC OBJ
export FLAGS_STR="${FLAGS[*]}"
t0=$SECONDS
printf '%s\n' "${SOURCES[@]}" | xargs -P "$JOBS" -I{} bash -c 'FLAGS=($FLAGS_STR); compile "$@"' _ {}
"$NVCC" -gencode=arch=compute_90a,code=sm_90a "$OBJ"/*.o -o "$OUTDIR/selftest_sm90"
"$NVCC" "${FLAGS[@]}" cuda/tests/sm90_primitives.cu -o "$OUTDIR/sm90_primitives" >"$OBJ/sm90_primitives.log" 2>&1 \
  || { cat "$OBJ/sm90_primitives.log"; exit 1; }
echo "built $OUTDIR/selftest_sm90 and $OUTDIR/sm90_primitives in $((SECONDS - t0)) s"
# CPU-only checks of the forward's host-side choices (tile order, policy).
g++ -std=c++17 -O2 -Wall -Wno-unknown-pragmas -Icuda/include -Icuda -I"${CUDA_INC:-/usr/local/cuda/include}" \
  cuda/tests/sm90_fwd_host_check.cpp -o "$OBJ/sm90_fwd_host_check"
# The FP8 forward's V transpose: the mapping and its bank behaviour.
g++ -std=c++17 -O2 -Wall -Icuda/include -Icuda cuda/tests/sm90_fp8_vt_check.cpp -o "$OBJ/sm90_fp8_vt_check"
# The FP8 pre-pass: launch 1's order, element coverage, the rotation's bits.
g++ -std=c++17 -O2 -Wall -ffp-contract=off -Icuda/include -Icuda cuda/tests/fp8_prepass_check.cpp \
  -o "$OBJ/fp8_prepass_check"
# Dropout masks drawn by the producer warpgroup: the bits written vs read.
g++ -std=c++17 -O2 -Wall -Wno-unknown-pragmas -Icuda/include -Icuda cuda/tests/sm90_drop_mask_check.cpp \
  -o "$OBJ/sm90_drop_mask_check"
"$OBJ/fp8_prepass_check"
"$OBJ/sm90_fp8_vt_check"
"$OBJ/sm90_drop_mask_check"
"$OBJ/sm90_fwd_host_check"
# Q in registers: that ptxas kept the Q fragments' registers for the whole mainloop.
python3 tools/lint/check_wgmma_a_regs.py "$OUTDIR/selftest_sm90" | tail -1

# ptxas summary of the sm90 forward kernels: registers (at entry; setmaxnreg
# then moves them between the roles), spills, stack. Kernel names:
# <element, head dim, tuning>; DefaultFwdTuning<d, d_v, causal-like, ...> is production,
# AblationTuning<i, d, d_v, causal-like> is row i of selftest_sm90 --list.
echo "sm90 fwd_kernel ptxas report:"
for log in "$OBJ"/cuda_instantiations_fwd_*_sm90.o.log "$OBJ"/cuda_tests_fwd_ablation_*_sm90.o.log; do
  grep -A3 "Compiling entry function '_ZN9jax_flash4sm9010fwd_kernel" "$log" |
    sed -nE "/Compiling entry/s/.*FwdMainloopI(6__half|13__nv_bfloat16)Li([0-9]+)EN.*(DefaultFwdTuning|AblationTuning)I((L[ib][0-9]+E)+)E.*(Static|Dynamic)PersistentTileScheduler.*/  \1 D=\2 \3<\4> \6/p; s/^ +([0-9]+ bytes stack frame.*)/   \1/p; s/.*(Used [0-9]+ registers).*/   \1/p" |
    sed -E 's/L[ib]([0-9]+)E/\1,/g; s/,>/>/; s/^  [0-9]+(__half|__nv_bfloat16)/  \1/' | paste -d' ' - - -
done

# The sm90 backward self-test / benchmark (build_carry/selftest_sm90_bwd).
tools/build/build_sm90_bwd_tests.sh -j "$JOBS"
