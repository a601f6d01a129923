// Token-group family (DESIGN §8): padding token groups to an alignment, the inverse, the expert-parallel permutation,
// dequantize_rows (token rows dispatched in fp8 back to values) and sum_rows (a row gather's backward). Plain data and
// the index math shared by the CPU loops and the GPU kernels: no torch, no CUDA headers.
#pragma once

#include <cstdint>

#include "../core/float_ops.h"
#include "../core/groups.h"
#include "../core/numerics.h"

namespace moe_fp8 {

// permute_indices: the padded size of an expert with `tokens` tokens. An expert
// with none still gets `alignment` rows: the grouped GEMMs need non-empty groups.
MOE_FP8_HD int64_t expert_padded_size(int64_t tokens, int64_t alignment) {
  const int64_t p = round_up(tokens, alignment);
  return p < alignment ? alignment : p;
}

// Every data-moving op: dst[r, :] = src[map(r), :], or zeros when map(r) < 0; rows of `row_bytes` bytes at byte
// strides src_stride / dst_stride. Offsets are clamped into [0, rows] before use, so no content of offs, padded
// starts or indices can address memory out of bounds.
struct RowCopy {
  const uint8_t* src = nullptr;
  int64_t src_rows = 0;
  int64_t src_stride = 0;
  uint8_t* dst = nullptr;
  int64_t dst_rows = 0;
  int64_t dst_stride = 0;
  int64_t row_bytes = 0;
};

// pad: r -> group g whose padded range holds r, src = start_g + (r - pstart_g) inside the group's rows, else padding;
// unpad: token i -> group g holding it, src = pstart_g + (i - start_g); gather: r -> indices[r] (negative: padding).
enum class RowMapKind : int { kPad = 0, kUnpad = 1, kGather = 2 };

// What a row map needs: the group layout (pad, unpad) or the indices (gather).
// `compute_pstart` (pad only): the padded starts are computed from offs and
// `alignment` and written to `pstart_out` / `pend_out` on the way.
struct RowMapArgs {
  RowMapKind kind = RowMapKind::kGather;
  GroupLayout layout;
  const int32_t* indices = nullptr;
  bool compute_pstart = false;
  int64_t alignment = 1;
  int32_t* pstart_out = nullptr;
  int32_t* pend_out = nullptr;
};

// permute_indices inputs and outputs (DESIGN §8).
struct PermuteArgs {
  const int32_t* counts = nullptr;  // [num_ranks * experts] rank-major
  int experts = 0;
  int ranks = 0;
  int64_t alignment = 1;
  int64_t max_len = 0;
  int32_t* indices = nullptr;       // [max_len]
  int32_t* padded_sizes = nullptr;  // [experts]
  int32_t* padded_ends = nullptr;   // [experts]
};

// dequantize_rows: y[r, c] = decode(q[r, c]) * scale[r, c / block], the fp32 product
// rounded once to y's type (every NaN to the type's +NaN). Contiguous q (rows, cols)
// fp8 codes, scale (rows, scale_cols) fp32, y (rows, cols).
struct DequantRows {
  const uint8_t* q = nullptr;
  const float* scale = nullptr;
  void* y = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t block = 1;
  int64_t scale_cols = 1;
  Fp8Format fmt = Fp8Format::kE4M3FN;
  InputKind out = InputKind::kBF16;  // (y's type: the input kinds of the quantizers)
};

template <InputKind O>
struct RowsOut;
template <>
struct RowsOut<InputKind::kBF16> {
  using T = uint16_t;
  static MOE_FP8_HD T encode(float v) { return float_to_bf16_bits(v); }
};
template <>
struct RowsOut<InputKind::kFP16> {
  using T = uint16_t;
  static MOE_FP8_HD T encode(float v) { return v != v ? uint16_t{0x7E00u} : float_to_half_bits(v); }
};
template <>
struct RowsOut<InputKind::kFP32> {
  using T = float;
  static MOE_FP8_HD T encode(float v) { return v != v ? bits_float(0x7FC00000u) : v; }
};

template <Fp8Format F, InputKind O>
MOE_FP8_HD typename RowsOut<O>::T dequantize_value(uint32_t code, float scale) {
  return RowsOut<O>::encode(f_mul(decode_fp8<F>(code), scale));
}

// sum_rows: y[t] = the rows x[indices[j]], j in [offs[t-1], offs[t]), added in j's order to +0, each partial rounded
// to x's type (torch's CUDA index_put, rows of > 64 elements); indices outside [0, x_rows) add nothing, offs clamp.
// combine_rows (scale set): the same over x[i] * scale[i], each fp32 product rounded first (torchtitan's combine).
struct SumRows {
  const void* x = nullptr;  // (x_rows, cols), rows x_stride elements apart
  const float* scale = nullptr;  // (x_rows,): combine_rows
  int64_t x_rows = 0;
  int64_t x_stride = 0;
  const int32_t* indices = nullptr;
  int64_t num_indices = 0;
  const int32_t* offs = nullptr;
  void* y = nullptr;  // (rows, cols) contiguous
  int64_t rows = 0;
  int64_t cols = 0;
  InputKind kind = InputKind::kBF16;  // (x's and y's type)
};

// combine_rows_backward: row r of token t = token[r] in [0, grad_rows) gets grad_x[r] = grad[t] * scale[r] (rounded)
// and grad_scale[r] = the fp32 dot of grad[t] and x[r] (32 partials over 8-column chunks l, l + 32, ..., then added
// pairwise: l + 16, l + 8, ..., l + 1 into l); a row of any other token gets zeros.
struct CombineBackward {
  const void* grad = nullptr;  // (grad_rows, cols), rows grad_stride elements apart
  int64_t grad_rows = 0;
  int64_t grad_stride = 0;
  const void* x = nullptr;  // (rows, cols), rows x_stride elements apart
  int64_t x_stride = 0;
  const float* scale = nullptr;  // (rows,)
  const int32_t* token = nullptr;  // (rows,)
  void* grad_x = nullptr;  // (rows, cols) contiguous
  float* grad_scale = nullptr;  // (rows,)
  int64_t rows = 0;
  int64_t cols = 0;
  InputKind kind = InputKind::kBF16;  // (grad's, x's and grad_x's type)
};
constexpr int kDotLanes = 32;
constexpr int kDotChunk = 8;

// The runners of one device (CPU loops in grouping_cpu.cpp, kernels in grouping.cu)
// are gathered in a GroupingKernels table (grouping_ops.h); each takes the device
// index of its tensors (ignored on the CPU).

}  // namespace moe_fp8
