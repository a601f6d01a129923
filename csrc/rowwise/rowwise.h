// FP8 rowwise family (DESIGN §5): the plain-data descriptions of the two kernel
// shapes every op of the family reduces to, shared by the CPU loops and the GPU
// kernels, plus the runners' declarations. No torch, no CUDA headers.
//
//  * "rows": reduce along a dimension that is contiguous in memory (or any strides,
//    on the scalar path); q keeps the row-major layout of the reduction.
//  * "cols": reduce along a strided dimension, segment by segment (a whole batch, or
//    the token groups of `offs`), and write q transposed so that each reduction set
//    is contiguous in q (the column-major layouts the scaled GEMMs want).
#pragma once

#include <cstdint>

#include "../core/groups.h"
#include "../core/numerics.h"

namespace moe_fp8 {

// Row r of the reduction reads x + (r / rows_inner) * stride_outer
// + (r % rows_inner) * stride_inner + k * stride_col for k < cols; q is [rows, cols]
// row-major, scale is [rows].
struct RowsArgs {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t rows_inner = 1;
  int64_t stride_outer = 0;
  int64_t stride_inner = 0;
  int64_t stride_col = 1;
  bool pow2 = true;
};

// One operand of a "cols" launch. Element (b, r, c) of x is at
// x + b*sb + r*sr + c*sc (elements); its fp8 code goes to q + b*q_sb + c*q_sc + r
// (bytes, so every reduction set is contiguous in q); the decode scale of
// (segment s, column c) goes to scale + s*scale_ss + c.
struct ColsOperand {
  const void* x = nullptr;
  int64_t sb = 0, sr = 0, sc = 1;
  int64_t cols = 0;
  uint8_t* q = nullptr;
  int64_t q_sb = 0, q_sc = 0;
  float* scale = nullptr;
  int64_t scale_ss = 0;
};

// Segments: unless `jagged`, segment s is batch s, rows [0, rows). When jagged
// (int32, cumulative group ends), segment g is rows [offs[g-1], offs[g]) of batch 0,
// clamped into [0, rows) so that no offs content can index out of bounds, and a
// tail segment num_segments covers the q rows past the last group: its q is
// zero-filled and it has no scale.
//
// Padded (jagged only, `padded_starts` set): q has `q_rows` rows and group g is
// written at q rows [padded_starts[g], padded_starts[g] + round_up(n_g, alignment)),
// its rows past n_g zero rows encoded with the group's scales (0, or NaN in a NaN
// column): pad_token_groups's layout (DESIGN §8) quantized, produced from
// the unpadded input. Otherwise q rows are the input rows (q_rows == rows).
struct ColsArgs {
  ColsOperand op[2];
  int num_ops = 1;
  int64_t rows = 0;
  bool jagged = false;
  const int32_t* offs = nullptr;  // may be null when num_segments == 0
  int num_segments = 0;
  bool pow2 = true;
  const int32_t* padded_starts = nullptr;
  int64_t alignment = 1;
  int64_t q_rows = 0;
};

// Input rows [start, end) of one batch, written to q rows [q_start, q_start + q_len);
// q rows past the input rows (q_len > end - start) are zero.
struct Segment {
  int64_t batch;
  int64_t start;
  int64_t end;
  int64_t q_start;
  int64_t q_len;
  bool zero_fill;
};

MOE_FP8_HD int segments_with_tail(const ColsArgs& a) {
  return a.num_segments + (a.jagged ? 1 : 0);
}

MOE_FP8_HD Segment resolve_segment(const ColsArgs& a, int seg) {
  if (!a.jagged) return {seg, 0, a.rows, 0, a.rows, false};
  const bool tail = seg == a.num_segments;
  if (a.padded_starts == nullptr) {
    int64_t start = 0, end = a.rows;
    if (!tail) group_range(a.offs, seg, a.rows, &start, &end);
    else if (seg > 0) start = clamp_offset(a.offs[seg - 1], a.rows);
    return {0, start, tail ? start : end, start, end - start, tail};
  }
  // Padded: q positions come from padded_starts, clamped into [0, q_rows).
  if (tail) {
    int64_t q_start = 0;
    if (seg > 0) {
      int64_t s, e;
      group_range(a.offs, seg - 1, a.rows, &s, &e);
      q_start = clamp_offset(static_cast<int64_t>(a.padded_starts[seg - 1]) + round_up(e - s, a.alignment), a.q_rows);
    }
    return {0, 0, 0, q_start, a.q_rows - q_start, true};
  }
  int64_t start, end;
  group_range(a.offs, seg, a.rows, &start, &end);
  const int64_t q_start = clamp_offset(a.padded_starts[seg], a.q_rows);
  const int64_t q_len = round_up(end - start, a.alignment);
  const int64_t q_fit = q_len < a.q_rows - q_start ? q_len : a.q_rows - q_start;
  return {0, start, start + (end - start < q_fit ? end - start : q_fit), q_start, q_fit, false};
}

void run_rows_cpu(InputKind in, Fp8Format fmt, const void* x, uint8_t* q, float* scale,
                  const RowsArgs& a);
void run_cols_cpu(InputKind in, Fp8Format fmt, const ColsArgs& a);

#ifdef MOE_FP8_WITH_CUDA
void run_rows_cuda(InputKind in, Fp8Format fmt, const void* x, uint8_t* q, float* scale,
                   const RowsArgs& a, int device);
void run_cols_cuda(InputKind in, Fp8Format fmt, const ColsArgs& a, int64_t expected_segment_rows,
                   int device);
#endif

}  // namespace moe_fp8
