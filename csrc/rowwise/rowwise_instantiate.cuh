// Torch-free instantiation of every rowwise launcher for every input dtype and fp8
// format. Not part of the extension: scripts/check_hip.sh compiles the hipified copy
// for each AMD arch (no ROCm torch needed). Keep it in step with rowwise_kernels.cuh.
// Non-inline on purpose (only check_hip.sh includes it, into one file): an unused
// inline function would let the compiler skip generating the kernels it names.
#pragma once

#include "../core/dispatch.h"
#include "rowwise_kernels.cuh"

namespace moe_fp8 {
namespace instantiate {

int rowwise_launchers(InputKind in, Fp8Format fmt, const void* x, uint8_t* q, float* s, const RowsArgs& r,
                      const ColsArgs& c, gpuStream_t stream) {
  int err = 0;
  dispatch_input_fp8(in, fmt, [&](auto k, auto f) {
    err |= launch_quantize_rows<decltype(k)::value, decltype(f)::value>(x, q, s, r, stream);
    err |= launch_quantize_cols<decltype(k)::value, decltype(f)::value>(c, plan_cols_launch(1024, 1, 65536, false),
                                                                        stream);
  });
  return err;
}

}  // namespace instantiate
}  // namespace moe_fp8
