// The torch-facing ops of the FP8 rowwise family (schemas in csrc/bindings.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace moe_fp8 {

std::tuple<at::Tensor, at::Tensor> quantize_rowwise(const at::Tensor& x, at::ScalarType fp8_dtype, bool pow2_scale);
std::tuple<at::Tensor, at::Tensor> quantize_experts_fwd(const at::Tensor& b_t, at::ScalarType fp8_dtype,
                                                        bool pow2_scale);
std::tuple<at::Tensor, at::Tensor> quantize_experts_bwd(const at::Tensor& b_t, at::ScalarType fp8_dtype,
                                                        bool pow2_scale);
// padded_starts (with alignment): write q in the padded layout of pad_token_groups
// (DESIGN §8) straight from the unpadded x.
std::tuple<at::Tensor, at::Tensor> quantize_jagged_colwise(const at::Tensor& x, const at::Tensor& offs,
                                                           at::ScalarType fp8_dtype, bool pow2_scale,
                                                           const std::optional<at::Tensor>& padded_starts,
                                                           int64_t alignment);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_jagged_colwise_dual(
    const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& offs, at::ScalarType fp8_dtype, bool pow2_scale,
    const std::optional<at::Tensor>& padded_starts, int64_t alignment);

}  // namespace moe_fp8
