// CUDA registration of the MXFP8 scale swizzles: the runner around the kernels of
// swizzle_kernels.cuh (device guard, current stream and launch check through
// core/launch.h). Checks and allocation live in swizzle_ops.cpp.
#include <torch/library.h>

#include "../core/launch.h"
#include "swizzle_kernels.cuh"
#include "swizzle_ops.h"

namespace moe_fp8 {
namespace {

void swizzle_cuda(const SwizzleArgs& a, bool to_blocked, int32_t* scratch, int device) {
  const GpuLaunch gpu(device);
  gpu.check(launch_swizzle(a, to_blocked, scratch, gpu.stream()), to_blocked ? "to_blocked_scales" : "from_blocked_scales");
}

}  // namespace

extern const SwizzleKernels kSwizzleCuda;
const SwizzleKernels kSwizzleCuda = {swizzle_cuda};

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CUDA, m) { moe_fp8::SwizzleOn<moe_fp8::kSwizzleCuda>::register_impls(m); }
