// CUDA side of the FP8 rowwise family: device guard, current stream, template
// dispatch and launch-error checks around the kernels of rowwise_kernels.cuh. Input
// checks and output allocation live in rowwise_ops.cpp (shared with the CPU path).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "../core/dispatch.h"
#include "rowwise_kernels.cuh"

namespace moe_fp8 {

void run_rows_cuda(InputKind in, Fp8Format fmt, const void* x, uint8_t* q, float* scale,
                   const RowsArgs& a, int device) {
  TORCH_CHECK(a.rows <= INT32_MAX, "moe_fp8: expected at most 2^31-1 reduction rows, got ", a.rows);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  int err = 0;
  dispatch_input_fp8(in, fmt, [&](auto kin, auto kfmt) {
    err = launch_quantize_rows<decltype(kin)::value, decltype(kfmt)::value>(x, q, scale, a, stream);
  });
  TORCH_CHECK(err == 0, "moe_fp8: rows kernel launch failed: ", gpu_error_string(err));
}

void run_cols_cuda(InputKind in, Fp8Format fmt, const ColsArgs& a, int64_t expected_segment_rows,
                   int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  const int segments = segments_with_tail(a);
  TORCH_CHECK(segments <= 65535, "moe_fp8: expected at most 65534 groups, got ", a.num_segments);
  const ColsLaunchPlan plan =
      plan_cols_launch(expected_segment_rows, segments, max_dynamic_smem_per_block(device), supports_clusters(device));
  int err = 0;
  dispatch_input_fp8(in, fmt, [&](auto kin, auto kfmt) {
    err = launch_quantize_cols<decltype(kin)::value, decltype(kfmt)::value>(a, plan, stream);
  });
  TORCH_CHECK(err == 0, "moe_fp8: cols kernel launch failed: ", gpu_error_string(err));
}

}  // namespace moe_fp8
