# Common set-up of the GPU scripts (packing_check.sh, decode_check.sh,
# bwd_check.sh, ring_scaling.sh, ab_check.sh), sourced from the repo root
# after the script sets DEFAULT_STAGES, with the script's arguments:
# - the stages to run ($STAGES, tested with `has STAGE`), default DEFAULT_STAGES;
# - $OUT (default ./gpu_out) for logs and results;
# - a prebuilt extension in .ab/jax_flash/ (`_jax_flash_cuda*.so.xz`,
#   xz-compressed, and `_build.json`) is unpacked into jax_flash/
#   (`install_build DIR [DEST]` does the same for another directory);
# - wheels in .whl/ (the peers of the benchmarks, e.g. flash-attn3-jax) are
#   installed to /tmp/site;
# - PYTHONPATH holds the repo root and /tmp/site; the GPU is printed.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
STAGES=${*:-$DEFAULT_STAGES}
has() { [[ " $STAGES " == *" $1 "* ]]; }
# install_build DIR [DEST]: DIR's extension (*.so.xz or *.so) and _build.json
# into DEST (default jax_flash/).
install_build() {
  local f dest=${2:-jax_flash}
  for f in "$1"/_jax_flash_cuda*.so.xz; do
    [[ -e $f ]] && xz -dc "$f" > "$dest/$(basename "${f%.xz}")"
  done
  for f in "$1"/_jax_flash_cuda*.so; do
    [[ -e $f ]] && cp "$f" "$dest/"
  done
  [[ -e $1/_build.json ]] && cp "$1/_build.json" "$dest/"
  return 0
}
[[ -d .ab/jax_flash ]] && install_build .ab/jax_flash
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
