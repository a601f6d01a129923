#!/usr/bin/env bash
# Compile-check every CUDA source for each architecture (object files only), against
# the headers of the installed torch; works with the CPU torch wheel (plus the one
# generated c10/cuda header it lacks, from .ci/cuda_shim). A failure fails CI.
#   scripts/check_cuda_compile.sh [ARCH ...]     default: 90a 100a
set -euo pipefail
cd "$(dirname "$0")/.."
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(90a 100a)
torch_inc=$(python3 -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
abi=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
for src in $(find csrc -name '*.cu' | sort); do
  for arch in "${archs[@]}"; do
    if nvcc -std=c++20 -O3 --expt-relaxed-constexpr -Werror all-warnings \
        "-gencode=arch=compute_${arch},code=sm_${arch}" \
        -DMOE_FP8_WITH_CUDA -D_GLIBCXX_USE_CXX11_ABI="$abi" \
        -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
        -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
        -I"$torch_inc" -I"$torch_inc/torch/csrc/api/include" -I.ci/cuda_shim -Icsrc \
        -c "$src" -o "$out/$(basename "$src").$arch.o"; then
      echo "ok   sm_$arch $src"
    else
      echo "FAIL sm_$arch $src"
      status=1
    fi
  done
done
exit $status
