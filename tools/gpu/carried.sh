# Sourced by the GPU scripts (packing_check.sh, decode_check.sh, bwd_check.sh,
# ring_scaling.sh), from the repo root on the device machine, after they set
# DEFAULT_STAGES and pass their arguments: the stages to run (`has STAGE`),
# $OUT (default ./gpu_out), the extension built on the CPU machine and
# carried xz-compressed in .ab/ unpacked into jax_flash/, the wheels carried
# in .whl/ (the peers, e.g. flash-attn3-jax) installed into /tmp/site, and
# PYTHONPATH pointing at both; prints the GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
STAGES=${*:-$DEFAULT_STAGES}
has() { [[ " $STAGES " == *" $1 "* ]]; }
for f in .ab/jax_flash/*.xz; do xz -dc "$f" > "jax_flash/$(basename "${f%.xz}")"; done
cp .ab/jax_flash/_build.json jax_flash/ 2>/dev/null
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
