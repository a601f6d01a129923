// The torch-facing ops of the FP8 rowwise recipe (DESIGN §5; schemas in csrc/bindings.cpp). Each op takes the engine
// runners of its device: rowwise_cpu.cpp and rowwise.cu register them (RowwiseOn<...>::register_impls), so no op
// branches on the device.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "../quant/engine.h"

namespace moe_fp8 {

// The rowwise recipe's instantiations: fp32 decode scales, pow2 or exact, whole
// reduction sets, linear scales.
using RowwiseRules = RuleList<Fp32Pow2, Fp32Exact>;
using RowwiseBlocks = BlockList<kWholeSet>;
using RowwiseLayouts = LayoutList<LinearScales>;

std::tuple<at::Tensor, at::Tensor> quantize_rowwise(const QuantKernels& k, const at::Tensor& x,
                                                    at::ScalarType fp8_dtype, bool pow2_scale);
// as_bf16 (this op, fwd_cat and the two bwd ops): b_t fp32, read as its bf16 rounding (the bits of
// the op on b_t.to(torch.bfloat16), without that copy).
std::tuple<at::Tensor, at::Tensor> quantize_experts_fwd(const QuantKernels& k, const at::Tensor& b_t,
                                                        at::ScalarType fp8_dtype, bool pow2_scale, bool as_bf16);
// quantize_experts_fwd of each weight, written into one (E, K, sum N_i) column-major q
// and (E, 1, sum N_i) scale: the operand of the concatenation, without a copy.
std::tuple<at::Tensor, at::Tensor> quantize_experts_fwd_cat(const QuantKernels& k, at::TensorList b_ts,
                                                            at::ScalarType fp8_dtype, bool pow2_scale, bool as_bf16);
std::tuple<at::Tensor, at::Tensor> quantize_experts_bwd(const QuantKernels& k, const at::Tensor& b_t,
                                                        at::ScalarType fp8_dtype, bool pow2_scale, bool as_bf16);
// quantize_experts_bwd of the concatenation of one or two weights (E, K, N_i) along N,
// the reduced dimension (each (e, k) scale spans both): q (E, sum N_i, K) column-major,
// scale (E, 1, K). Two weights of one layout with N strided are read in place.
std::tuple<at::Tensor, at::Tensor> quantize_experts_bwd_cat(const QuantKernels& k, at::TensorList b_ts,
                                                            at::ScalarType fp8_dtype, bool pow2_scale, bool as_bf16);
// (quantize_experts_fwd_cat(b_ts), quantize_experts_bwd_cat(b_ts)) bit for bit: both
// orientations of one or two weights, from one read where the device has the dual
// kernel and the layout suits it (DESIGN §5), else the two ops.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_experts_dual_cat(const QuantKernels& k,
                                                                                    at::TensorList b_ts,
                                                                                    at::ScalarType fp8_dtype,
                                                                                    bool pow2_scale);
// padded_starts (with alignment): write q in the padded layout of pad_token_groups
// (DESIGN §8) straight from the unpadded x.
std::tuple<at::Tensor, at::Tensor> quantize_jagged_colwise(const QuantKernels& k, const at::Tensor& x,
                                                           const at::Tensor& offs, at::ScalarType fp8_dtype,
                                                           bool pow2_scale,
                                                           const std::optional<at::Tensor>& padded_starts,
                                                           int64_t alignment);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_jagged_colwise_dual(
    const QuantKernels& k, const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& offs,
    at::ScalarType fp8_dtype, bool pow2_scale, const std::optional<at::Tensor>& padded_starts, int64_t alignment);
// (quantize_rowwise(x), quantize_jagged_colwise(x, offs, ...)) bit for bit: the
// operands of a token-grouped tensor's forward or dgrad GEMM and of its weight-gradient
// GEMM: the two ops (a one-read kernel was slower: docs/decisions/029).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_rowwise_jagged_dual(
    const QuantKernels& k, const at::Tensor& x, const at::Tensor& offs, at::ScalarType fp8_dtype, bool pow2_scale,
    const std::optional<at::Tensor>& padded_starts, int64_t alignment);

// Binds one device's runners to the ops and registers them for that device's
// dispatch key.
template <const QuantKernels& K>
struct RowwiseOn {
  static std::tuple<at::Tensor, at::Tensor> rowwise(const at::Tensor& x, at::ScalarType t, bool pow2) {
    return quantize_rowwise(K, x, t, pow2);
  }
  static std::tuple<at::Tensor, at::Tensor> experts_fwd(const at::Tensor& b, at::ScalarType t, bool pow2, bool bf) {
    return quantize_experts_fwd(K, b, t, pow2, bf);
  }
  static std::tuple<at::Tensor, at::Tensor> experts_fwd_cat(at::TensorList b, at::ScalarType t, bool pow2, bool bf) {
    return quantize_experts_fwd_cat(K, b, t, pow2, bf);
  }
  static std::tuple<at::Tensor, at::Tensor> experts_bwd_cat(at::TensorList b, at::ScalarType t, bool pow2, bool bf) {
    return quantize_experts_bwd_cat(K, b, t, pow2, bf);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> experts_dual_cat(at::TensorList b,
                                                                                    at::ScalarType t, bool pow2) {
    return quantize_experts_dual_cat(K, b, t, pow2);
  }
  static std::tuple<at::Tensor, at::Tensor> experts_bwd(const at::Tensor& b, at::ScalarType t, bool pow2, bool bf) {
    return quantize_experts_bwd(K, b, t, pow2, bf);
  }
  static std::tuple<at::Tensor, at::Tensor> jagged(const at::Tensor& x, const at::Tensor& offs, at::ScalarType t,
                                                   bool pow2, const std::optional<at::Tensor>& starts, int64_t align) {
    return quantize_jagged_colwise(K, x, offs, t, pow2, starts, align);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> jagged_dual(
      const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& offs, at::ScalarType t, bool pow2,
      const std::optional<at::Tensor>& starts, int64_t align) {
    return quantize_jagged_colwise_dual(K, x1, x2, offs, t, pow2, starts, align);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rowwise_jagged_dual(
      const at::Tensor& x, const at::Tensor& offs, at::ScalarType t, bool pow2, const std::optional<at::Tensor>& starts,
      int64_t align) {
    return quantize_rowwise_jagged_dual(K, x, offs, t, pow2, starts, align);
  }
  static void register_impls(torch::Library& m) {
    m.impl("quantize_rowwise", TORCH_FN(rowwise));
    m.impl("quantize_experts_fwd", TORCH_FN(experts_fwd));
    m.impl("quantize_experts_fwd_cat", TORCH_FN(experts_fwd_cat));
    m.impl("quantize_experts_bwd_cat", TORCH_FN(experts_bwd_cat));
    m.impl("quantize_experts_dual_cat", TORCH_FN(experts_dual_cat));
    m.impl("quantize_experts_bwd", TORCH_FN(experts_bwd));
    m.impl("quantize_jagged_colwise", TORCH_FN(jagged));
    m.impl("quantize_jagged_colwise_dual", TORCH_FN(jagged_dual));
    m.impl("quantize_rowwise_jagged_dual", TORCH_FN(rowwise_jagged_dual));
  }
};

}  // namespace moe_fp8
