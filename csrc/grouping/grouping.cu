// CUDA side of the token-group family: device guard, current stream and launch-error
// checks around the kernels of grouping_kernels.cuh. Input checks and output
// allocation live in grouping_ops.cpp (shared with the CPU path).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "grouping_kernels.cuh"

namespace moe_fp8 {
namespace {

cudaStream_t current_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

void check_launch(int err, const char* what) {
  TORCH_CHECK(err == 0, "moe_fp8: ", what, " kernel launch failed: ", gpu_error_string(err));
}

}  // namespace

void padded_offsets_cuda(const int32_t* offs, int groups, int64_t rows, int64_t alignment, int32_t* pstart,
                         int32_t* pend, int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check_launch(launch_padded_offsets(offs, groups, rows, alignment, pstart, pend, current_stream(device)),
               "padded offsets");
}

void copy_rows_cuda(const RowCopy& c, const RowMapArgs& m, int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check_launch(launch_copy_rows(c, m, current_stream(device)), "row copy");
}

void permute_indices_cuda(const PermuteArgs& p, int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const size_t smem = permute_smem_bytes(p);
  TORCH_CHECK(smem + 8192 <= static_cast<size_t>(max_dynamic_smem_per_block(device)),
              "permute_indices: expected num_ranks * experts_per_rank small enough for the tables to fit in shared "
              "memory (at most about ", (max_dynamic_smem_per_block(device) - 8192) / 12, "), got ",
              static_cast<int64_t>(p.ranks) * p.experts);
  check_launch(launch_permute_indices(p, current_stream(device)), "permute_indices");
}

void zero_rows_past_groups_cuda(uint8_t* x, int64_t rows, int64_t stride, int64_t row_bytes, const int32_t* offs,
                                int groups, int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check_launch(launch_zero_rows_past_groups(x, rows, stride, row_bytes, offs, groups, current_stream(device)),
               "zero rows");
}

void invert_indices_cuda(const int32_t* indices, int64_t n, int32_t* inverse, int64_t inverse_len, int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = current_stream(device);
  if (inverse_len > 0) {
    check_launch(static_cast<int>(cudaMemsetAsync(inverse, 0xFF, static_cast<size_t>(inverse_len) * sizeof(int32_t), stream)),
                 "inverse fill");
  }
  check_launch(launch_invert_indices(indices, n, inverse, inverse_len, stream), "invert indices");
}

}  // namespace moe_fp8
