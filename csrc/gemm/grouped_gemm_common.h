// Host helpers shared by the Hopper grouped GEMM ops (blockwise_grouped_sm90.cu,
// rowwise_grouped_sm90.cu): device queries, the argument checks of their operands'
// layouts, and the device helper that zeroes bf16 outputs no group writes.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../core/op_checks.h"

namespace moe_fp8 {
namespace gemm_common {

// A device attribute (a host query, no sync; ATen's CUDAContext would pull in cuSPARSE headers).
inline int device_attr(cudaDeviceAttr attr, int device) {
  int v = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&v, attr, device);
  TORCH_CHECK(err == cudaSuccess, "moe_fp8: cudaDeviceGetAttribute failed: ", cudaGetErrorString(err));
  return v;
}

inline int sm_count(int device) { return device_attr(cudaDevAttrMultiProcessorCount, device); }

// The op runs on a's GPU only if it is a Hopper (9.0) and this file was built with the
// CUTLASS sm_90a kernels (`built`).
inline void check_hopper(const at::Tensor& a, const char* op, bool built) {
  const int device = a.device().index();
  const int major = device_attr(cudaDevAttrComputeCapabilityMajor, device);
  const int minor = device_attr(cudaDevAttrComputeCapabilityMinor, device);
  TORCH_CHECK(major == 9 && minor == 0, op,
              ": expected a GPU of compute capability 9.0 (Hopper, sm_90a; the kernel is built for it only), got ",
              major, ".", minor);
  TORCH_CHECK(built, op, ": expected a build with the CUTLASS sm_90a kernels, got one without (nvcc too old)");
}

inline void check_shape(const char* op, const char* name, const at::Tensor& t, c10::IntArrayRef expected) {
  TORCH_CHECK(t.sizes() == expected, op, ": expected ", name, " of shape ", expected, ", got ", t.sizes());
}

// The fp32 main gradient a wgrad op adds into in place: float32, a's device, `expected`, contiguous.
inline void check_add_out(const char* op, const at::Tensor& out, const at::Tensor& a, c10::IntArrayRef expected) {
  TORCH_CHECK(out.scalar_type() == at::kFloat, op, ": expected out of dtype float32, got ", out.scalar_type());
  TORCH_CHECK(out.device() == a.device(), op, ": expected out on ", a.device(), " (the device of a), got ",
              out.device());
  check_shape(op, "out", out, expected);
  TORCH_CHECK(out.is_contiguous(), op, ": expected out contiguous (row-major (E, N, K)), got strides ",
              out.strides());
}

// The stride of dim d, or `fallback` where it does not matter: dim d has one element,
// or the tensor none.
inline int64_t stride_or(const at::Tensor& t, int64_t d, int64_t fallback) {
  return t.size(d) > 1 && t.numel() > 0 ? t.stride(d) : fallback;
}

inline void check_unit_stride(const char* op, const char* name, const at::Tensor& t, int64_t d, const char* layout) {
  TORCH_CHECK(t.size(d) <= 1 || t.stride(d) == 1, op, ": expected ", name, " ", layout, " (stride(", d,
              ") == 1), got strides ", t.strides());
}

inline void check_ld(const char* op, const char* what, int64_t ld, int64_t min, int64_t multiple) {
  TORCH_CHECK(ld >= min && ld % multiple == 0, op, ": expected ", what, " to be at least ", min,
              " and a multiple of ", multiple, " (16-byte rows for TMA), got ", ld);
}

inline void check_aligned(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": expected ", name,
              " to start at a 16-byte aligned address (TMA), got storage offset ", t.storage_offset());
}

// Zero elements [begin, end) of a bf16 buffer, 8 at a time (16-byte stores: every
// range starts and ends at a multiple of 8 elements), strided over `threads` threads.
__device__ __forceinline__ void zero_bf16(void* base, int64_t begin, int64_t end, int64_t thread, int64_t threads) {
  uint4* v = static_cast<uint4*>(base);
  for (int64_t i = begin / 8 + thread; i < end / 8; i += threads) v[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace gemm_common
}  // namespace moe_fp8
