#!/usr/bin/env bash
# Build the CUDA module on this machine, which needs no GPU, for a GPU machine with the
# same torch release, and put it in .prebuilt/ (ignored by git) with its stamp
# (scripts/prebuilt.py). Carry .prebuilt/ to the GPU machine (the device tool: name it
# in `carry`, about 28 MB): scripts/gpu_ci.sh uses the module instead of building when
# it matches the tree there (same build inputs, same torch, the GPU's arch) and loads
# as a CUDA build, and builds as before otherwise. The module is `_C.abi3.so` (CPython's
# stable ABI), so this Python need not be that machine's: only the torch release must
# be the same (its wheel from PyPI, for any Python).
#
#   PYTHON=/path/to/venv/bin/python scripts/prebuild.sh [ARCHS]    ARCHS default 90a
#
# The venv needs that torch, ninja, cmake and the pinned nvidia-cutlass; nvcc on PATH
# must have torch's CUDA major version. E.g. for the device tool's H100s (torch
# 2.11.0+cu130 under Python 3.12; nvcc 13.0 here):
#   python3 -m venv /work/venv211 && /work/venv211/bin/pip install torch==2.11.0 ninja cmake wheel nvidia-cutlass==4.2.0.0
#   PYTHON=/work/venv211/bin/python scripts/prebuild.sh     (sm_90a: 5-6 minutes on 2 cores, then incremental)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(command -v "${PYTHON:-python3}")
archs=${1:-90a}
# That environment's cmake and ninja first (pip's cmake knows nvcc's C++20; Debian 12's does not).
PATH=$(dirname "$PY"):$PATH
$PY - <<'PYEOF'
import importlib.metadata, re, shutil, subprocess, sys
import torch
if not torch.version.cuda:
    sys.exit("prebuild.sh: this Python's torch is not a CUDA build")
nvcc = shutil.which("nvcc")
out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout if nvcc else ""
m = re.search(r"release (\d+)\.(\d+)", out)
if not m or m.group(1) != torch.version.cuda.split(".")[0]:
    sys.exit(f"prebuild.sh: nvcc {m.group(0) if m else 'not found'}, torch {torch.__version__} has CUDA {torch.version.cuda}")
pin = re.search(r'"nvidia-cutlass==([^"]+)"', open("pyproject.toml").read()).group(1)
have = importlib.metadata.version("nvidia-cutlass")
if have != pin:
    sys.exit(f"prebuild.sh: nvidia-cutlass {have} installed, pyproject.toml pins {pin}")
PYEOF
# Objects whose header dependencies ninja holds no record of would not rebuild when only a
# header changes (2026-11-27: CUDA objects of an earlier build read "#deps 0", and a
# header edit left them stale in the module): their sources are touched so they rebuild.
if [ -f build/cmake-cuda/.ninja_deps ] && command -v ninja >/dev/null; then
  ninja -C build/cmake-cuda -t deps 2>/dev/null | sed -n 's|^CMakeFiles/_C\.dir/\(csrc/.*\)\.o: #deps 0,.*|\1|p' |
    while read -r src; do [ -f "$src" ] && touch "$src"; done || true
fi
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
mkdir "$tmp/pkg"
(cd "$tmp/pkg" && $PY -m zipfile -e "$tmp"/moe_fp8_ext-*.whl .)
rm -rf .prebuilt
$PY scripts/prebuilt.py save .prebuilt "$tmp/pkg" "$before" "$archs"
echo "prebuild.sh: built in $(( $(date +%s) - start )) s, $(du -h .prebuilt/_C.abi3.so | cut -f1)"
