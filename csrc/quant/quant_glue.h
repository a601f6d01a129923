// Torch glue shared by every recipe's ops (host side, torch headers): the mapping of
// torch dtypes onto the engine's input kinds and fp8 formats, and the padded token-group
// layout of the jagged (per-group colwise) ops, with their checks.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "../core/groups.h"
#include "../core/numerics.h"
#include "../core/op_checks.h"
#include "engine.h"

namespace moe_fp8 {

inline InputKind input_kind(const at::Tensor& x, const char* op, const char* name) {
  switch (x.scalar_type()) {
    case at::kBFloat16: return InputKind::kBF16;
    case at::kHalf: return InputKind::kFP16;
    case at::kFloat: return InputKind::kFP32;
    default:
      TORCH_CHECK(false, op, ": expected ", name, " of dtype bfloat16, float16 or float32, got ", x.scalar_type());
  }
}

// as_bf16: x fp32, read as its bf16 rounding (kFP32AsBF16; the weight quantizers that take it).
inline InputKind input_kind(const at::Tensor& x, const char* op, const char* name, bool as_bf16) {
  TORCH_CHECK(!as_bf16 || x.scalar_type() == at::kFloat, op, ": expected ", name,
              " of dtype float32 to read it as bfloat16 (as_bf16=True), got ", x.scalar_type());
  return as_bf16 ? InputKind::kFP32AsBF16 : input_kind(x, op, name);
}

inline Fp8Format fp8_format(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat8_e4m3fn: return Fp8Format::kE4M3FN;
    case at::kFloat8_e4m3fnuz: return Fp8Format::kE4M3FNUZ;
    case at::kFloat8_e5m2: return Fp8Format::kE5M2;
    default:
      TORCH_CHECK(false, op, ": expected fp8_dtype float8_e4m3fn, float8_e4m3fnuz or float8_e5m2, got ", t);
  }
}

// The optional padded layout of the jagged ops (DESIGN §8): q rows and the padded starts checked against offs. The
// quantizations write padded groups and the tail, never rows between groups, so starts must be gap-free (as
// padded_group_offsets makes; checked on the CPU and with MOE_FP8_DEBUG=1); pad/unpad_token_groups take any placement.
struct JaggedLayout {
  int64_t q_rows;
  at::Tensor padded_starts;  // undefined: unpadded
  int64_t alignment;
};

inline JaggedLayout jagged_layout(const at::Tensor& x, const at::Tensor& offs,
                                  const std::optional<at::Tensor>& padded_starts, int64_t alignment, const char* op) {
  const int64_t M = x.size(0);
  if (!padded_starts.has_value()) return {M, at::Tensor(), 1};
  check_alignment(alignment, op);
  const int64_t R = checked_padded_rows(M, offs.numel(), alignment, op);
  check_padded_starts(*padded_starts, offs, M, R, x, op, alignment, /*gap_free=*/true);
  return {R, padded_starts->contiguous(), alignment};
}

// The token groups of a "cols" quantization with blocks of `block` rows: checks offs (padded: padded_starts with an
// alignment that is a multiple of the block), fills a's jagged fields; the returned tensors back a's pointers; q_rows is
// M or the padded rows. The unpadded form's own rules (group sizes or starts) are the recipe's to check.
struct JaggedCols {
  int64_t q_rows;
  at::Tensor offs;
  at::Tensor padded_starts;
};

inline JaggedCols jagged_cols(ColsArgs& a, const at::Tensor& x, const std::optional<at::Tensor>& offs,
                              const std::optional<at::Tensor>& padded_starts, std::optional<int64_t> alignment,
                              int64_t block, const char* op) {
  const int64_t M = x.size(0);
  TORCH_CHECK(offs.has_value() || !padded_starts.has_value(), op, ": expected padded_starts only with offs");
  TORCH_CHECK(padded_starts.has_value() == alignment.has_value(), op,
              ": expected padded_starts and alignment together, got only ",
              padded_starts.has_value() ? "padded_starts" : "alignment");
  a.rows = M;
  JaggedCols j{M, at::Tensor(), at::Tensor()};
  if (!offs.has_value()) return j;
  check_offs(*offs, x, M, op);
  const int64_t G = offs->numel();
  TORCH_CHECK(G <= 65534, op, ": expected at most 65534 groups, got ", G);
  j.offs = offs->contiguous();
  a.jagged = true;
  a.offs = j.offs.data_ptr<int32_t>();
  a.num_segments = static_cast<int>(G);
  if (padded_starts.has_value()) {
    TORCH_CHECK(*alignment >= block && *alignment % block == 0, op, ": expected alignment to be a multiple of ",
                block, ", got ", *alignment);
    const JaggedLayout l = jagged_layout(x, *offs, padded_starts, *alignment, op);
    j.padded_starts = l.padded_starts;
    j.q_rows = l.q_rows;
    a.padded = true;
    a.padded_starts = j.padded_starts.data_ptr<int32_t>();
    a.alignment = l.alignment;
  }
  return j;
}

// Runs a 2-D transposing quantization set up by jagged_cols: x (M, K) reduced down its
// rows into q (q_rows, K) column-major, scales through `s`. Nothing runs for K = 0 or
// an empty x without groups (the outputs are already what they must be).
inline void run_jagged_cols(const QuantKernels& k, InputKind in, Fp8Format fmt, const QuantSpec& spec, ColsArgs& a,
                            const at::Tensor& x, const at::Tensor& q, int64_t q_rows, const ScaleOut& s) {
  const int64_t M = x.size(0), K = x.size(1);
  ColsOperand& o = a.op[0];
  o.x = x.data_ptr();
  o.sr = x.stride(0);
  o.sc = x.stride(1);
  o.cols = K;
  o.q = static_cast<uint8_t*>(q.data_ptr());
  o.q_sc = q_rows;
  o.scale = s;
  if (!a.jagged) a.num_segments = 1;
  if (K == 0 || (q_rows == 0 && !a.jagged)) return;
  // The launch plan sizes for the mean group.
  k.cols(in, fmt, spec, a, ceil_div(M, std::max<int64_t>(a.num_segments, 1)), x.device().index());
}

}  // namespace moe_fp8
