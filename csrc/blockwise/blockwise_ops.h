// The torch-facing ops of the FP8 blockwise recipe (DESIGN §6; schemas in csrc/bindings.cpp): 1x128 / 128x1
// activation blocks and 128x128 weight tiles, fp32 decode scales of the exact ratio (no pow2), e4m3fn, e4m3fnuz or
// e5m2 data. Each op is one launch of the engine (Fp32Exact, block 128, linear scales); BlockwiseOn registers them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "../quant/engine.h"

namespace moe_fp8 {

// The blockwise recipe's instantiations: exact fp32 scales, blocks of 128, linear.
constexpr int kBwBlock = 128;
using BlockwiseRules = RuleList<Fp32Exact>;
using BlockwiseBlocks = BlockList<kBwBlock>;
using BlockwiseLayouts = LayoutList<LinearScales>;

// act_lhs, the engine's "rows" shape: q (M, K) row-major, scale (M, ceil(K/128)) column-major (set stride 1, block
// stride M).
std::tuple<at::Tensor, at::Tensor> quantize_blockwise_act_lhs(const QuantKernels& k, const at::Tensor& x,
                                                              at::ScalarType fp8_dtype);
// The "cols" shape. transposed=false: act_rhs, q (M, K) column-major, scale (ceil(M/128), K) row-major; true:
// act_transposed_lhs, the same launch and bytes transposed. Token groups (offs; or padded_starts + alignment, DESIGN
// §8's padded layout) restart blocks at each group's first row.
std::tuple<at::Tensor, at::Tensor> quantize_blockwise_act_cols(const QuantKernels& k, const at::Tensor& x,
                                                               at::ScalarType fp8_dtype,
                                                               const std::optional<at::Tensor>& offs,
                                                               const std::optional<at::Tensor>& padded_starts,
                                                               std::optional<int64_t> alignment, bool transposed);

// act_lhs and act_rhs of x with the token groups of offs: one read (tk.act_dual) for
// the padded layout of a 2-byte x with aligned rows, else the two launches.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_blockwise_act_dual(
    const QuantKernels& k, const TileKernels& tk, const at::Tensor& x, at::ScalarType fp8_dtype,
    const at::Tensor& offs, const std::optional<at::Tensor>& padded_starts, std::optional<int64_t> alignment);

// The "tiles" shape, a scale a 128x128 tile of w (M, N) or (E, M, N), any strides (as_bf16: fp32 read as bf16). which:
// 0 weight_rhs, q (M, N) and scale (ceil(M/128), ceil(N/128)) column-major per expert; 1 weight_transposed_rhs, q
// (N, M), scale transposed likewise; 2 both (q, scale, q_t, scale_t) from one read (a tile and its transpose share it).
std::vector<at::Tensor> quantize_blockwise_weight(const TileKernels& k, const at::Tensor& w, at::ScalarType fp8_dtype,
                                                  int which, bool as_bf16 = false);
// The same of ws concatenated along N (each but the last whole 128-column tiles: the experts layer's W1 and W3),
// each part read once and written straight into the concatenated outputs.
std::vector<at::Tensor> quantize_blockwise_weight_cat(const TileKernels& k, at::TensorList ws,
                                                      at::ScalarType fp8_dtype, int which, const char* op,
                                                      bool interleave, bool as_bf16 = false);

template <const QuantKernels& K, const TileKernels& TK>
struct BlockwiseOn {
  static std::tuple<at::Tensor, at::Tensor> act_lhs(const at::Tensor& x, at::ScalarType fp8_dtype) {
    return quantize_blockwise_act_lhs(K, x, fp8_dtype);
  }
  static std::tuple<at::Tensor, at::Tensor> act_rhs(const at::Tensor& x, at::ScalarType fp8_dtype,
                                                    const std::optional<at::Tensor>& offs,
                                                    const std::optional<at::Tensor>& starts,
                                                    std::optional<int64_t> alignment) {
    return quantize_blockwise_act_cols(K, x, fp8_dtype, offs, starts, alignment, false);
  }
  static std::tuple<at::Tensor, at::Tensor> act_transposed_lhs(const at::Tensor& x, at::ScalarType fp8_dtype,
                                                               const std::optional<at::Tensor>& offs,
                                                               const std::optional<at::Tensor>& starts,
                                                               std::optional<int64_t> alignment) {
    return quantize_blockwise_act_cols(K, x, fp8_dtype, offs, starts, alignment, true);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> act_dual(const at::Tensor& x,
                                                                             at::ScalarType fp8_dtype,
                                                                             const at::Tensor& offs,
                                                                             const std::optional<at::Tensor>& starts,
                                                                             std::optional<int64_t> alignment) {
    return quantize_blockwise_act_dual(K, TK, x, fp8_dtype, offs, starts, alignment);
  }
  static std::tuple<at::Tensor, at::Tensor> weight_rhs(const at::Tensor& w, at::ScalarType fp8_dtype, bool as_bf16) {
    auto o = quantize_blockwise_weight(TK, w, fp8_dtype, 0, as_bf16);
    return {o[0], o[1]};
  }
  static std::tuple<at::Tensor, at::Tensor> weight_transposed_rhs(const at::Tensor& w, at::ScalarType fp8_dtype,
                                                                  bool as_bf16) {
    auto o = quantize_blockwise_weight(TK, w, fp8_dtype, 1, as_bf16);
    return {o[0], o[1]};
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> weight_dual(const at::Tensor& w,
                                                                                at::ScalarType fp8_dtype) {
    auto o = quantize_blockwise_weight(TK, w, fp8_dtype, 2);
    return {o[0], o[1], o[2], o[3]};
  }
  static std::tuple<at::Tensor, at::Tensor> weight_rhs_cat(at::TensorList ws, at::ScalarType fp8_dtype,
                                                           bool interleave, bool as_bf16) {
    auto o = quantize_blockwise_weight_cat(TK, ws, fp8_dtype, 0, "quantize_blockwise_weight_rhs_cat", interleave,
                                           as_bf16);
    return {o[0], o[1]};
  }
  static std::tuple<at::Tensor, at::Tensor> weight_transposed_rhs_cat(at::TensorList ws, at::ScalarType fp8_dtype,
                                                                      bool as_bf16) {
    auto o = quantize_blockwise_weight_cat(TK, ws, fp8_dtype, 1, "quantize_blockwise_weight_transposed_rhs_cat",
                                           false, as_bf16);
    return {o[0], o[1]};
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> weight_dual_cat(at::TensorList ws,
                                                                                    at::ScalarType fp8_dtype,
                                                                                    bool interleave) {
    auto o = quantize_blockwise_weight_cat(TK, ws, fp8_dtype, 2, "quantize_blockwise_weight_dual_cat", interleave);
    return {o[0], o[1], o[2], o[3]};
  }
  static void register_impls(torch::Library& m) {
    m.impl("quantize_blockwise_weight_rhs_cat", TORCH_FN(weight_rhs_cat));
    m.impl("quantize_blockwise_weight_transposed_rhs_cat", TORCH_FN(weight_transposed_rhs_cat));
    m.impl("quantize_blockwise_weight_dual_cat", TORCH_FN(weight_dual_cat));
    m.impl("quantize_blockwise_weight_rhs", TORCH_FN(weight_rhs));
    m.impl("quantize_blockwise_weight_transposed_rhs", TORCH_FN(weight_transposed_rhs));
    m.impl("quantize_blockwise_weight_dual", TORCH_FN(weight_dual));
    m.impl("quantize_blockwise_act_lhs", TORCH_FN(act_lhs));
    m.impl("quantize_blockwise_act_rhs", TORCH_FN(act_rhs));
    m.impl("quantize_blockwise_act_transposed_lhs", TORCH_FN(act_transposed_lhs));
    m.impl("quantize_blockwise_act_dual", TORCH_FN(act_dual));
  }
};

}  // namespace moe_fp8
