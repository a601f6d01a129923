// Plain-data interface of the quantization engine (DESIGN §2): CPU twin, GPU kernels, torch glue; no torch/CUDA headers.
// "rows" reduce along a contiguous dimension (any strides on the scalar path), q row-major; "cols" reduce along a strided
// one per segment (batch or token group), q transposed so each set is contiguous. Both run over policies.h's policies.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "../core/dispatch.h"
#include "../core/groups.h"
#include "../core/numerics.h"
#include "policies.h"

namespace moe_fp8 {

// Row r = (o, i) = (r / rows_inner, r % rows_inner) reads x + o*stride_outer + i*stride_inner + k*stride_col, k < cols;
// codes at q + rows_q_offset (q_stride_outer 0: q is [rows, cols] row-major), scale at (segment o, set i, block j). M-group
// blocked: offs, group_starts (null up to kRowsLocalGroups groups) place rows; all the buffer, padding too, is written.
constexpr int kRowsLocalGroups = 1024;

struct RowsArgs {
  const void* x = nullptr;
  uint8_t* q = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t rows_inner = 1;
  int64_t stride_outer = 0;
  int64_t stride_inner = 0;
  int64_t stride_col = 1;
  int64_t q_stride_outer = 0;
  ScaleOut scale;
  const int32_t* offs = nullptr;
  const int32_t* group_starts = nullptr;
  int groups = 0;
};

// Byte offset in q of the codes of the row at (segment `outer`, row `inner`).
MOE_FP8_HD int64_t rows_q_offset(const RowsArgs& a, int64_t outer, int64_t inner) {
  return outer * (a.q_stride_outer != 0 ? a.q_stride_outer : a.rows_inner * a.cols) + inner * a.cols;
}

// One "cols" operand: x(b, r, c) at x + b*sb + r*sr + c*sc (elements), its code at q + b*q_sb + c*q_sc + r (bytes: each
// set contiguous), scale at (segment, column c, block j). x_hi: rows r >= row_split read x_hi at r - row_split, same
// strides (two weights concatenated along the reduced dimension, reduced together without a copy).
struct ColsOperand {
  const void* x = nullptr;
  const void* x_hi = nullptr;
  int64_t row_split = 0;
  int64_t sb = 0, sr = 0, sc = 1;
  int64_t cols = 0;
  uint8_t* q = nullptr;
  int64_t q_sb = 0, q_sc = 0;
  ScaleOut scale;
};

// Segments: batch s, rows [0, rows), unless jagged: group g is rows [offs[g-1], offs[g]) of batch 0, clamped into
// [0, rows) whatever offs holds, plus a tail segment (num_segments) of the q rows past the last group: zero-filled, no
// scale. Blocks (block > 0) start at each segment's first q row.
struct ColsArgs {
  ColsOperand op[2];
  int num_ops = 1;
  int64_t rows = 0;
  bool jagged = false;  // offs: int32 cumulative group ends
  const int32_t* offs = nullptr;  // may be null when num_segments == 0
  int num_segments = 0;
  bool padded = false;  // jagged only: group g at q rows [padded_starts[g], + round_up(n_g, alignment)), DESIGN §8
  const int32_t* padded_starts = nullptr;  // may be null when num_segments == 0
  int64_t alignment = 1;
  int64_t q_rows = 0;  // == rows unless padded; pad rows are zeros at the group's scales (NaN in a NaN column)
  const int32_t* group_starts = nullptr;  // K-group blocked: q-row starts (4-block multiples); null: blocked_group_start
  // Linear block scales: the tail segment's blocks get zero scales (the op then need
  // not zero the buffer: unpadded groups of whole blocks leave no other gap).
  bool tail_scales = false;
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

// The padded layout of a padded jagged launch (core/groups.h: one definition for the
// quantizations and the token-group family).
MOE_FP8_HD GroupLayout padded_layout(const ColsArgs& a) {
  return GroupLayout{a.offs, a.padded_starts, a.num_segments, a.rows, a.q_rows};
}

MOE_FP8_HD int segments_with_tail(const ColsArgs& a) {
  return a.num_segments + (a.jagged ? 1 : 0);
}

MOE_FP8_HD Segment resolve_segment(const ColsArgs& a, int seg) {
  if (!a.jagged) return {seg, 0, a.rows, 0, a.rows, false};
  const bool tail = seg == a.num_segments;
  if (!a.padded) {
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
  int64_t start, end, q_start, q_fit;
  group_range(a.offs, seg, a.rows, &start, &end);
  padded_group_rows(padded_layout(a), seg, a.alignment, &q_start, &q_fit);
  return {0, start, start + (end - start < q_fit ? end - start : q_fit), q_start, q_fit, false};
}

// The block-column (K groups) or row (M groups) start of segment g's blocked scales.
MOE_FP8_HD int64_t cols_group_base(const ColsArgs& a, const ScaleOut& s, int g) {
  if (s.groups == BlockedGroups::kNone) return 0;
  if (a.group_starts != nullptr) return a.group_starts[g] / s.block;
  return blocked_group_start(s, a.offs, g, a.rows);
}

// Row shift of a "rows" launch's scales for row `set` of a segment: with M-group blocked scales, the group's blocked
// start row minus its first token row, else 0; -1 when the row has no place in the layout (past the groups).
template <class Layout>
MOE_FP8_HD int64_t rows_scale_row_base(const RowsArgs& a, int64_t set) {
  if (!Layout::kBlocked || a.scale.groups != BlockedGroups::kMGroups) return 0;
  const int g = group_of_row(a.offs, a.groups, a.rows_inner, set);
  if (g >= a.groups) return -1;
  const int64_t start = g == 0 ? 0 : clamp_offset(a.offs[g - 1], a.rows_inner);
  return (a.group_starts != nullptr ? static_cast<int64_t>(a.group_starts[g])
                                    : blocked_group_start(a.scale, a.offs, g, a.rows_inner)) - start;
}

// Index of the scale of block j of the row at (seg, set) in a.scale, or -1 (no place).
template <class Layout>
MOE_FP8_HD int64_t rows_scale_index(const RowsArgs& a, int64_t seg, int64_t set, int64_t j) {
  const int64_t row_base = rows_scale_row_base<Layout>(a, set);
  return row_base < 0 ? -1 : Layout::index(a.scale, seg, set, j, row_base, 0);
}

// The block-column base of a segment of a "cols" launch: the group's start in a
// K-group blocked layout; in a linear layout with blocks over token groups, the
// group's first q row in blocks (groups start block-aligned).
template <class Layout>
MOE_FP8_HD int64_t cols_scale_col_base(const ColsArgs& a, const ScaleOut& s, int seg_id, const Segment& seg,
                                       int block) {
  if (Layout::kBlocked) return cols_group_base(a, s, seg_id);
  return (a.jagged && block > 0) ? seg.q_start / block : 0;
}

// "tiles" shape (FP8 blockwise weights, DESIGN §6): a scale per 128x128 tile of x(b, r, c) = x + b*sb + r*sr + c*sc, a
// partial tile's amax over its valid part. Output k: element (r, c) of tile (b, i, j) at q + b*q_sb + i*q_si + j*q_sj +
// r*q_sr + c*q_sc (r, c < 128), its scale at s + b*s_sb + i*s_si + j*s_sj. A tile and its transpose share the scale.
constexpr int kTile = 128;

struct TileOut {
  uint8_t* q = nullptr;
  int64_t q_sb = 0, q_si = 0, q_sj = 0, q_sr = 0, q_sc = 0;
  void* s = nullptr;
  int64_t s_sb = 0, s_si = 0, s_sj = 0;
};

struct TilesArgs {
  const void* x = nullptr;
  int64_t batches = 0, rows = 0, cols = 0;
  int64_t sb = 0, sr = 0, sc = 1;
  TileOut out[2];
  int num_out = 1;
};

// "activation dual" (FP8 blockwise activations, DESIGN §6): from one read of token-grouped x (rows x cols), 1x128 row
// blocks (q_rows, scale (r, j) at s_rows[j * rows + r]) and padded 128x1 group blocks (q_cols column-major, DESIGN §8,
// scale (b, c) at s_cols[b * cols + c]), bit-exact with act_lhs + padded act_rhs; every s_cols entry is written.
struct ActDualArgs {
  const void* x = nullptr;
  int64_t rows = 0, cols = 0, sr = 0;
  const int32_t* offs = nullptr;
  const int32_t* padded_starts = nullptr;
  int groups = 0;
  int64_t alignment = 128;
  int64_t q_rows_total = 0;  // rows of the padded layout, a multiple of 128
  uint8_t* q_rows = nullptr;
  void* s_rows = nullptr;
  uint8_t* q_cols = nullptr;
  void* s_cols = nullptr;
};

// 128-row block qb of the padded layout. kEncode: q_cols rows [q0, q0 + q_len) from input rows [in0, in0 + in_rows), the
// rest zero rows at the block's scales; kZero: zeros (past the last group; block t takes the t-th 128 rows past offs[G-1]).
// Those input rows also get their 1x128 blocks. Any offs / padded_starts content keeps rows and q rows in bounds.
enum class ActDualCols : int { kNone = 0, kEncode = 1, kZero = 2 };
struct ActDualBlock {
  int64_t in0 = 0;
  int in_rows = 0;
  ActDualCols cols = ActDualCols::kNone;
  int64_t q0 = 0;
  int q_len = 0;
};

MOE_FP8_HD ActDualBlock act_dual_block(const ActDualArgs& a, int64_t qb) {
  constexpr int64_t kB = 128;
  ActDualBlock b;
  b.q0 = qb * kB;
  const int64_t q_room = a.q_rows_total - b.q0 < kB ? a.q_rows_total - b.q0 : kB;
  const GroupLayout l{a.offs, a.padded_starts, a.groups, a.rows, a.q_rows_total};
  int64_t start = 0, end = 0, q_start = 0, q_len = 0;
  if (a.groups > 0) {
    group_range(a.offs, a.groups - 1, a.rows, &start, &end);
    padded_group_rows(l, a.groups - 1, a.alignment, &q_start, &q_len);
  }
  const int64_t tail_q = q_start + q_len;  // 0 without groups
  if (b.q0 >= tail_q) {
    b.cols = ActDualCols::kZero;
    b.q_len = static_cast<int>(q_room);
    b.in0 = end + (b.q0 - tail_q) / kB * kB;
    const int64_t n = a.rows - b.in0;
    b.in_rows = static_cast<int>(n < 0 ? 0 : (n > kB ? kB : n));
    return b;
  }
  const int g = last_at_most(a.padded_starts, a.groups, b.q0);
  if (g < 0) return b;  // before the first group (a gap)
  group_range(a.offs, g, a.rows, &start, &end);
  padded_group_rows(l, g, a.alignment, &q_start, &q_len);
  if (b.q0 < q_start || b.q0 >= q_start + q_len) return b;  // between two groups (a gap)
  b.cols = ActDualCols::kEncode;
  b.q_len = static_cast<int>(q_start + q_len - b.q0 < q_room ? q_start + q_len - b.q0 : q_room);
  b.in0 = start + (b.q0 - q_start);
  const int64_t n = end - b.in0;
  b.in_rows = static_cast<int>(n < 0 ? 0 : (n > b.q_len ? b.q_len : n));
  return b;
}

// Whether the one-read kernel takes these arguments: 2-byte input with contiguous
// columns, 16-byte aligned rows, whole 8-column chunks, the grid's column count.
inline bool act_dual_vector_ok(const ActDualArgs& a, int64_t element_size) {
  return element_size == 2 && a.cols % 8 == 0 && a.sr % 8 == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
         a.q_rows_total % 128 == 0 && a.alignment % 128 == 0 && a.q_rows_total / 128 * ((a.cols + 127) / 128) < (int64_t{1} << 31);
}

// The "dual" shape (FP8 rowwise weights, DESIGN §5): for each expert's matrix X
// (rows x cols, columns contiguous), X quantized with one scale per row and X^T with
// one scale per column, from one DRAM read (quant/specialized/dual_kernel.cuh).
struct DualArgs {
  // Rows [0, row_split) of expert e are x[0] + e * x_se[0] + r * x_sr[0]; rows from
  // row_split on come from x[1] (row r - row_split). Columns are contiguous.
  const void* x[2] = {nullptr, nullptr};
  int64_t x_se[2] = {0, 0};
  int64_t x_sr[2] = {0, 0};
  int64_t row_split = 0;
  int64_t experts = 0, rows = 0, cols = 0;
  uint8_t* q_rows = nullptr;  // (E, rows, cols) row-major
  float* s_rows = nullptr;    // (E, rows)
  uint8_t* q_cols = nullptr;  // (E, cols, rows) row-major
  float* s_cols = nullptr;    // (E, cols)
  // Zeroed by the caller (dual_work_words): amax bits of the rows (E * rows) and
  // columns (E * cols), first-pass tiles done per expert (E), the ticket counter (1).
  uint32_t* work = nullptr;
  int64_t lag = 1;  // experts between a tile's two passes (dual_kernel.cuh), 1..E
};

inline int64_t dual_work_words(int64_t experts, int64_t rows, int64_t cols) {
  return experts * (rows + cols) + experts + 1;
}

// Whether the kernel takes these sizes: 2-byte inputs, columns contiguous with rows
// and experts 16-byte aligned, rows and columns multiples of 16 (whole 16-byte output
// chunks). The caller checks the L2 budget.
inline bool dual_kernel_ok(const DualArgs& a, int elem_size) {
  if (elem_size != 2 || a.experts <= 0 || a.rows <= 0 || a.cols <= 0) return false;
  if (a.rows % 16 != 0 || a.cols % 16 != 0) return false;
  const int parts = a.row_split < a.rows ? 2 : 1;
  for (int p = 0; p < parts; ++p) {
    if (a.x[p] == nullptr || reinterpret_cast<uintptr_t>(a.x[p]) % 16 != 0) return false;
    if (a.x_se[p] % 8 != 0 || a.x_sr[p] % 8 != 0) return false;
  }
  return true;
}

// Which policies a launch uses, as runtime values; each recipe's .cu and CPU file map
// the combinations it instantiates (dispatch_quant below) and reject the rest.
struct QuantSpec {
  ScaleRuleKind rule = ScaleRuleKind::kFp32Pow2;
  int block = kWholeSet;
  ScaleLayoutKind layout = ScaleLayoutKind::kLinear;
};

// One device's runners of the engine for one recipe (a table per recipe and device:
// the CPU file and the .cu each define theirs; the torch glue calls through it, so no
// op branches on the device). `device` is the GPU index (unused on the CPU).
struct QuantKernels {
  void (*rows)(InputKind in, Fp8Format fmt, const QuantSpec& spec, const RowsArgs& a, int device);
  void (*cols)(InputKind in, Fp8Format fmt, const QuantSpec& spec, const ColsArgs& a, int64_t expected_segment_rows,
               int device);
  // The dual shape, where a device has it (nullptr elsewhere: the two launches above).
  // dual_budget: the bytes of input one dual launch may keep in L2 (an expert is taken
  // when two fit); dual: one launch over a zeroed a.work (dual_work_words).
  int64_t (*dual_budget)(int device) = nullptr;
  void (*dual)(InputKind in, Fp8Format fmt, bool pow2, const DualArgs& a, int device) = nullptr;
};

// One device's runner of the tiles shape for a recipe's scale rules (blockwise: the
// weights), beside its QuantKernels.
struct TileKernels {
  void (*tiles)(InputKind in, Fp8Format fmt, ScaleRuleKind rule, const TilesArgs& a, int device);
  // The activation dual shape where a device has it (nullptr elsewhere: the rows and
  // cols launches of the two ops); only for act_dual_vector_ok arguments.
  void (*act_dual)(InputKind in, Fp8Format fmt, ScaleRuleKind rule, const ActDualArgs& a, int device) = nullptr;
};

// ---- compile-time policy lists and their dispatch ------------------------------------

template <class... Rules>
struct RuleList {};
template <int... Blocks>
struct BlockList {};
template <class... Layouts>
struct LayoutList {};

template <class Rule>
constexpr ScaleRuleKind rule_kind() {
  if constexpr (std::is_same_v<Rule, Fp32Pow2>) return ScaleRuleKind::kFp32Pow2;
  else if constexpr (std::is_same_v<Rule, Fp32Exact>) return ScaleRuleKind::kFp32Exact;
  else if constexpr (std::is_same_v<Rule, E8m0Floor>) return ScaleRuleKind::kE8m0Floor;
  else return ScaleRuleKind::kE8m0Rceil;
}

template <class Layout>
constexpr ScaleLayoutKind layout_kind() {
  return Layout::kBlocked ? ScaleLayoutKind::kBlocked : ScaleLayoutKind::kLinear;
}

// Calls fn(Rule{}, std::integral_constant<int, Block>{}, Layout{}) for the combination
// `spec` names, if the lists hold it; returns whether one did.
template <class... Rules, int... Blocks, class... Layouts, class Fn>
bool dispatch_quant(RuleList<Rules...>, BlockList<Blocks...>, LayoutList<Layouts...>, const QuantSpec& spec, Fn&& fn) {
  bool done = false;
  auto with_layout = [&](auto rule, auto block) {
    ((void)(!done && layout_kind<Layouts>() == spec.layout && (fn(rule, block, Layouts{}), done = true)), ...);
  };
  auto with_block = [&](auto rule) {
    ((void)(!done && Blocks == spec.block && (with_layout(rule, std::integral_constant<int, Blocks>{}), true)), ...);
  };
  ((void)(!done && rule_kind<Rules>() == spec.rule && (with_block(Rules{}), true)), ...);
  return done;
}

// The runtime (input kind, fp8 format, QuantSpec) -> fn(InputConstant, Fp8Constant, Rule, integral_constant<int,
// Block>, Layout), over the combinations the lists hold and the rule supports (E8M0 rules: e4m3fn only; kFP32AsBF16
// where kAsBF16); returns whether one ran.
template <class Rules, class Blocks, class Layouts, bool kAsBF16 = false, class Fn>
bool dispatch_engine(InputKind in, Fp8Format fmt, const QuantSpec& spec, Fn&& fn) {
  bool ran = false;
  dispatch_input_fp8<kAsBF16>(in, fmt, [&](auto kin, auto kfmt) {
    constexpr Fp8Format F = decltype(kfmt)::value;  // a constant: nested lambdas see it uncaptured
    dispatch_quant(Rules{}, Blocks{}, Layouts{}, spec, [&](auto rule, auto block, auto layout) {
      if constexpr (decltype(rule)::supports(F)) {
        fn(kin, kfmt, rule, block, layout);
        ran = true;
      }
    });
  });
  return ran;
}

}  // namespace moe_fp8
