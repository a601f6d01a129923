// The torch-facing ops of the token-group family (schemas in csrc/bindings.cpp) and their per-device registration:
// grouping_ops.cpp holds the checks and allocation, written once against a table of device runners; grouping_cpu.cpp
// and grouping.cu each fill a table and register GroupingOn<their table> for their dispatch key.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "grouping.h"

namespace moe_fp8 {

// What one device provides: the data movement of every op, on pointers the ops have
// checked and allocated. `device` is the tensors' device index (ignored on the CPU).
struct GroupingKernels {
  // pstart[g], pend[g]: padded start and end of group g (padded_group_offsets).
  void (*padded_offsets)(const int32_t* offs, int groups, int64_t rows, int64_t alignment, int32_t* pstart,
                         int32_t* pend, int device);
  // dst rows from src rows through a row map (pad, unpad, gather).
  void (*copy_rows)(const RowCopy& c, const RowMapArgs& m, int device);
  void (*permute_indices)(const PermuteArgs& p, int device);
  // Rows of x at or past clamp(offs[G-1]) become zeros.
  void (*zero_rows_past_groups)(uint8_t* x, int64_t rows, int64_t stride, int64_t row_bytes, const int32_t* offs,
                                int groups, int device);
  // inverse[indices[j]] = j for every j with 0 <= indices[j] < inverse_len, -1 elsewhere.
  void (*invert_indices)(const int32_t* indices, int64_t n, int32_t* inverse, int64_t inverse_len, int device);
  void (*dequantize_rows)(const DequantRows& a, int device);
  void (*sum_rows)(const SumRows& a, int device);
  void (*combine_rows_backward)(const CombineBackward& a, int device);
};

// The ops, on the runners of k.
std::tuple<at::Tensor, at::Tensor, at::Tensor> pad_token_groups(const GroupingKernels& k, const at::Tensor& x,
                                                                const at::Tensor& offs, int64_t alignment);
at::Tensor pad_token_groups_at(const GroupingKernels& k, const at::Tensor& x, const at::Tensor& offs,
                               const at::Tensor& padded_starts, int64_t num_padded_rows);
at::Tensor unpad_token_groups(const GroupingKernels& k, const at::Tensor& x_padded, const at::Tensor& offs,
                              const at::Tensor& padded_starts, int64_t num_tokens);
std::tuple<at::Tensor, at::Tensor> padded_group_offsets(const GroupingKernels& k, const at::Tensor& offs,
                                                        int64_t num_tokens, int64_t alignment);
std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_indices(const GroupingKernels& k,
                                                               const at::Tensor& tokens_per_expert_group,
                                                               int64_t experts_per_rank, int64_t num_ranks,
                                                               int64_t alignment, int64_t max_len);
void zero_rows_past_groups_(const GroupingKernels& k, const at::Tensor& x, const at::Tensor& offs);
at::Tensor gather_rows(const GroupingKernels& k, const at::Tensor& x, const at::Tensor& indices);
at::Tensor scatter_rows(const GroupingKernels& k, const at::Tensor& y, const at::Tensor& indices, int64_t num_rows);
at::Tensor dequantize_rows(const GroupingKernels& k, const at::Tensor& q, const at::Tensor& scale, int64_t block,
                           at::ScalarType out_dtype);
at::Tensor sum_rows(const GroupingKernels& k, const at::Tensor& x, const at::Tensor& indices, const at::Tensor& offs);
at::Tensor combine_rows(const GroupingKernels& k, const at::Tensor& x, const at::Tensor& scores,
                        const at::Tensor& indices, const at::Tensor& offs);
std::tuple<at::Tensor, at::Tensor> combine_rows_backward(const GroupingKernels& k, const at::Tensor& grad,
                                                         const at::Tensor& x, const at::Tensor& scores,
                                                         const at::Tensor& token);

// Every op bound to the runners of K, as plain functions for m.impl:
//   extern const GroupingKernels kGroupingCpu = {...};
//   TORCH_LIBRARY_IMPL(moe_fp8, CPU, m) { GroupingOn<kGroupingCpu>::register_impls(m); }
template <const GroupingKernels& K>
struct GroupingOn {
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> pad_token_groups(const at::Tensor& x, const at::Tensor& offs,
                                                                         int64_t alignment) {
    return moe_fp8::pad_token_groups(K, x, offs, alignment);
  }
  static at::Tensor pad_token_groups_at(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& padded_starts,
                                        int64_t num_padded_rows) {
    return moe_fp8::pad_token_groups_at(K, x, offs, padded_starts, num_padded_rows);
  }
  static at::Tensor unpad_token_groups(const at::Tensor& x_padded, const at::Tensor& offs,
                                       const at::Tensor& padded_starts, int64_t num_tokens) {
    return moe_fp8::unpad_token_groups(K, x_padded, offs, padded_starts, num_tokens);
  }
  static std::tuple<at::Tensor, at::Tensor> padded_group_offsets(const at::Tensor& offs, int64_t num_tokens,
                                                                 int64_t alignment) {
    return moe_fp8::padded_group_offsets(K, offs, num_tokens, alignment);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_indices(const at::Tensor& counts,
                                                                        int64_t experts_per_rank, int64_t num_ranks,
                                                                        int64_t alignment, int64_t max_len) {
    return moe_fp8::permute_indices(K, counts, experts_per_rank, num_ranks, alignment, max_len);
  }
  static void zero_rows_past_groups_(const at::Tensor& x, const at::Tensor& offs) {
    moe_fp8::zero_rows_past_groups_(K, x, offs);
  }
  static at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& indices) {
    return moe_fp8::gather_rows(K, x, indices);
  }
  static at::Tensor scatter_rows(const at::Tensor& y, const at::Tensor& indices, int64_t num_rows) {
    return moe_fp8::scatter_rows(K, y, indices, num_rows);
  }
  static at::Tensor dequantize_rows(const at::Tensor& q, const at::Tensor& scale, int64_t block,
                                    at::ScalarType out_dtype) {
    return moe_fp8::dequantize_rows(K, q, scale, block, out_dtype);
  }
  static at::Tensor sum_rows(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& offs) {
    return moe_fp8::sum_rows(K, x, indices, offs);
  }
  static at::Tensor combine_rows(const at::Tensor& x, const at::Tensor& scores, const at::Tensor& indices,
                                 const at::Tensor& offs) {
    return moe_fp8::combine_rows(K, x, scores, indices, offs);
  }
  static std::tuple<at::Tensor, at::Tensor> combine_rows_backward(const at::Tensor& grad, const at::Tensor& x,
                                                                  const at::Tensor& scores, const at::Tensor& token) {
    return moe_fp8::combine_rows_backward(K, grad, x, scores, token);
  }

  static void register_impls(torch::Library& m) {
    m.impl("pad_token_groups", TORCH_FN(pad_token_groups));
    m.impl("pad_token_groups_at", TORCH_FN(pad_token_groups_at));
    m.impl("unpad_token_groups", TORCH_FN(unpad_token_groups));
    m.impl("padded_group_offsets", TORCH_FN(padded_group_offsets));
    m.impl("permute_indices", TORCH_FN(permute_indices));
    m.impl("zero_rows_past_groups_", TORCH_FN(zero_rows_past_groups_));
    m.impl("gather_rows", TORCH_FN(gather_rows));
    m.impl("scatter_rows", TORCH_FN(scatter_rows));
    m.impl("dequantize_rows", TORCH_FN(dequantize_rows));
    m.impl("sum_rows", TORCH_FN(sum_rows));
    m.impl("combine_rows", TORCH_FN(combine_rows));
    m.impl("combine_rows_backward", TORCH_FN(combine_rows_backward));
  }
};

}  // namespace moe_fp8
