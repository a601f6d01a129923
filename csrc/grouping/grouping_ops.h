// The torch-facing ops of the token-group family (schemas in csrc/bindings.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace moe_fp8 {

// Checks padded_starts (int32 (G,) like offs) of a padded layout with padded_rows
// rows; on the CPU (or with MOE_FP8_DEBUG=1) also that every group of offs, placed
// at its start, lies inside the layout after the previous one.
void check_padded_starts(const at::Tensor& padded_starts, const at::Tensor& offs, int64_t tokens,
                         int64_t padded_rows, const at::Tensor& x, const char* op);

std::tuple<at::Tensor, at::Tensor, at::Tensor> pad_token_groups(const at::Tensor& x, const at::Tensor& offs,
                                                                int64_t alignment);
at::Tensor pad_token_groups_at(const at::Tensor& x, const at::Tensor& offs, const at::Tensor& padded_starts,
                               int64_t num_padded_rows);
at::Tensor unpad_token_groups(const at::Tensor& x_padded, const at::Tensor& offs, const at::Tensor& padded_starts,
                              int64_t num_tokens);
std::tuple<at::Tensor, at::Tensor> padded_group_offsets(const at::Tensor& offs, int64_t num_tokens, int64_t alignment);
std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_indices(const at::Tensor& tokens_per_expert_group,
                                                               int64_t experts_per_rank, int64_t num_ranks,
                                                               int64_t alignment, int64_t max_len);
void zero_rows_past_groups_(const at::Tensor& x, const at::Tensor& offs);
at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& indices);
at::Tensor scatter_rows(const at::Tensor& y, const at::Tensor& indices, int64_t num_rows);

}  // namespace moe_fp8
