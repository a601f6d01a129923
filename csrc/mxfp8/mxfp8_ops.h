// The torch-facing ops of the MXFP8 recipe (DESIGN §7; schemas in csrc/bindings.cpp): e4m3fn data, one E8M0 scale a
// 32 elements of the contraction dimension, scales plain or written by the quantization kernel itself in the blocked
// layout the sm100 GEMMs read. Registered per device like every recipe (Mxfp8On<...>).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "../quant/engine.h"

namespace moe_fp8 {

// The MXFP8 recipe's instantiations: E8M0 FLOOR or RCEIL, blocks of 32, linear or
// blocked scales.
constexpr int kMxBlock = 32;
using Mxfp8Rules = RuleList<E8m0Floor, E8m0Rceil>;
using Mxfp8Blocks = BlockList<kMxBlock>;
using Mxfp8Layouts = LayoutList<LinearScales, BlockedScales>;

std::tuple<at::Tensor, at::Tensor> quantize_mxfp8_rowwise(const QuantKernels& k, const at::Tensor& x,
                                                          c10::string_view rounding, bool blocked,
                                                          const std::optional<at::Tensor>& offs);
std::tuple<at::Tensor, at::Tensor> quantize_mxfp8_colwise(const QuantKernels& k, const at::Tensor& x,
                                                          c10::string_view rounding, bool blocked,
                                                          const std::optional<at::Tensor>& offs,
                                                          const std::optional<at::Tensor>& padded_starts,
                                                          std::optional<int64_t> alignment);
std::tuple<at::Tensor, at::Tensor> quantize_mxfp8_experts(const QuantKernels& k, const at::Tensor& b,
                                                          c10::string_view rounding, bool blocked);

template <const QuantKernels& K>
struct Mxfp8On {
  static std::tuple<at::Tensor, at::Tensor> rowwise(const at::Tensor& x, c10::string_view r, bool blocked,
                                                    const std::optional<at::Tensor>& offs) {
    return quantize_mxfp8_rowwise(K, x, r, blocked, offs);
  }
  static std::tuple<at::Tensor, at::Tensor> colwise(const at::Tensor& x, c10::string_view r, bool blocked,
                                                    const std::optional<at::Tensor>& offs,
                                                    const std::optional<at::Tensor>& starts,
                                                    std::optional<int64_t> alignment) {
    return quantize_mxfp8_colwise(K, x, r, blocked, offs, starts, alignment);
  }
  static std::tuple<at::Tensor, at::Tensor> experts(const at::Tensor& b, c10::string_view r, bool blocked) {
    return quantize_mxfp8_experts(K, b, r, blocked);
  }
  static void register_impls(torch::Library& m) {
    m.impl("quantize_mxfp8_rowwise", TORCH_FN(rowwise));
    m.impl("quantize_mxfp8_colwise", TORCH_FN(colwise));
    m.impl("quantize_mxfp8_experts", TORCH_FN(experts));
  }
};

}  // namespace moe_fp8
