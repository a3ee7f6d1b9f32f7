#!/usr/bin/env bash
# Builds the Hopper (sm_90a) backward self-test into build_carry/ (git-ignored),
# to be copied to an H100/H200 host and run there:
#   build_carry/selftest_sm90_bwd   sm90 backward vs float64 reference (--quick,
#                                   filter; "det" rows: deterministic mode, 3 runs
#                                   compared bitwise), --bench: TF/s next to the sm80
#                                   backward, incl. the deterministic mode
# With the backward's tuning table (cuda/tests/sm90_bwd_tuning.cu, bf16):
# variant 1, dQ by row bulk reductions (the dq_tensor=0 rows of the ptxas
# report); 2, hdim 128 with kBlockM 80 (dQ_swapAB), the default for masks
# without a causal / local bound (the BM=80 rows); 3, the bucket's own tile.
# Links the sm90 backward (bwd_dispatch.cu + bwd_*_sm90.cu) and the whole sm80
# family (its forward gives the benchmark's LSE, its backward the comparison),
# all compiled for sm_90a. Also prints the ptxas register/spill report of the
# sm90 backward kernels. Also builds build_carry/sm90_bwd_primitives (GPU unit
# test of the backward's building blocks) and builds and runs the CPU-only
# index-math check cuda/tests/sm90_bwd_layout_check.cpp (fails the script on a
# mismatch). Called by tools/build/build_sm90_tests.sh; runs alone too.
# Usage: tools/build/build_sm90_bwd_tests.sh [-j N]   (~5-8 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
JOBS=$(nproc)
if [[ "${1:-}" == "-j" ]]; then JOBS=$2; fi
OUTDIR=build_carry
OBJ=build/obj_sm90_bwd_tests  # objects and ptxas logs (git-ignored, not needed on the GPU host)
mkdir -p "$OBJ" "$OUTDIR"
NVCC=${NVCC:-nvcc}
FLAGS=(-O3 -std=c++17 --expt-relaxed-constexpr -lineinfo --use_fast_math
       -gencode=arch=compute_90a,code=sm_90a -Icuda/include -Icuda -Xptxas -v)
SOURCES=(cuda/tests/selftest_sm90_bwd.cu cuda/tests/sm90_bwd_tuning.cu cuda/sm90/bwd/bwd_dispatch.cu
         cuda/instantiations/bwd_*_sm90.cu
         cuda/sm80/dispatch.cu cuda/instantiations/fwd_*_sm80.cu cuda/instantiations/bwd_*_sm80.cu)

compile() {  # src -> obj, ptxas report kept next to it
  local src=$1 obj
  obj=$OBJ/$(echo "${1%.cu}" | tr / _).o
  "$NVCC" "${FLAGS[@]}" -c "$src" -o "$obj" >"$obj.log" 2>&1 || { cat "$obj.log"; return 1; }
  if grep -q -i "warning" "$obj.log"; then grep -i -B2 -A2 "warning" "$obj.log"; fi
}
export -f compile
export NVCC OBJ
export FLAGS_STR="${FLAGS[*]}"
t0=$SECONDS
printf '%s\n' "${SOURCES[@]}" | xargs -P "$JOBS" -I{} bash -c 'FLAGS=($FLAGS_STR); compile "$@"' _ {}
"$NVCC" -gencode=arch=compute_90a,code=sm_90a "$OBJ"/*.o -o "$OUTDIR/selftest_sm90_bwd"
echo "built $OUTDIR/selftest_sm90_bwd in $((SECONDS - t0)) s"

# GPU unit test of the backward's building blocks (store_ds + the dQ / dK
# GEMMs, the dQ reductions, the dK store), to localise a selftest failure.
"$NVCC" "${FLAGS[@]}" cuda/tests/sm90_bwd_primitives.cu -o "$OUTDIR/sm90_bwd_primitives" \
  >"$OBJ/sm90_bwd_primitives.log" 2>&1 || { cat "$OBJ/sm90_bwd_primitives.log"; exit 1; }
if grep -q -i "warning" "$OBJ/sm90_bwd_primitives.log"; then grep -i -B2 -A2 "warning" "$OBJ/sm90_bwd_primitives.log"; fi
echo "built $OUTDIR/sm90_bwd_primitives"

# CPU-only check of the backward's index math (no GPU needed): runs here.
CUDA_INC=${CUDA_INC:-}
if [[ -z "$CUDA_INC" ]]; then  # the toolkit's include dir (nvcc may be a wrapper script)
  for d in "$(dirname "$(readlink -f "$(command -v "$NVCC")")")/../include" /usr/local/cuda/include; do
    if [[ -f "$d/cuda.h" ]]; then CUDA_INC=$d; break; fi
  done
fi
g++ -std=c++17 -O2 -Wall -Wno-unknown-pragmas -Icuda/include -Icuda -I"$CUDA_INC" \
  cuda/tests/sm90_bwd_layout_check.cpp -o "$OBJ/sm90_bwd_layout_check"
"$OBJ/sm90_bwd_layout_check"

# ptxas summary of the sm90 backward kernels: registers at entry (setmaxnreg
# then gives the consumers 240), spills, stack; C75xx notes (wgmma
# serialisation, injected warpgroup.arrive) would be performance bugs.
echo "sm90 bwd_kernel ptxas report (dtype, D, D_v, kBlockM, kBlockN, dO stages, SdP_swapAB, softcap, dQ tensor reductions, deterministic, packed):"
for log in "$OBJ"/cuda_instantiations_bwd_*_sm90.o.log "$OBJ"/cuda_tests_sm90_bwd_tuning.o.log; do
  # (The config's six arguments first become one readable group: sed has 9 back-references.)
  grep -A3 "Compiling entry function '_ZN9jax_flash4sm9010bwd_kernel" "$log" |
    sed -E "s/NS0_9BwdConfigILi([0-9]+)ELi([0-9]+)ELi([0-9]+)ELi([0-9]+)ELb([01])ELi([0-9]+)EEE/<D=\1 D_v=\6 BM=\2 BN=\3 dO_stages=\4 swapAB=\5>/; s/NS0_16BwdDropoutConfigI<([^>]*)>EE/<\1 dropout>/" |
    sed -nE "/Compiling entry/s/.*bwd_kernelI[0-9]*([^<]*)<([^>]*)>Lb([01])ELb([01])ELb([01])ELb([01])E.*/  \1 \2 softcap=\3 dq_tensor=\4 det=\5 packed=\6/p; s/^ +([0-9]+ bytes stack frame.*)/   \1/p; s/.*(Used [0-9]+ registers).*/   \1/p" |
    paste -d' ' - - -
  grep -h "C75" "$log" || true
done
