// CUDA side of the SwiGLU family: the runner around the kernel of swiglu_kernels.cuh
// (device guard, current stream and launch check through core/launch.h), registered
// for the CUDA dispatch key. Checks and allocation live in swiglu_ops.cpp.
#include <torch/library.h>

#include "../core/launch.h"
#include "swiglu_kernels.cuh"
#include "swiglu_ops.h"

namespace moe_fp8 {
namespace {

void run_cuda(InputKind in, Fp8Format fmt, const SwigluArgs& a, int device) {
  const GpuLaunch gpu(device);
  gpu.check(launch_swiglu(in, fmt, a, gpu.stream()), "swiglu");
}

}  // namespace

extern const SwigluKernels kSwigluCuda = {run_cuda};

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CUDA, m) { moe_fp8::SwigluOn<moe_fp8::kSwigluCuda>::register_impls(m); }
