// Torch-free instantiation of every token-group launcher, not part of the extension: scripts/check_hip.sh compiles
// the hipified copy for each AMD arch. Keep it in step with grouping_kernels.cuh. Not inline on purpose (only
// check_hip.sh includes it, into one file): an unused inline function would let the compiler skip its kernels.
#pragma once

#include "grouping_kernels.cuh"

namespace moe_fp8 {
namespace instantiate {

int grouping_launchers(const RowCopy& c, const RowMapArgs& m, const PermuteArgs& p, const DequantRows& d,
                       gpuStream_t stream) {
  return launch_copy_rows(c, m, stream) | launch_permute_indices(p, stream) | launch_dequantize_rows(d, stream) |
         launch_invert_indices(p.counts, 4, p.indices, 4, stream) |
         launch_padded_offsets(p.counts, 4, 8, 16, p.indices, p.padded_ends, stream);
}

}  // namespace instantiate
}  // namespace moe_fp8
