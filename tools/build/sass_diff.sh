#!/usr/bin/env bash
# Is a CUDA change behaviour-neutral? Compiles one translation unit in two
# source trees with the flags of cuda/CMakeLists.txt and compares the machine
# code (SASS) of every kernel, addresses and line info stripped.
#
#   tools/build/sass_diff.sh BASE_TREE NEW_TREE TU [sm90|sm80]
#
# TU is relative to the tree root (e.g. cuda/instantiations/fwd_bf16_hdim128_sm90.cu;
# a TU that exists only in NEW_TREE can be compared against another name in
# BASE_TREE with BASE_TU=...). The family defaults from the file name: sm90
# TUs build for sm_90a; everything else for sm_90 (the sm80 family's code as
# it runs on the H200). Prints one line per kernel: "same", "DIFF n lines" or
# "only in base/new", then the totals; exit 1 if any kernel differs.
# SASS_KEEP=dir keeps the dumps there.
set -euo pipefail
BASE=$(cd "${1:?usage: sass_diff.sh BASE_TREE NEW_TREE TU [sm90|sm80]}" && pwd)
NEW=$(cd "${2:?}" && pwd)
TU=${3:?}
BASE_TU=${BASE_TU:-$TU}
FAMILY=${4:-}
if [[ -z $FAMILY ]]; then
  [[ $TU == *sm90* || $TU == cuda/sm90/* || $TU == cuda/fp8/* ]] && FAMILY=sm90 || FAMILY=sm80
fi
if [[ $FAMILY == sm90 ]]; then ARCH=(-gencode=arch=compute_90a,code=sm_90a)
else ARCH=(-gencode=arch=compute_90,code=sm_90); fi
WORK=${SASS_KEEP:-$(mktemp -d)}
mkdir -p "$WORK"

dump() {  # tree tu out
  local tree=$1 tu=$2 out=$3
  nvcc "${ARCH[@]}" -O3 --expt-relaxed-constexpr --use_fast_math -std=c++17 \
    -I"$tree/cuda/include" -I"$tree/cuda" -cubin -o "$out.cubin" "$tree/$tu"
  # One file per function; strip the /*addr*/ prefixes and the encoding words.
  # Names past 200 characters (file-name limit 255) become a prefix and a
  # checksum of the whole name. The address pattern avoids {n,} (mawk lacks it).
  cuobjdump -sass "$out.cubin" | awk -v dir="$out.d" '
    BEGIN { system("mkdir -p " dir); for (i = 32; i < 127; i++) ord[sprintf("%c", i)] = i }
    /Function :/ { f = $3; gsub(/_GLOBAL__N__[0-9a-f]+_/, "_GLOBAL__N__", f)
                   if (length(f) > 200) {
                     h = 0
                     for (i = 1; i <= length(f); i++) h = (h * 31 + ord[substr(f, i, 1)]) % 1000000007
                     f = substr(f, 1, 180) "~" h
                   }
                   file = dir "/" f; next }
    file != "" {
      line = $0
      gsub(/\/\*[0-9a-f][0-9a-f][0-9a-f][0-9a-f]+\*\//, "", line)
      gsub(/\/\* 0x[0-9a-f]+ \*\//, "", line)
      gsub(/_GLOBAL__N__[0-9a-f]+_/, "_GLOBAL__N__", line)  # path-dependent hash
      sub(/[ \t]+$/, "", line)
      if (line != "") print line > file
    }'
}

dump "$BASE" "$BASE_TU" "$WORK/base" &
dump "$NEW" "$TU" "$WORK/new" &
wait
same=0; differ=0
for f in $(ls "$WORK/base.d" "$WORK/new.d" 2>/dev/null | grep -v ':$' | sort -u); do
  a=$WORK/base.d/$f; b=$WORK/new.d/$f
  if [[ ! -e $a ]]; then echo "only in new   $f"; differ=$((differ + 1)); continue; fi
  if [[ ! -e $b ]]; then echo "only in base  $f"; differ=$((differ + 1)); continue; fi
  if cmp -s "$a" "$b"; then echo "same          $f"; same=$((same + 1))
  else
    n=$(diff "$a" "$b" | grep -c '^[<>]' || true)
    echo "DIFF $n lines ($(wc -l <"$a") -> $(wc -l <"$b") instructions)  $f"
    differ=$((differ + 1))
  fi
done
echo "$TU: $same kernels identical, $differ differ"
[[ -z ${SASS_KEEP:-} ]] && rm -rf "$WORK"
[[ $differ == 0 && $same -gt 0 ]]  # no kernel compared is a failure too
