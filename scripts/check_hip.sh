#!/usr/bin/env bash
# ROCm checks that need no AMD GPU (run by .ci/run); each one runs, any failure fails:
#  1. no CUDA/HIP platform test (USE_ROCM, __HIP*__, __gfx*__) in csrc/ outside
#     core/portability.h (device shims) and core/device_runtime.h (host runtime)
#     (STYLE 7), checked on the original sources;
#  2. hipify csrc/ into a scratch folder with PyTorch's hipify, and fail if anything
#     CUDA-only survives in the hipified sources outside those two (which keep their
#     CUDA branches behind !USE_ROCM);
#  3. compile the torch-free launchers of every kernel family, hipified, -Werror:
#       gfx940, gfx90a  Debian's hipcc 5.2 (clang 15)
#       gfx942          Debian's clang-19 with the same ROCm 5.2 headers and device
#                       libraries (hipcc 5.2 does not know gfx942)
#     gfx940/gfx942 (MI300) must use the hardware fnuz conversion, gfx90a (MI200) the
#     software encoder. gfx950 (MI350) needs LLVM 20, which Debian 12 does not have.
#
# Each family contributes its launchers through csrc/<family>/<family>_instantiate.cuh:
# torch-free, non-inline functions in namespace moe_fp8::instantiate that call every
# launcher of the family for every input dtype and fp8 format. This script compiles
# every csrc/*/*_instantiate.cuh it finds, each as its own translation unit, for each
# target, $CHECK_JOBS compiles at a time (default: every core); a family with a
# HIP-built GPU file in csrc/sources.cmake must have one.
#
# Needs (Debian 12): apt-get install -y --no-install-recommends hipcc clang-19 lld-19
set -euo pipefail
cd "$(dirname "$0")/.."
export HIP_PLATFORM=amd  # the CUDA toolkit on the machine would otherwise take over hipcc
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# hipcc's scratch folders (it leaves some behind) go with ours.
mkdir "$work/tmp"
export TMPDIR=$work/tmp
status=0
fail() { echo "FAIL $*" >&2; status=1; }

# 1. Platform tests only in core/portability.h and core/device_runtime.h.
if found=$(grep -rnE '\bUSE_ROCM\b|__HIP[A-Z_]*__|__gfx[0-9a-z]+__' csrc | grep -vE '^csrc/core/(portability|device_runtime)\.h:'); then
  fail "CUDA/HIP platform tests outside csrc/core/portability.h and device_runtime.h (move them there, STYLE 7):"
  echo "$found" >&2
else
  echo "ok   no USE_ROCM / __HIP*__ / __gfx*__ outside core/portability.h, core/device_runtime.h"
fi

# 2. Hipify; nothing CUDA-only may survive.
python3 scripts/hipify_tree.py csrc "$work" >/dev/null
src="$work/csrc"
echo "hipified: $(cd "$src" && find . -name '*_hip.*' -o -name '*.hip' | sort | tr '\n' ' ')"

# Only the files a ROCm build compiles or includes: the hipified ones, and the
# originals hipify had no reason to change.
files=$(cd "$src" && for f in $(find . -type f ! -name '*.cmake' | sort); do
  case "$f" in *_hip.*|*.hip) echo "$f" ;; *)
    base="${f%.*}"; ext="${f##*.}"
    [ -e "${base}_hip.${ext}" ] || [ "$ext" = cu ] || echo "$f" ;;
  esac
done | grep -vE 'core/(portability|device_runtime)')
pattern='__shfl(_[a-z]+)?_sync|cuda_fp8\.h|\b__nv_[a-z0-9_]+|\bcuda[A-Z][A-Za-z]*|cooperative_groups|cp\.async|<<<'
if leaks=$(cd "$src" && grep -nE "$pattern" $files); then
  fail "CUDA-only code survives hipify outside core/portability.h, core/device_runtime.h:"
  echo "$leaks" >&2
else
  echo "ok   no CUDA-only code outside core/portability.h, core/device_runtime.h"
fi

# 3. The families' instantiation snippets, hipified (hipify renames a header only
# when it changed something in it), one translation unit each.
snippets=()
for f in $(cd csrc && ls */*_instantiate.cuh 2>/dev/null | sort); do
  h="${f%.cuh}_hip.cuh"
  [ -e "$src/$h" ] || h="$f"
  snippets+=("$h")
done
# Every family that builds a GPU file for ROCm brings its snippet.
while read -r path kind archs _; do
  [ "$kind" = GPU ] || continue
  case ",${archs:-cuda,hip}," in *,hip,*|*,gfx*) ;; *) continue ;; esac
  family="${path%%/*}"
  [ -e "csrc/$family/${family}_instantiate.cuh" ] ||
    fail "csrc/$path is built for ROCm but csrc/$family/${family}_instantiate.cuh is missing"
done < <(sed -n 's/^[[:space:]]*"\([^"]*\)".*/\1/p' csrc/sources.cmake)
[ ${#snippets[@]} -gt 0 ] || fail "no csrc/*/*_instantiate.cuh found"
echo "instantiating: ${snippets[*]}"

units=()
for h in "${snippets[@]}"; do
  unit="$work/$(basename "${h%.cuh}").hip"
  cat >"$unit" <<CPP
// Every launcher of one kernel family, for every input dtype and fp8 format.
#include "$h"
#if defined(__HIP_DEVICE_COMPILE__) && (defined(__gfx940__) || defined(__gfx942__)) && !MOE_FP8_HW_E4M3FNUZ
#error "gfx940/gfx942 must encode fnuz with the hardware conversion"
#endif
#if defined(__HIP_DEVICE_COMPILE__) && defined(__gfx950__) && !MOE_FP8_HW_E4M3FN
#error "gfx950 must encode OCP e4m3fn with the hardware conversion"
#endif
#if defined(__HIP_DEVICE_COMPILE__) && defined(__gfx90a__) && (MOE_FP8_HW_E4M3FNUZ || MOE_FP8_HW_E4M3FN)
#error "gfx90a has no fp8 conversion instructions: the software encoder must be used"
#endif
CPP
  units+=("$unit")
done
flags=(-std=c++17 -O2 -Werror -DUSE_ROCM -I"$src")

# The compiles, $CHECK_JOBS at a time (default: every core). Each job is
# "<target> <unit>" and leaves <unit>.<target>.log and, on success, <unit>.<target>.ok.
jobs_max=${CHECK_JOBS:-$(nproc)}
targets=()
if command -v hipcc >/dev/null; then
  targets+=(gfx940 gfx90a)
else
  fail "hipcc gfx940, gfx90a: hipcc not found (apt-get install -y --no-install-recommends hipcc)"
fi

# gfx942 with clang-19 against the ROCm 5.2 headers (/usr/include/hip) and device
# libraries. Those libraries predate gfx942: they lack its oclc_isa_version_942.bc
# (one constant, the ISA version, read by ockl), so we build that file and point
# clang at a copy of the library folder holding it. Device and host sides are
# compiled separately: bundling them into one object needs clang-offload-bundler,
# which is in the larger clang-tools-19 package.
devlibs=/usr/lib/x86_64-linux-gnu/amdgcn/bitcode
clang942=(clang++-19 -x hip --offload-arch=gfx942 --rocm-path=/usr --rocm-device-lib-path="$work/devlibs"
          "${flags[@]}")
if ! command -v clang++-19 >/dev/null || ! command -v ld.lld-19 >/dev/null; then
  fail "clang-19 gfx942: clang++-19 or ld.lld-19 not found (apt-get install -y --no-install-recommends clang-19 lld-19)"
elif [ ! -e "$devlibs/ocml.bc" ] || [ ! -e /usr/include/hip/hip_runtime.h ]; then
  fail "clang-19 gfx942: ROCm headers or device libraries missing (apt-get install -y --no-install-recommends hipcc)"
else
  mkdir "$work/devlibs"
  ln -s "$devlibs"/*.bc "$work/devlibs/"
  echo '__attribute__((visibility("protected"))) __constant int __oclc_ISA_version = 9402;' >"$work/isa942.cl"
  if clang-19 -x cl -cl-std=CL2.0 --target=amdgcn-amd-amdhsa -mcpu=gfx942 -nogpulib -emit-llvm \
       -c "$work/isa942.cl" -o "$work/devlibs/oclc_isa_version_942.bc"; then
    targets+=(gfx942.dev gfx942.host)
  else
    fail "clang-19 gfx942: building oclc_isa_version_942.bc"
  fi
fi

compile_one() {
  local target=$1 unit=$2 cmd
  case "$target" in
    gfx942.dev)  cmd=("${clang942[@]}" --offload-device-only --no-gpu-bundle-output) ;;
    gfx942.host) cmd=("${clang942[@]}" --offload-host-only) ;;
    *)           cmd=(hipcc --offload-arch="$target" "${flags[@]}") ;;
  esac
  if "${cmd[@]}" -c "$unit" -o "$unit.$target.o" >"$unit.$target.log" 2>&1; then
    touch "$unit.$target.ok"
  fi
  rm -f "$unit.$target.o"
}
for target in "${targets[@]}"; do
  for unit in "${units[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
    compile_one "$target" "$unit" &
  done
done
wait

for target in "${targets[@]}"; do
  case "$target" in
    gfx942.dev)  what="clang-19 gfx942 device side (linked against the device libraries)" ;;
    gfx942.host) what="clang-19 gfx942 host side" ;;
    *)           what="hipcc $target" ;;
  esac
  failed=()
  for unit in "${units[@]}"; do
    if [ ! -e "$unit.$target.ok" ]; then
      cat "$unit.$target.log" >&2
      failed+=("$(basename "$unit")")
    fi
  done
  if [ ${#failed[@]} -eq 0 ]; then
    echo "ok   $what: the hipified kernels of ${#units[@]} families compile"
  else
    fail "$what: ${failed[*]}"
  fi
done
exit $status
