// Torch-free instantiation of every SwiGLU launcher, not part of the extension: scripts/check_hip.sh compiles the
// hipified copy for each AMD arch. Not inline on purpose (only check_hip.sh includes it, into one file): an unused
// inline function would let the compiler skip generating the kernels it names.
#pragma once

#include "swiglu_kernels.cuh"

namespace moe_fp8 {
namespace instantiate {

int swiglu_launchers(InputKind in, Fp8Format fmt, const SwigluArgs& a, gpuStream_t stream) {
  return launch_swiglu(in, fmt, a, stream);
}

}  // namespace instantiate
}  // namespace moe_fp8
