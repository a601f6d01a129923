#!/usr/bin/env bash
# A/B of the rowwise quantization kernels on a GPU: this tree against an older commit,
# built side by side, timed alternately in one run (bench/ab_rowwise.py), median table.
#   scripts/ab_rowwise.sh OLD_REV [ROUNDS]     (needs git here; run on the GPU machine
#   with a tarball instead: OLD_TARBALL=path/to/old.tar.gz scripts/ab_rowwise.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${2:-2}
old=/tmp/moe_fp8_ab_old
rm -rf "$old" && mkdir -p "$old"
if [ -n "${OLD_TARBALL:-}" ]; then tar -xzf "$OLD_TARBALL" -C "$old"; else git archive "$1" | tar -x -C "$old"; fi
export MOE_FP8_CUDA_ARCHS=${MOE_FP8_CUDA_ARCHS:-90a}
( cd "$old" && MAX_JOBS=6 python3 setup.py build_ext --inplace >/tmp/moe_fp8_ab_old.log 2>&1 ) &
MAX_JOBS=10 python3 -m pip install --no-build-isolation --no-deps -e . >/tmp/moe_fp8_ab_new.log 2>&1
wait
log=${OUT:-/tmp}/ab.log
: >"$log"
here=$PWD
for _ in $(seq "$rounds"); do
  python3 bench/ab_rowwise.py new | grep "^AB" >>"$log"
  ( cd "$old" && PYTHONPATH="$old${PYTHONPATH:+:$PYTHONPATH}" python3 "$here/bench/ab_rowwise.py" old | grep "^AB" >>"$log" )
done
python3 bench/ab_rowwise.py --table "$log"
