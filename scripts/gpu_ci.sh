#!/usr/bin/env bash
# The GPU half of CI, for any machine with a CUDA GPU (the device tool here, or a
# self-hosted runner): build for the local GPU, run the whole test suite, run the
# sanitizer pass over garbage offs, run the benchmarks. Non-zero exit on any failure.
#
#   scripts/gpu_ci.sh [--no-bench] [--quick-bench] [--bench-only] [--sanitize-only] [--no-sanitize] [--ep] [--gpu-cases]
# --bench-only: build (a no-op when built), then only the benchmarks; $BENCHES picks
# them (default: all), e.g. BENCHES="bench_token_groups bench_grouped_mm".
# --sanitize-only: build, then only the compute-sanitizer passes; --no-sanitize: without them
# (the tests and the sanitizer passes together run past one 10-minute device call).
# --ep (a machine with two or more GPUs): build, then only the multi-GPU examples under
# torchrun on 2 and 4 GPUs where there are (expert parallelism, FSDP2 over the experts
# layer) and their tests.
# TEST_WORKERS=N runs the tests in N processes where pytest-xdist is installed; TESTS="..."
# gives pytest its files and options instead of the whole suite (one GPU).
# --gpu-cases: the test cases whose `device` parameter is "cpu" are left to CI, which
# runs them on every commit (MOE_FP8_SKIP_CPU_CASES=1, tests/conftest.py): for a GPU
# machine on a time budget. On an H100 (2026-11-25) the build took 247 s and the whole
# suite 385 s with 8 workers, together past a 10-minute call.
# A module built on a machine without a GPU (scripts/prebuild.sh into .prebuilt/, carried
# along) is used instead of the build when it matches this tree and this machine's torch.
# Tables and logs go to $OUT (default ./.out). Wheels in ./.whl (the peers torchao and
# torchtitan with its import chain, and nvidia-cutlass for the blockwise GEMM's headers
# on a machine without network) are installed into a private folder first when present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/.out}
export OUT PYTHONUNBUFFERED=1
mkdir -p "$OUT"
bench=full
ep=0
tests=1
sanitize=1
for a in "$@"; do
  case "$a" in
    --no-bench) bench=none ;;
    --quick-bench) bench=quick ;;
    --ep) ep=1 ;;
    --bench-only) tests=0; sanitize=0 ;;
    --sanitize-only) tests=0; bench=none ;;
    --no-sanitize) sanitize=0 ;;
    --gpu-cases) export MOE_FP8_SKIP_CPU_CASES=1 ;;
    *) echo "gpu_ci.sh: unknown option $a" >&2; exit 2 ;;
  esac
done

if $PY -c "import sys, torch; sys.exit(0 if torch.version.hip else 1)"; then
  # ROCm: build for the local AMD GPU (e.g. gfx942), no compute-sanitizer.
  export PYTORCH_ROCM_ARCH=${PYTORCH_ROCM_ARCH:-$($PY -c "import torch; print(torch.cuda.get_device_properties(0).gcnArchName.split(':')[0])")}
  MOE_FP8_CUDA_ARCHS=$PYTORCH_ROCM_ARCH
elif [ -z "${MOE_FP8_CUDA_ARCHS:-}" ]; then
  MOE_FP8_CUDA_ARCHS=$($PY -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}{m}' + ('a' if M >= 9 else ''))")
  export MOE_FP8_CUDA_ARCHS
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  # installed once a machine: reinstalling would give the CUTLASS headers new times,
  # and every object that includes them would rebuild
  wheels=$(cat .whl/*.whl | sha256sum)
  if [ "$(cat /tmp/moe_fp8_peers/.wheels 2>/dev/null)" != "$wheels" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/moe_fp8_peers .whl/*.whl
    echo "$wheels" >/tmp/moe_fp8_peers/.wheels
  fi
  export PYTHONPATH=/tmp/moe_fp8_peers${PYTHONPATH:+:$PYTHONPATH}
fi

echo "== build (archs $MOE_FP8_CUDA_ARCHS; CXX=${CXX:-unset}, g++ on PATH: $(command -v g++))"
start=$(date +%s)
# A machine that gets the tree anew for each command (new file times) but keeps build/
# rebuilds only the sources whose content changed (scripts/build_stamps.py). The stamps
# are removed before the build and written after it succeeds: a failed build may leave
# objects of sources whose content the next command could revert to the stamped one.
stamps=build/source_stamps.json
# A module built elsewhere for this tree (.prebuilt/, scripts/prebuild.sh) replaces the
# build when its stamp matches (same build inputs, same torch, this GPU's arch) and it
# loads; MOE_FP8_NO_PREBUILT=1 builds anyway.
prebuilt=0
if [ -d .prebuilt ] && [ "${MOE_FP8_NO_PREBUILT:-0}" != 1 ] && [ -z "${PYTORCH_ROCM_ARCH:-}" ] &&
    $PY scripts/prebuilt.py check .prebuilt "$MOE_FP8_CUDA_ARCHS"; then
  rm -f moe_fp8_ext/_C*.so
  cp .prebuilt/_C.abi3.so moe_fp8_ext/
  # The package from the source tree, as the editable install gives it (for the
  # benchmarks, examples and subprocesses, which do not start in the root).
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  if $PY scripts/prebuilt.py imports "$MOE_FP8_CUDA_ARCHS" 2>&1 | tail -5; then  # (pipefail: python's status)
    prebuilt=1
    echo "using the prebuilt module (no build)"
  else
    echo "prebuilt: the module does not load here as a CUDA build for $MOE_FP8_CUDA_ARCHS; building"
    rm -f moe_fp8_ext/_C.abi3.so
  fi
fi
if [ "$prebuilt" = 0 ]; then
  $PY scripts/build_stamps.py restore "$stamps"
  rm -f "$stamps"
  MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  $PY scripts/build_stamps.py save "$stamps"
  echo "built in $(( $(date +%s) - start )) s"
fi
$PY -c "import moe_fp8_ext, torch; print(moe_fp8_ext.build_info(), torch.cuda.get_device_name())"

bash scripts/diag_toolchain.sh
$PY scripts/check_sass.py  # a known ptxas miscompile (odd descriptor registers), before any kernel runs
if [ "$ep" = 1 ]; then
  gpus=$($PY -c 'import torch; print(torch.cuda.device_count())')
  echo "== expert parallel and FSDP2 on $gpus GPUs"
  for n in 2 4; do
    [ "$gpus" -ge "$n" ] || continue
    for ex in expert_parallel fsdp2_experts; do
      $PY -m torch.distributed.run --standalone --nproc-per-node=$n examples/$ex.py 2>&1 | tee -a "$OUT/expert_parallel.log" | grep -v "^W"
      test ${PIPESTATUS[0]} -eq 0
    done
  done
  $PY -m pytest tests/test_expert_parallel.py -q -rs 2>&1 | tee -a "$OUT/expert_parallel.log" | tail -5
  test ${PIPESTATUS[0]} -eq 0
  exit 0
fi
if [ "$tests" = 1 ]; then
  echo "== tests"
  # TEST_WORKERS=N with pytest-xdist importable: N test processes, two CPU threads each
  # (each would otherwise take a thread per core for its CPU references). On an H100
  # with 16 cores, 8 workers ran the GPU tests of test_rowwise.py in 126 s (over 300 s
  # in one process), test_blockwise.py in 58 s and test_mxfp8.py in 61 s; the other
  # files were not tried that way.
  workers=()
  if [ -n "${TEST_WORKERS:-}" ] && $PY -c "import xdist" 2>/dev/null; then
    workers=(-n "$TEST_WORKERS")
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  fi
  gpus=$($PY -c 'import torch; print(torch.cuda.device_count())')
  if [ "$gpus" -gt 1 ]; then
    # One pytest a GPU, each over its share of the test files (by size, largest first, to
    # the least loaded GPU); the multi-GPU tests run with --ep.
    mapfile -t shares < <($PY - "$gpus" <<'PYEOF'
import glob, os, sys
n = int(sys.argv[1]); load = [0] * n; parts = [[] for _ in range(n)]
files = [f for f in glob.glob("tests/test_*.py") if not f.endswith("test_expert_parallel.py")]
for f in sorted(files, key=os.path.getsize, reverse=True):
    i = load.index(min(load)); parts[i].append(f); load[i] += os.path.getsize(f)
print("\n".join(" ".join(p) for p in parts))
PYEOF
)
    pids=()
    for i in "${!shares[@]}"; do
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=$i $PY -m pytest ${shares[$i]} -q -rs --maxfail=20 ${workers[@]+"${workers[@]}"} \
        >"$OUT/tests.$i.log" 2>&1 &
      pids+=($!)
    done
    failed=0
    for i in "${!pids[@]}"; do wait "${pids[$i]}" || failed=1; echo "GPU $i: $(tail -1 "$OUT/tests.$i.log")"; done
    cat "$OUT"/tests.*.log >"$OUT/tests.log"
    test $failed -eq 0 || { grep -h -E "^(FAILED|ERROR)" "$OUT"/tests.*.log | head -40; exit 1; }
  else
    # shellcheck disable=SC2086
    $PY -m pytest ${TESTS:-tests} -q -rs --maxfail=20 ${workers[@]+"${workers[@]}"} 2>&1 | tee "$OUT/tests.log" | tail -25
    test ${PIPESTATUS[0]} -eq 0
  fi
fi
if [ "$sanitize" = 1 ]; then
  echo "== compute-sanitizer (garbage offs, odd shapes)"
  if command -v compute-sanitizer >/dev/null && [ -z "${PYTORCH_ROCM_ARCH:-}" ]; then
    compute-sanitizer --tool memcheck --error-exitcode 1 $PY scripts/sanitize_offs.py 2>&1 | tee "$OUT/sanitizer.log" | tail -5
    test ${PIPESTATUS[0]} -eq 0
    # the SwiGLU kernels take no offs: their GPU tests (vector, scalar, long rows, empty)
    compute-sanitizer --tool memcheck --error-exitcode 1 $PY -m pytest tests/test_swiglu.py -q -k cuda 2>&1 |
      tee -a "$OUT/sanitizer.log" | tail -3
    test ${PIPESTATUS[0]} -eq 0
    # the scale swizzles with random garbage offs, 3 and 5000 groups (the global-table path)
    compute-sanitizer --tool memcheck --error-exitcode 1 $PY -m pytest tests/test_mxfp8.py -q -k swizzles_bad_offs \
      2>&1 | tee -a "$OUT/sanitizer.log" | tail -3
    test ${PIPESTATUS[0]} -eq 0
    # the weights written into slices of one operand (quantize_experts_fwd_cat)
    compute-sanitizer --tool memcheck --error-exitcode 1 $PY -m pytest tests/test_rowwise.py -q -k "_cat and cuda" \
      2>&1 | tee -a "$OUT/sanitizer.log" | tail -3
    test ${PIPESTATUS[0]} -eq 0
    compute-sanitizer --tool memcheck --error-exitcode 1 $PY -m pytest tests/test_blockwise.py -q -k "weight_cat and cuda" \
      2>&1 | tee -a "$OUT/sanitizer.log" | tail -3
    test ${PIPESTATUS[0]} -eq 0
    # shared-memory hazards and barrier misuse: every such kernel family once, small odd
    # shapes. racecheck fails on errors, not on its warnings: on an H100 (2026-11-26) it
    # warned only inside CUTLASS's grouped-GEMM descriptor update (tensormap.replace by
    # one lane, __syncwarp, then the warp's tensormap.cp_fenceproxy read of the same
    # shared bytes), a cross-proxy pattern it reports as a potential hazard.
    compute-sanitizer --tool synccheck --error-exitcode 1 $PY scripts/sanitize_smem.py 2>&1 |
      tee -a "$OUT/sanitizer.log" | tail -2
    test ${PIPESTATUS[0]} -eq 0
    compute-sanitizer --tool racecheck $PY scripts/sanitize_smem.py >"$OUT/racecheck.log" 2>&1 || true
    tail -2 "$OUT/racecheck.log" | tee -a "$OUT/sanitizer.log"
    if ! grep -q "^sanitize_smem: done" "$OUT/racecheck.log" || ! grep -q "RACECHECK SUMMARY: .*(0 errors," "$OUT/racecheck.log"; then
      echo "racecheck: errors or an unfinished run ($OUT/racecheck.log)"; exit 1
    fi
  else
    echo "compute-sanitizer not found; skipped"
  fi
fi
if [ "$tests" = 1 ]; then
  echo "== main job"
  $PY -m moe_fp8_ext
  $PY -m moe_fp8_ext --check
fi

if [ -n "${BENCHES:-}" ]; then
  for b in $BENCHES; do $PY "bench/$b.py" $([ "$bench" = quick ] && echo --quick); done
  exit 0
fi
case "$bench" in
  full) $PY bench/calibrate.py && $PY bench/bench_rowwise.py && $PY bench/bench_mxfp8.py && $PY bench/bench_blockwise.py &&
        $PY bench/bench_blockwise_gemm.py && $PY bench/bench_grouped_mm.py && $PY bench/bench_grouped_mm.py --recipes &&
        $PY bench/bench_swiglu.py && $PY bench/bench_experts.py && $PY bench/bench_gemms.py && $PY bench/bench_rowwise_gemm.py && $PY bench/bench_host.py && $PY bench/bench_token_groups.py ;;
  quick) $PY bench/bench_rowwise.py --quick && $PY bench/bench_mxfp8.py --quick && $PY bench/bench_blockwise.py --quick &&
         $PY bench/bench_blockwise_gemm.py --quick && $PY bench/bench_grouped_mm.py --quick &&
         $PY bench/bench_swiglu.py && $PY bench/bench_experts.py --quick && $PY bench/bench_gemms.py --quick && $PY bench/bench_rowwise_gemm.py --quick && $PY bench/bench_token_groups.py --quick ;;
esac
