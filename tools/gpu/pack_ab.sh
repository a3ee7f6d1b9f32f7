#!/usr/bin/env bash
# Fills .ab/A (the reference) and .ab/B (the candidate) for tools/gpu/ab_check.sh
# from two builds of the extension, each a wheel or a _jax_flash_cuda*.so:
#   tools/gpu/pack_ab.sh A_WHEEL_OR_SO B_WHEEL_OR_SO
# Each folder gets the extension xz-compressed (_jax_flash_cuda*.so.xz) and the
# build record _build.json (from the wheel, or the file next to the .so when
# there is one). .ab/ is git-ignored. Environment: XZ_OPT (default -6 -T1).
# Build both against the XLA FFI headers of the jax that the GPU machine runs
# (`jax.ffi.include_dir()` of that version, e.g. a build virtualenv holding
# jax and jaxlib of that version): the FFI API version is compiled into the
# handlers, and a mismatch fails every registration ("the handler's API
# version (0.5) is incompatible with the framework's API version (0.4)").
set -euo pipefail
if (( $# != 2 )); then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
for f in "$1" "$2"; do [[ -f $f ]] || { echo "pack_ab: $f: no such file" >&2; exit 1; }; done
A=$(realpath "$1") B=$(realpath "$2")
cd "$(dirname "$0")/../.."
export XZ_OPT=${XZ_OPT:--6 -T1}

# pack SRC DIR: the extension of SRC (wheel or .so) into DIR.
pack() {
  local src=$1 dir=$2 so
  rm -rf "$dir" && mkdir -p "$dir"
  case $src in
    *.whl)
      python3 - "$src" "$dir" <<'PY'
import pathlib, sys, zipfile
whl, out = sys.argv[1], pathlib.Path(sys.argv[2])
with zipfile.ZipFile(whl) as z:
  names = [n for n in z.namelist()
           if n.startswith("jax_flash/_jax_flash_cuda") and n.endswith(".so")]
  if len(names) != 1:
    sys.exit(f"pack_ab: {whl} holds {len(names)} jax_flash/_jax_flash_cuda*.so "
             "(a wheel built without nvcc has none)")
  (out / pathlib.PurePath(names[0]).name).write_bytes(z.read(names[0]))
  if "jax_flash/_build.json" in z.namelist():
    (out / "_build.json").write_bytes(z.read("jax_flash/_build.json"))
PY
      ;;
    *.so)  # any name: installed as the module's own
      so=$(basename "$src")
      [[ $so == _jax_flash_cuda*.so ]] ||
        so=_jax_flash_cuda$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
      cp "$src" "$dir/$so"
      if [[ -f $(dirname "$src")/_build.json ]]; then cp "$(dirname "$src")/_build.json" "$dir/"; fi
      ;;
    *) echo "pack_ab: $src is neither a .whl nor a .so" >&2; return 1 ;;
  esac
  for so in "$dir"/_jax_flash_cuda*.so; do xz -f "$so"; done
  [[ -f $dir/_build.json ]] || echo "pack_ab: note: no _build.json for $src" >&2
}

pack "$A" .ab/A
pack "$B" .ab/B
if cmp -s <(xz -dc .ab/A/_jax_flash_cuda*.so.xz) <(xz -dc .ab/B/_jax_flash_cuda*.so.xz); then
  echo "pack_ab: note: A and B are the same binary" >&2
fi
ls -l .ab/A .ab/B
du -sh .ab | sed 's/^/total: /'
