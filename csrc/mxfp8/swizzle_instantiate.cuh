// Torch-free instantiation of every MXFP8 scale-swizzle launcher (both directions,
// every group mode), for scripts/check_hip.sh; non-inline for the reason given in
// mxfp8_instantiate.cuh.
#pragma once

#include <initializer_list>

#include "swizzle_kernels.cuh"

namespace moe_fp8 {
namespace instantiate {

int swizzle_launchers(const SwizzleArgs& a, int32_t* scratch, gpuStream_t stream) {
  int err = 0;
  for (SwizzleGroups g : {SwizzleGroups::kNone, SwizzleGroups::kMGroups, SwizzleGroups::kKGroups}) {
    SwizzleArgs b = a;
    b.groups = g;
    err |= launch_swizzle(b, true, scratch, stream) | launch_swizzle(b, false, scratch, stream);
  }
  return err;
}

}  // namespace instantiate
}  // namespace moe_fp8
