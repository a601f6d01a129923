// The torch-facing MXFP8 scale swizzles (DESIGN §7; schemas in csrc/bindings.cpp): scales made elsewhere to and from
// the blocked layout the sm100 GEMMs read. swizzle_ops.cpp holds the checks and allocation of every device;
// swizzle_cpu.cpp and swizzle.cu fill a SwizzleKernels table and register SwizzleOn<their table>.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

#include "swizzle.h"

namespace moe_fp8 {

// What one device provides: the whole swizzle of a checked, allocated SwizzleArgs
// (to_blocked: a.blocked_out written whole; from_blocked: a.plain_out written whole).
// `scratch`: 3G + 1 int32 on the device when G > kSwizzleSmemGroups, else null.
struct SwizzleKernels {
  void (*run)(const SwizzleArgs& a, bool to_blocked, int32_t* scratch, int device);
};

at::Tensor to_blocked_scales(const SwizzleKernels& k, const at::Tensor& s);
at::Tensor to_blocked_scales_m_groups(const SwizzleKernels& k, const at::Tensor& s, const at::Tensor& offs);
at::Tensor to_blocked_scales_k_groups(const SwizzleKernels& k, const at::Tensor& s, const at::Tensor& offs);
at::Tensor from_blocked_scales(const SwizzleKernels& k, const at::Tensor& b, int64_t rows, int64_t cols);
at::Tensor from_blocked_scales_m_groups(const SwizzleKernels& k, const at::Tensor& b, const at::Tensor& offs,
                                        int64_t cols);
at::Tensor from_blocked_scales_k_groups(const SwizzleKernels& k, const at::Tensor& b, const at::Tensor& offs,
                                        int64_t rows, int64_t cols);

template <const SwizzleKernels& K>
struct SwizzleOn {
  static at::Tensor to_blocked(const at::Tensor& s) { return to_blocked_scales(K, s); }
  static at::Tensor to_blocked_m(const at::Tensor& s, const at::Tensor& offs) {
    return to_blocked_scales_m_groups(K, s, offs);
  }
  static at::Tensor to_blocked_k(const at::Tensor& s, const at::Tensor& offs) {
    return to_blocked_scales_k_groups(K, s, offs);
  }
  static at::Tensor from_blocked(const at::Tensor& b, int64_t rows, int64_t cols) {
    return from_blocked_scales(K, b, rows, cols);
  }
  static at::Tensor from_blocked_m(const at::Tensor& b, const at::Tensor& offs, int64_t cols) {
    return from_blocked_scales_m_groups(K, b, offs, cols);
  }
  static at::Tensor from_blocked_k(const at::Tensor& b, const at::Tensor& offs, int64_t rows, int64_t cols) {
    return from_blocked_scales_k_groups(K, b, offs, rows, cols);
  }
  static void register_impls(torch::Library& m) {
    m.impl("to_blocked_scales", TORCH_FN(to_blocked));
    m.impl("to_blocked_scales_m_groups", TORCH_FN(to_blocked_m));
    m.impl("to_blocked_scales_k_groups", TORCH_FN(to_blocked_k));
    m.impl("from_blocked_scales", TORCH_FN(from_blocked));
    m.impl("from_blocked_scales_m_groups", TORCH_FN(from_blocked_m));
    m.impl("from_blocked_scales_k_groups", TORCH_FN(from_blocked_k));
  }
};

}  // namespace moe_fp8
