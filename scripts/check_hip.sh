#!/usr/bin/env bash
# ROCm checks that need no AMD GPU (run by .ci/run):
#  1. hipify csrc/ into a scratch folder with PyTorch's hipify;
#  2. fail if anything CUDA-only survives in the hipified sources outside
#     core/portability.h (which keeps its CUDA branches behind !USE_ROCM);
#  3. compile the hipified torch-free kernels, every op's launchers for every input
#     dtype and fp8 format, with hipcc for gfx940 (MI300: hardware fnuz conversion)
#     and gfx90a (MI200: no fp8 instructions, the software encoder), -Werror.
# Needs hipcc (Debian: apt-get install -y --no-install-recommends hipcc).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v hipcc >/dev/null || { echo "check_hip: hipcc not found" >&2; exit 1; }
export HIP_PLATFORM=amd  # the CUDA toolkit on the machine would otherwise take over hipcc
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 scripts/hipify_tree.py csrc "$work" >/dev/null
src="$work/csrc"
echo "hipified: $(cd "$src" && find . -name '*_hip.*' -o -name '*.hip' | sort | tr '\n' ' ')"

# Only the files a ROCm build compiles or includes: the hipified ones, and the
# originals hipify had no reason to change.
files=$(cd "$src" && for f in $(find . -type f | sort); do
  case "$f" in *_hip.*|*.hip) echo "$f" ;; *)
    base="${f%.*}"; ext="${f##*.}"
    [ -e "${base}_hip.${ext}" ] || [ "$ext" = cu ] || echo "$f" ;;
  esac
done | grep -v 'core/portability')
pattern='__shfl(_[a-z]+)?_sync|cuda_fp8\.h|\b__nv_[a-z0-9_]+|\bcuda[A-Z][A-Za-z]*|cooperative_groups|cp\.async|<<<'
if leaks=$(cd "$src" && grep -nE "$pattern" $files); then
  echo "check_hip: CUDA-only code survives hipify outside core/portability.h:" >&2
  echo "$leaks" >&2
  exit 1
fi
echo "ok   no CUDA-only code outside core/portability.h"

cat >"$work/instantiate.hip" <<'CPP'
// Every launcher of every kernel family, for every input dtype and fp8 format.
#include "core/dispatch_hip.h"
#include "rowwise/rowwise_kernels_hip.cuh"
#include "grouping/GROUPING_KERNELS"

#if defined(__HIP_DEVICE_COMPILE__) && defined(__gfx940__) && !MOE_FP8_HW_E4M3FNUZ
#error "gfx940 must encode fnuz with the hardware conversion"
#endif
#if defined(__HIP_DEVICE_COMPILE__) && defined(__gfx90a__) && (MOE_FP8_HW_E4M3FNUZ || MOE_FP8_HW_E4M3FN)
#error "gfx90a has no fp8 conversion instructions: the software encoder must be used"
#endif

namespace moe_fp8 {
int instantiate_all(InputKind in, Fp8Format fmt, const void* x, uint8_t* q, float* s, const RowsArgs& r,
                    const ColsArgs& c, gpuStream_t stream) {
  int err = 0;
  dispatch_input_fp8(in, fmt, [&](auto k, auto f) {
    err |= launch_quantize_rows<decltype(k)::value, decltype(f)::value>(x, q, s, r, stream);
    err |= launch_quantize_cols<decltype(k)::value, decltype(f)::value>(c, plan_cols_launch(1024, 1, 65536, false), stream);
  });
  return err;
}
int instantiate_grouping(const RowCopy& c, const RowMapArgs& m, const PermuteArgs& p, gpuStream_t stream) {
  return launch_copy_rows(c, m, stream) | launch_permute_indices(p, stream) |
         launch_invert_indices(p.counts, 4, p.indices, 4, stream) |
         launch_padded_offsets(p.counts, 4, 8, 16, p.indices, p.padded_ends, stream);
}
}  // namespace moe_fp8
CPP
# hipify renames a header only when it changed something in it.
grouping=grouping_kernels.cuh
[ -e "$src/grouping/grouping_kernels_hip.cuh" ] && grouping=grouping_kernels_hip.cuh
sed -i "s/GROUPING_KERNELS/$grouping/" "$work/instantiate.hip"
status=0
for arch in gfx940 gfx90a; do
  if hipcc --offload-arch="$arch" -std=c++17 -O2 -Werror -DUSE_ROCM -I"$src" -c "$work/instantiate.hip" -o "$work/instantiate.$arch.o"; then
    echo "ok   hipcc $arch: hipified kernels compile"
  else
    echo "FAIL hipcc $arch" >&2
    status=1
  fi
done
exit $status
