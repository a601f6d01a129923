// CUDA side of the token-group family: the runners around grouping_kernels.cuh (device guard, current stream and
// launch check through core/launch.h), gathered in the CUDA table and registered for CUDA. Input checks and output
// allocation live in grouping_ops.cpp (shared with the CPU registration).
#include <torch/library.h>

#include "../core/device_runtime.h"
#include "../core/launch.h"
#include "grouping_kernels.cuh"
#include "grouping_ops.h"

namespace moe_fp8 {
namespace {

void padded_offsets_cuda(const int32_t* offs, int groups, int64_t rows, int64_t alignment, int32_t* pstart,
                         int32_t* pend, int device) {
  const GpuLaunch gpu(device);
  gpu.check(launch_padded_offsets(offs, groups, rows, alignment, pstart, pend, gpu.stream()), "padded offsets");
}

void copy_rows_cuda(const RowCopy& c, const RowMapArgs& m, int device) {
  const GpuLaunch gpu(device);
  gpu.check(launch_copy_rows(c, m, gpu.stream()), "row copy");
}

void permute_indices_cuda(const PermuteArgs& p, int device) {
  const GpuLaunch gpu(device);
  const size_t smem = permute_smem_bytes(p);
  TORCH_CHECK(smem + 8192 <= static_cast<size_t>(max_dynamic_smem_per_block(device)),
              "permute_indices: expected num_ranks * experts_per_rank small enough for the tables to fit in shared "
              "memory (at most about ", (max_dynamic_smem_per_block(device) - 8192) / 12, "), got ",
              static_cast<int64_t>(p.ranks) * p.experts);
  gpu.check(launch_permute_indices(p, gpu.stream()), "permute_indices");
}

void zero_rows_past_groups_cuda(uint8_t* x, int64_t rows, int64_t stride, int64_t row_bytes, const int32_t* offs,
                                int groups, int device) {
  const GpuLaunch gpu(device);
  gpu.check(launch_zero_rows_past_groups(x, rows, stride, row_bytes, offs, groups, gpu.stream()), "zero rows");
}

void invert_indices_cuda(const int32_t* indices, int64_t n, int32_t* inverse, int64_t inverse_len, int device) {
  const GpuLaunch gpu(device);
  if (inverse_len > 0) {
    gpu.check(static_cast<int>(
                  cudaMemsetAsync(inverse, 0xFF, static_cast<size_t>(inverse_len) * sizeof(int32_t), gpu.stream())),
              "inverse fill");
  }
  gpu.check(launch_invert_indices(indices, n, inverse, inverse_len, gpu.stream()), "invert indices");
}

void dequantize_rows_cuda(const DequantRows& a, int device) {
  const GpuLaunch gpu(device);
  gpu.check(launch_dequantize_rows(a, gpu.stream()), "dequantize_rows");
}

void sum_rows_cuda(const SumRows& a, int device) {
  const GpuLaunch gpu(device);
  gpu.check(launch_sum_rows(a, gpu.stream()), "sum_rows");
}

void combine_rows_backward_cuda(const CombineBackward& a, int device) {
  const GpuLaunch gpu(device);
  gpu.check(launch_combine_rows_backward(a, gpu.stream()), "combine_rows_backward");
}

}  // namespace

extern const GroupingKernels kGroupingCuda = {
    padded_offsets_cuda, copy_rows_cuda,       permute_indices_cuda, zero_rows_past_groups_cuda,
    invert_indices_cuda, dequantize_rows_cuda, sum_rows_cuda,        combine_rows_backward_cuda,
};

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CUDA, m) { moe_fp8::GroupingOn<moe_fp8::kGroupingCuda>::register_impls(m); }
