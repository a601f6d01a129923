#!/usr/bin/env bash
# Compile-check every GPU source of csrc/sources.cmake (object files only) for the
# requested architectures its table entry allows, against the headers of the installed
# torch; works with the CPU torch wheel (plus the one generated c10/cuda header it
# lacks, from .ci/cuda_shim). A failure fails CI.
#   scripts/check_cuda_compile.sh [ARCH ...]     default: 90a 100a
# Entries marked `cutlass` get the CUTLASS headers: $MOE_FP8_CUTLASS_INCLUDE, else the
# pip package nvidia-cutlass (cutlass_library/source/include) if it is installed.
# For sm_90a (the tuned target) it also sums ptxas's spill stores over each file's
# kernels and fails where the sum exceeds the file's budget in scripts/spill_budget.txt
# (0 for a file not listed): a change that makes a kernel spill fails here, without a
# GPU (f00078d's did, and the blocked MXFP8 rows it touched then timed 3-6% slower
# on an H100).
set -euo pipefail
cd "$(dirname "$0")/.."
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(90a 100a)
torch_inc=$(python3 -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
abi=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
cutlass_inc=${MOE_FP8_CUTLASS_INCLUDE:-$(python3 -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(os.path.dirname(s.origin), 'source', 'include') if s else '')")}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
# Compiles run $CHECK_JOBS at a time (default: every core; nvcc is one process a
# compile). Each writes its log and verdict under $out; the verdicts print in table
# order once all have finished.
jobs_max=${CHECK_JOBS:-$(nproc)}

# compile_one <path> <arch> <extra nvcc flags...>: writes $out/<name>.<arch>.verdict
# ("ok ..." or "FAIL ...", then the lines to show).
compile_one() {
  local path=$1 arch=$2
  shift 2
  local name verbose=() log verdict spilled budget start=$SECONDS
  name="$out/$(basename "$path").$arch"
  log="$name.log"
  verdict="$name.verdict"
  [ "$arch" = 90a ] && verbose=(-Xptxas -v)
  if nvcc -std=c++20 -O3 --expt-relaxed-constexpr -Werror all-warnings "${verbose[@]}" \
      "-gencode=arch=compute_${arch},code=sm_${arch}" \
      -DMOE_FP8_WITH_CUDA -D_GLIBCXX_USE_CXX11_ABI="$abi" \
      -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
      -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
      -I"$torch_inc" -I"$torch_inc/torch/csrc/api/include" -I.ci/cuda_shim -Icsrc "$@" \
      -c "csrc/$path" -o "$name.o" </dev/null >"$log" 2>&1; then
    rm -f "$name.o"
    if [ "$arch" = 90a ]; then
      spilled=$(sed -n 's/.* \([0-9]*\) bytes spill stores.*/\1/p' "$log" | awk '{s += $1} END {print s + 0}')
      budget=$(awk -v f="csrc/$path" '$1 == f {print $2}' scripts/spill_budget.txt)
      budget=${budget:-0}
      if [ "$spilled" -gt "$budget" ]; then
        { echo "FAIL sm_$arch csrc/$path: ptxas spill stores $spilled bytes, budget $budget (scripts/spill_budget.txt); the kernels that spill:"
          awk '/Compiling entry function/ {f = $7} /bytes spill stores/ && $5 != "0" {print "     " f ": " $0}' "$log"; } >"$verdict"
      elif [ "$spilled" -lt "$budget" ]; then
        echo "ok   sm_$arch csrc/$path (spill stores $spilled bytes, under its budget $budget: lower it)" >"$verdict"
      else
        echo "ok   sm_$arch csrc/$path (spill stores $spilled bytes, its budget)" >"$verdict"
      fi
    else
      { echo "ok   sm_$arch csrc/$path"; cat "$log"; } >"$verdict"
    fi
  else
    { echo "FAIL sm_$arch csrc/$path"; cat "$log"; } >"$verdict"
  fi
  sed -i "1s|csrc/$path|csrc/$path [$((SECONDS - start)) s]|" "$verdict"
}

# The jobs, one per (file, arch): "<path> <arch> <cutlass: 0/1>". CUTLASS files go
# first: they take the longest, so the slots fill evenly.
jobs_list=()
# One quoted entry per line: "<path> <kind> [<archs>] [<needs>]" (see csrc/sources.cmake).
while read -r path kind file_archs needs; do
  [ "$kind" = GPU ] || continue
  file_archs=${file_archs:-cuda,hip}
  todo=()
  for arch in "${archs[@]}"; do
    case ",$file_archs," in *,cuda,*|*,"$arch",*) todo+=("$arch") ;; esac
  done
  if [ ${#todo[@]} -eq 0 ]; then
    echo "skip csrc/$path (archs $file_archs)"
    continue
  fi
  cutlass=0
  if [[ " $needs " == *" cutlass "* ]]; then
    if [ -z "$cutlass_inc" ] || [ ! -e "$cutlass_inc/cutlass/cutlass.h" ]; then
      echo "FAIL csrc/$path needs the CUTLASS headers: pip install nvidia-cutlass, or set MOE_FP8_CUTLASS_INCLUDE"
      status=1
      continue
    fi
    cutlass=1
  fi
  for arch in "${todo[@]}"; do jobs_list+=("$path $arch $cutlass"); done
done < <(sed -n 's/^[[:space:]]*"\([^"]*\)".*/\1/p' csrc/sources.cmake)
ordered=()
for c in 1 0; do
  for j in "${jobs_list[@]}"; do [ "${j##* }" = "$c" ] && ordered+=("$j"); done
done
echo "compiling ${#ordered[@]} (file, arch) pairs, $jobs_max at a time"
for j in "${ordered[@]}"; do
  read -r path arch cutlass <<<"$j"
  extra=()
  [ "$cutlass" = 1 ] && extra+=(-I"$cutlass_inc")
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  compile_one "$path" "$arch" "${extra[@]}" &
done
wait
checked=0
for j in "${jobs_list[@]}"; do
  read -r path arch _ <<<"$j"
  verdict="$out/$(basename "$path").$arch.verdict"
  if [ ! -s "$verdict" ]; then
    echo "FAIL sm_$arch csrc/$path: no verdict (the compile job died)"
    status=1
  else
    cat "$verdict"
    head -c 4 "$verdict" | grep -q '^ok' || status=1
  fi
  checked=$((checked + 1))
done
# Every .cu must be in the table (a file left out would silently never compile).
for f in $(cd csrc && find . -name '*.cu' | sed 's|^\./||' | sort); do
  grep -qE "^[[:space:]]*\"$f[[:space:]]" csrc/sources.cmake || { echo "FAIL csrc/$f is not in csrc/sources.cmake"; status=1; }
done
[ $checked -gt 0 ] || { echo "FAIL no GPU source checked"; status=1; }
exit $status
