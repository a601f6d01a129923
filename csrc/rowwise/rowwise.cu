// CUDA side of the FP8 rowwise family: device guard, current stream, template
// dispatch and launch-error checks around the kernels of rowwise_kernels.cuh. Input
// checks and output allocation live in rowwise_ops.cpp (shared with the CPU path).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>

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

// MOE_FP8_COLS_PLAN="cluster,rows" replaces the launch plan of the transposing
// kernels, for tuning sweeps (bench/sweep_cols.py); results are the same for any
// valid plan, only the speed changes.
static ColsLaunchPlan cols_plan_override(const char* v, int device) {
  int cluster = 0, rows = 0;
  char tail = 0;
  const bool parsed = std::sscanf(v, "%d,%d%c", &cluster, &rows, &tail) == 2;
  const int max_cluster = supports_clusters(device) ? kColsMaxCluster : 1;
  TORCH_CHECK(parsed && cluster >= 1 && cluster <= max_cluster && (cluster & (cluster - 1)) == 0 && rows > 0 &&
                  rows % kColsFragRows == 0 &&
                  static_cast<int64_t>(rows) * kColsTileBytes <= max_dynamic_smem_per_block(device) - 8192,
              "moe_fp8: expected MOE_FP8_COLS_PLAN=\"cluster,rows\" with cluster a power of two up to ", max_cluster,
              " and rows a positive multiple of ", kColsFragRows, " that fits shared memory, got \"", v, "\"");
  return {cluster, rows};
}

void run_cols_cuda(InputKind in, Fp8Format fmt, const ColsArgs& a, int64_t expected_segment_rows,
                   int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  TORCH_CHECK(a.rows <= INT32_MAX && a.q_rows <= INT32_MAX, "moe_fp8: expected at most 2^31-1 rows, got ",
              std::max(a.rows, a.q_rows));
  const int segments = segments_with_tail(a);
  TORCH_CHECK(segments <= 65535, "moe_fp8: expected at most 65534 groups, got ", a.num_segments);
  ColsLaunchPlan plan =
      plan_cols_launch(expected_segment_rows, segments, max_dynamic_smem_per_block(device), supports_clusters(device));
  if (const char* v = std::getenv("MOE_FP8_COLS_PLAN")) {
    plan = cols_plan_override(v, device);
    TORCH_CHECK(static_cast<int64_t>(segments) * plan.cluster <= 65535, "moe_fp8: MOE_FP8_COLS_PLAN cluster ",
                plan.cluster, " is too large for ", segments, " segments");
  }
  int err = 0;
  dispatch_input_fp8(in, fmt, [&](auto kin, auto kfmt) {
    err = launch_quantize_cols<decltype(kin)::value, decltype(kfmt)::value>(a, plan, stream);
  });
  TORCH_CHECK(err == 0, "moe_fp8: cols kernel launch failed: ", gpu_error_string(err));
}

}  // namespace moe_fp8
