#!/usr/bin/env bash
# Build the CUDA module on this machine, which needs no GPU, for a GPU machine with the
# same torch release, and put it in .prebuilt/ (ignored by git) with its stamp
# (scripts/prebuilt.py). Carry .prebuilt/ to the GPU machine: scripts/gpu_ci.sh uses the
# module instead of building when it matches the tree there (same build inputs, same
# torch, the GPU's arch), and builds as before otherwise or when it does not load. The
# module is `_C.abi3.so` (CPython's stable ABI), so this Python need not be that
# machine's: only the torch release must be the same (its wheel from PyPI, any Python).
#
#   PYTHON=/path/to/venv/bin/python scripts/prebuild.sh [ARCHS]    ARCHS default 90a
#
# E.g. for the device tool's H100 (torch 2.11.0+cu130, Python 3.12):
#   python3 -m venv /work/venv211 && /work/venv211/bin/pip install torch==2.11.0 ninja cmake nvidia-cutlass==4.2.0.0
#   PYTHON=/work/venv211/bin/python scripts/prebuild.sh     (sm_90a: about 15 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
archs=${1:-90a}
# That environment's cmake and ninja first (pip's cmake knows nvcc's C++20; Debian 12's does not).
PATH=$(dirname "$PY"):$PATH
$PY -c "import sys, torch; sys.exit(0 if torch.version.cuda else 'prebuild.sh: the torch of $PY is not a CUDA build')"
out=.prebuilt
before=$($PY scripts/prebuilt.py digest)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
# build/cmake-cuda keeps the objects between runs: only what changed rebuilds.
if ! MOE_FP8_CUDA_ARCHS=$archs MOE_FP8_NO_SOURCE_COPY=1 $PY -m pip wheel --no-build-isolation --no-deps -w "$tmp" . \
    >"$tmp/build.log" 2>&1; then
  tail -50 "$tmp/build.log"
  exit 1
fi
[ "$($PY scripts/prebuilt.py digest)" = "$before" ] || { echo "prebuild.sh: the sources changed during the build; run it again" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out"
unzip -q -j -o "$tmp"/moe_fp8_ext-*.whl "moe_fp8_ext/_C.abi3.so" -d "$out"
$PY scripts/prebuilt.py save "$out" "$before" "$archs"
echo "prebuild.sh: built in $(( $(date +%s) - start )) s, $(du -h "$out/_C.abi3.so" | cut -f1)"
