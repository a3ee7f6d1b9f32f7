#!/usr/bin/env bash
# Builds the self-tests against the host emulator (no GPU needed):
#   cuda/tests/emu/build_emu.sh [OUT_DIR] [all|sm80|decode|packing]
#     ->   OUT_DIR/selftest_emu          (sm80: the forward and backward)
#          OUT_DIR/selftest_decode_emu   (decode: the decoding kernels, cuda/decode)
#          OUT_DIR/tile_spans_check_emu  (packing: the tile-span pre-pass)
# Then: OUT_DIR/selftest_emu [--quick] [filter]; stress variants:
#   JF_EMU_CPASYNC=eager JF_EMU_SHUFFLE=1 OUT_DIR/selftest_emu --quick
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=${1:-$ROOT/build/emu}
WHAT=${2:-all}
CUDA_INC=${CUDA_INC:-$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")/../include}
mkdir -p "$OUT"
# The emulator's device replacements come first in every kernel source
# (-include): the kernel headers skip their PTX wrappers under
# JAX_FLASH_HOST_EMULATION and never include test code themselves.
FLAGS=(-std=c++17 -O2 -g -DJAX_FLASH_HOST_EMULATION -I"$ROOT/cuda/include" -I"$ROOT/cuda"
       -I"$ROOT/cuda/tests/emu" -I"$CUDA_INC" -I/usr/local/cuda/include)
KFLAGS=("${FLAGS[@]}" -include emu_device.h)
SRCS=("$ROOT"/cuda/instantiations/*_sm80.cu "$ROOT/cuda/sm80/dispatch.cu" "$ROOT/cuda/tests/selftest.cu")
DECODE_SRCS=("$ROOT"/cuda/decode/*.cu "$ROOT/cuda/tests/selftest_decode.cu")
mkdir -p "$OUT/sm80" "$OUT/decode" "$OUT/packing"
want() { [[ $WHAT == all || $WHAT == "$1" ]]; }
pids=()
compile() {  # source, object
  g++ "${KFLAGS[@]}" -x c++ -c "$1" -o "$2" &
  pids+=($!)
  if (( ${#pids[@]} >= $(nproc) )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
}
if want sm80; then
  for f in "${SRCS[@]}"; do compile "$f" "$OUT/sm80/$(basename "$f" .cu).o"; done
fi
if want decode; then
  for f in "${DECODE_SRCS[@]}"; do compile "$f" "$OUT/decode/$(basename "$f" .cu).o"; done
fi
if want packing; then
  compile "$ROOT/cuda/packing/tile_spans.cu" "$OUT/packing/tile_spans.o"
  compile "$ROOT/cuda/tests/tile_spans_check.cpp" "$OUT/packing/tile_spans_check.o"
fi
for p in "${pids[@]}"; do wait "$p"; done
g++ "${FLAGS[@]}" -c "$ROOT/cuda/tests/emu/emu.cpp" -o "$OUT/emu.o"
if want sm80; then
  g++ "$OUT"/sm80/*.o "$OUT/emu.o" -o "$OUT/selftest_emu"
  echo "built $OUT/selftest_emu"
fi
if want decode; then
  g++ "$OUT"/decode/*.o "$OUT/emu.o" -o "$OUT/selftest_decode_emu"
  echo "built $OUT/selftest_decode_emu"
fi
if want packing; then
  g++ "$OUT"/packing/*.o "$OUT/emu.o" -o "$OUT/tile_spans_check_emu"
  echo "built $OUT/tile_spans_check_emu"
fi
