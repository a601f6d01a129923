// The torch-facing ops of the FP8 blockwise recipe (DESIGN §6; schemas in
// csrc/bindings.cpp): DeepSeek-style activation quantization in 1x128 / 128x1 blocks,
// fp32 decode scales with the exact ratio (no pow2 rounding), e4m3fn, e4m3fnuz or
// e5m2 data. Registered per device like every recipe (BlockwiseOn<...>).
//
// Every op is one launch of the quantization engine (policy Fp32Exact, block 128,
// linear scales):
//  * act_lhs:            the "rows" shape: q (M, K) row-major, scale (M, ceil(K/128))
//                        column-major (set stride 1, block stride M);
//  * act_rhs:            the "cols" shape: q (M, K) column-major, scale (ceil(M/128), K)
//                        row-major (set stride 1, block stride K);
//  * act_transposed_lhs: the same launch as act_rhs, the same bytes: q (K, M) row-major
//                        is act_rhs's column-major q transposed, scale (K, ceil(M/128))
//                        column-major is act_rhs's row-major scale transposed;
//  * act_dual:           act_lhs and act_rhs (token groups) from one read: the engine's
//                        activation dual shape for the padded layout of a 2-byte x
//                        with aligned rows (where the device has it), else the two.
// The transposing ops take token groups (offs; or padded_starts + alignment, q in the
// padded layout of DESIGN §8) with blocks restarting at each group's first row.
//
// The weight ops are one launch of the engine's "tiles" shape (one scale per 128x128
// tile) for w (M, N) or (E, M, N), any strides:
//  * weight_rhs:            q (M, N) column-major, scale (ceil(M/128), ceil(N/128))
//                           column-major (per expert for 3-D);
//  * weight_transposed_rhs: q (N, M) column-major, scale (ceil(N/128), ceil(M/128))
//                           column-major;
//  * weight_dual:           both from one read (a tile and its transpose share the scale);
//  * weight_rhs_cat / _transposed_rhs_cat / _dual_cat: those of weights concatenated
//                           along N (each but the last whole 128-column tiles: the
//                           experts layer's W1 and W3), one launch a part, written
//                           straight into the concatenation's outputs.
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

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_act_lhs(const QuantKernels& k, const at::Tensor& x,
                                                              at::ScalarType fp8_dtype);
// transposed=false: act_rhs's layouts; true: act_transposed_lhs's (the same bytes).
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

// which: 0 weight_rhs, 1 weight_transposed_rhs, 2 both (q, scale, q_t, scale_t).
std::vector<at::Tensor> quantize_blockwise_weight(const TileKernels& k, const at::Tensor& w, at::ScalarType fp8_dtype,
                                                  int which);
// The same of the concatenation of ws along N (each but the last a multiple of 128
// columns), each part read once and written straight into the concatenated outputs.
std::vector<at::Tensor> quantize_blockwise_weight_cat(const TileKernels& k, at::TensorList ws,
                                                      at::ScalarType fp8_dtype, int which, const char* op);

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
  static std::tuple<at::Tensor, at::Tensor> weight_rhs(const at::Tensor& w, at::ScalarType fp8_dtype) {
    auto o = quantize_blockwise_weight(TK, w, fp8_dtype, 0);
    return {o[0], o[1]};
  }
  static std::tuple<at::Tensor, at::Tensor> weight_transposed_rhs(const at::Tensor& w, at::ScalarType fp8_dtype) {
    auto o = quantize_blockwise_weight(TK, w, fp8_dtype, 1);
    return {o[0], o[1]};
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> weight_dual(const at::Tensor& w,
                                                                                at::ScalarType fp8_dtype) {
    auto o = quantize_blockwise_weight(TK, w, fp8_dtype, 2);
    return {o[0], o[1], o[2], o[3]};
  }
  static std::tuple<at::Tensor, at::Tensor> weight_rhs_cat(at::TensorList ws, at::ScalarType fp8_dtype) {
    auto o = quantize_blockwise_weight_cat(TK, ws, fp8_dtype, 0, "quantize_blockwise_weight_rhs_cat");
    return {o[0], o[1]};
  }
  static std::tuple<at::Tensor, at::Tensor> weight_transposed_rhs_cat(at::TensorList ws, at::ScalarType fp8_dtype) {
    auto o = quantize_blockwise_weight_cat(TK, ws, fp8_dtype, 1, "quantize_blockwise_weight_transposed_rhs_cat");
    return {o[0], o[1]};
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> weight_dual_cat(at::TensorList ws,
                                                                                    at::ScalarType fp8_dtype) {
    auto o = quantize_blockwise_weight_cat(TK, ws, fp8_dtype, 2, "quantize_blockwise_weight_dual_cat");
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
