// Torch glue of the FP8 blockwise recipe for both devices: checks, allocation in DESIGN §6's layouts, each op mapped
// onto the engine. A size not a multiple of 128 gives a partial last block (amax over its valid part), never an error;
// grouped scales are allocated zeroed (rows past the last group, a padded layout's tail: no block, scale zero).
#include <ATen/ATen.h>

#include <tuple>

#include "../core/groups.h"
#include "../core/op_checks.h"
#include "../quant/quant_glue.h"
#include "blockwise_ops.h"

namespace moe_fp8 {
namespace {

QuantSpec blockwise_spec() {
  QuantSpec spec;
  spec.rule = ScaleRuleKind::kFp32Exact;
  spec.block = kBwBlock;
  spec.layout = ScaleLayoutKind::kLinear;
  return spec;
}

ScaleOut linear_scales(const at::Tensor& s, int64_t set_stride, int64_t blk_stride) {
  ScaleOut o;
  o.ptr = s.data_ptr<float>();
  o.numel = s.numel();
  o.seg_stride = 0;
  o.set_stride = set_stride;
  o.blk_stride = blk_stride;
  return o;
}

// Unpadded token groups: blocks restart at each group's first row and its scale rows at first_row / 128, so every
// non-empty group starts at a multiple of 128 (the last may end anywhere). Checked on the CPU and with
// MOE_FP8_DEBUG=1 (a GPU clamps, never out of bounds).
void check_group_starts(const at::Tensor& offs, int64_t rows, const char* op) {
  if (!check_content(offs)) return;
  const at::Tensor host = offs.cpu().contiguous();  // host-sync-ok: CPU or MOE_FP8_DEBUG only
  const int32_t* o = host.data_ptr<int32_t>();
  for (int64_t g = 0; g < host.numel(); ++g) {
    int64_t s, e;
    group_range(o, static_cast<int>(g), rows, &s, &e);
    TORCH_CHECK(e == s || s % kBwBlock == 0, op, ": expected every non-empty token group to start at a multiple of ",
                kBwBlock, " rows (or padded_starts and alignment for any group sizes), got group ", g,
                " starting at row ", s);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_act_lhs(const QuantKernels& k, const at::Tensor& x,
                                                              at::ScalarType fp8_dtype) {
  constexpr const char* op = "quantize_blockwise_act_lhs";
  check_rank(x, 2, op, "x");
  const InputKind in = input_kind(x, op, "x");
  const Fp8Format fmt = fp8_format(fp8_dtype, op);
  const int64_t M = x.size(0), K = x.size(1), C = ceil_div(K, kBwBlock);
  at::Tensor q = at::empty({M, K}, x.options().dtype(fp8_dtype));
  // Column-major scales (strides (1, M)), as torch._scaled_mm reads a 1x128 operand.
  at::Tensor scale = at::empty_strided({M, C}, {1, std::max<int64_t>(M, 1)}, x.options().dtype(at::kFloat));
  if (M == 0 || K == 0) return {q, scale};
  RowsArgs a;
  a.x = x.data_ptr();
  a.q = static_cast<uint8_t*>(q.data_ptr());
  a.rows = M;
  a.cols = K;
  a.rows_inner = M;
  a.stride_inner = x.stride(0);
  a.stride_col = x.stride(1);
  a.scale = linear_scales(scale, /*set (row)*/ 1, /*block*/ M);
  k.rows(in, fmt, blockwise_spec(), a, x.device().index());
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_act_cols(const QuantKernels& k, const at::Tensor& x,
                                                               at::ScalarType fp8_dtype,
                                                               const std::optional<at::Tensor>& offs,
                                                               const std::optional<at::Tensor>& padded_starts,
                                                               std::optional<int64_t> alignment, bool transposed) {
  const char* op = transposed ? "quantize_blockwise_act_transposed_lhs" : "quantize_blockwise_act_rhs";
  check_rank(x, 2, op, "x");
  const InputKind in = input_kind(x, op, "x");
  const Fp8Format fmt = fp8_format(fp8_dtype, op);
  const int64_t M = x.size(0), K = x.size(1);
  ColsArgs a;
  const JaggedCols j = jagged_cols(a, x, offs, padded_starts, alignment, kBwBlock, op);
  const int64_t q_rows = j.q_rows;
  if (a.jagged && !a.padded) check_group_starts(*offs, M, op);
  a.q_rows = q_rows;
  const int64_t C = ceil_div(q_rows, kBwBlock), R1 = std::max<int64_t>(q_rows, 1), K1 = std::max<int64_t>(K, 1);
  const auto qopts = x.options().dtype(fp8_dtype);
  const auto sopts = x.options().dtype(at::kFloat);
  // act_rhs: q (R, K) column-major, scale (C, K) row-major; act_transposed_lhs: q (K, R)
  // row-major, scale (K, C) column-major. The same bytes: q[col k] at k * R, the scale
  // of (column k, block j) at j * K + k.
  at::Tensor q = transposed ? at::empty({K, q_rows}, qopts) : at::empty_strided({q_rows, K}, {1, R1}, qopts);
  at::Tensor scale;
  if (transposed) scale = a.jagged ? at::zeros({C, K}, sopts).t() : at::empty_strided({K, C}, {1, K1}, sopts);
  else scale = a.jagged ? at::zeros({C, K}, sopts) : at::empty({C, K}, sopts);
  run_jagged_cols(k, in, fmt, blockwise_spec(), a, x, q, q_rows, linear_scales(scale, /*set (column)*/ 1, /*block*/ K));
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_blockwise_act_dual(
    const QuantKernels& k, const TileKernels& tk, const at::Tensor& x, at::ScalarType fp8_dtype,
    const at::Tensor& offs, const std::optional<at::Tensor>& padded_starts, std::optional<int64_t> alignment) {
  constexpr const char* op = "quantize_blockwise_act_dual";
  check_rank(x, 2, op, "x");
  const InputKind in = input_kind(x, op, "x");
  const Fp8Format fmt = fp8_format(fp8_dtype, op);
  ColsArgs c;
  // (The padded layout is gap-free, jagged_layout: the kernel quantizes the rows past
  // the groups in the layout's tail, which gaps would leave too short.)
  const JaggedCols j = jagged_cols(c, x, offs, padded_starts, alignment, kBwBlock, op);
  if (!c.padded) check_group_starts(offs, x.size(0), op);
  const int64_t M = x.size(0), K = x.size(1);
  ActDualArgs a;
  a.x = x.data_ptr();
  a.rows = M;
  a.cols = K;
  a.sr = x.stride(0);
  a.offs = c.offs;
  a.padded_starts = c.padded_starts;
  a.groups = c.num_segments;
  a.alignment = c.alignment;
  a.q_rows_total = j.q_rows;
  if (tk.act_dual == nullptr || !c.padded || (K > 1 && x.stride(1) != 1) || !act_dual_vector_ok(a, x.element_size())) {
    auto [q_lhs, s_lhs] = quantize_blockwise_act_lhs(k, x, fp8_dtype);
    auto [q_rhs, s_rhs] = quantize_blockwise_act_cols(k, x, fp8_dtype, offs, padded_starts, alignment, false);
    return {q_lhs, s_lhs, q_rhs, s_rhs};
  }
  // The two ops' allocations (act_lhs, then act_rhs with token groups).
  const int64_t R = j.q_rows, C = ceil_div(K, kBwBlock);
  const auto qopts = x.options().dtype(fp8_dtype);
  const auto sopts = x.options().dtype(at::kFloat);
  at::Tensor q_lhs = at::empty({M, K}, qopts);
  at::Tensor s_lhs = at::empty_strided({M, C}, {1, std::max<int64_t>(M, 1)}, sopts);
  at::Tensor q_rhs = at::empty_strided({R, K}, {1, std::max<int64_t>(R, 1)}, qopts);
  at::Tensor s_rhs = at::empty({ceil_div(R, kBwBlock), K}, sopts);  // every entry written (zeros where a block has no group rows)
  a.q_rows = static_cast<uint8_t*>(q_lhs.data_ptr());
  a.s_rows = s_lhs.data_ptr();
  a.q_cols = static_cast<uint8_t*>(q_rhs.data_ptr());
  a.s_cols = s_rhs.data_ptr();
  tk.act_dual(in, fmt, ScaleRuleKind::kFp32Exact, a, x.device().index());
  return {q_lhs, s_lhs, q_rhs, s_rhs};
}

std::vector<at::Tensor> quantize_blockwise_weight_cat(const TileKernels& k, at::TensorList ws,
                                                      at::ScalarType fp8_dtype, int which, const char* op,
                                                      bool interleave, bool as_bf16) {
  TORCH_CHECK(!ws.empty(), op, ": expected at least one weight, got none");
  const at::Tensor& w0 = ws[0];
  const InputKind in = input_kind(w0, op, "w", as_bf16);
  TORCH_CHECK(w0.dim() == 2 || w0.dim() == 3, op, ": expected w to be 2-D (M, N) or 3-D (E, M, N), got ", w0.dim(),
              "-D");
  const Fp8Format fmt = fp8_format(fp8_dtype, op);
  const bool batched = w0.dim() == 3;
  const int64_t E = batched ? w0.size(0) : 1, M = w0.size(-2);
  // The parts, concatenated along N: each but the last a whole number of 128-column
  // tiles, so that no tile of the concatenation spans two parts and each part's tiles
  // are the concatenation's, bit for bit.
  int64_t N = 0;
  for (size_t p = 0; p < ws.size(); ++p) {
    const at::Tensor& w = ws[p];
    TORCH_CHECK(w.scalar_type() == w0.scalar_type() && w.device() == w0.device(), op,
                ": expected every weight of one dtype and device, got ", w0.scalar_type(), " on ", w0.device(),
                " and ", w.scalar_type(), " on ", w.device(), " (weight ", p, ")");
    TORCH_CHECK(w.dim() == w0.dim() && (!batched || w.size(0) == E) && w.size(-2) == M, op,
                ": expected every weight of the shape of the first but its last size, ", w0.sizes(), ", got ",
                w.sizes(), " (weight ", p, ")");
    TORCH_CHECK(p + 1 == ws.size() || w.size(-1) % kTile == 0, op,
                ": expected every weight but the last to have a multiple of ", kTile,
                " columns (whole 128x128 tiles of the concatenation), got ", w.size(-1), " (weight ", p, ")");
    // (Interleaved: of one width, so each a multiple of 128 by the rule above.)
    TORCH_CHECK(!interleave || w.size(-1) == w0.size(-1), op,
                ": expected every weight of one width to interleave them, got ", w0.size(-1), " and ", w.size(-1),
                " columns (weight ", p, ")");
    N += w.size(-1);
  }
  const int64_t TM = ceil_div(M, kTile), TN = ceil_div(N, kTile);
  const auto qopts = w0.options().dtype(fp8_dtype);
  const auto sopts = w0.options().dtype(at::kFloat);
  // Column-major per expert: q (M, N) strides (1, M), q^T (N, M) strides (1, N) (w's
  // row-major bytes); the scales (TM, TN) and (TN, TM) likewise.
  auto make = [&](int64_t rows, int64_t cols, const at::TensorOptions& o) {
    const int64_t r1 = std::max<int64_t>(rows, 1);
    return batched ? at::empty_strided({E, rows, cols}, {rows * cols, 1, r1}, o)
                   : at::empty_strided({rows, cols}, {1, r1}, o);
  };
  std::vector<at::Tensor> outs;
  if (which == 0 || which == 2) {
    outs.push_back(make(M, N, qopts));
    outs.push_back(make(TM, TN, sopts));
  }
  if (which == 1 || which == 2) {
    outs.push_back(make(N, M, qopts));
    outs.push_back(make(TN, TM, sopts));
  }
  if (E == 0 || M == 0 || N == 0) return outs;
  // One launch a weight: its tile column j at forward tile column j0 + j * step (interleaved by 128: j * P + p) and at
  // backward tile column c0 / 128 + j (the concatenation's order).
  const int64_t step = interleave ? int64_t(ws.size()) : 1;
  int64_t c0 = 0;  // the weight's first column of the concatenation (a multiple of 128)
  for (size_t p = 0; p < ws.size(); ++p) {
    const at::Tensor& w = ws[p];
    const int64_t n = w.size(-1), j_fwd = interleave ? int64_t(p) : c0 / kTile, j_bwd = c0 / kTile;
    c0 += n;
    if (n == 0) continue;
    TilesArgs a;
    a.x = w.data_ptr();
    a.batches = E;
    a.rows = M;
    a.cols = n;
    a.sb = batched ? w.stride(0) : 0;
    a.sr = w.stride(-2);
    a.sc = w.stride(-1);
    a.num_out = 0;
    size_t t = 0;
    if (which == 0 || which == 2) {  // element (r, c) at r + c * M of tile column j0 + j * step; tile (i, j) likewise
      TileOut& o = a.out[a.num_out++];
      o.q = static_cast<uint8_t*>(outs[t].data_ptr()) + j_fwd * kTile * M;
      o.q_sb = M * N;
      o.q_si = kTile;
      o.q_sj = step * kTile * M;
      o.q_sr = 1;
      o.q_sc = M;
      o.s = outs[t + 1].data_ptr<float>() + j_fwd * TM;
      o.s_sb = TM * TN;
      o.s_si = 1;
      o.s_sj = step * TM;
      t += 2;
    }
    if (which == 1 || which == 2) {  // element (r, c) is q^T[j0 * 128 + c, r]; tile (i, j) is s^T[j0 + j, i]
      TileOut& o = a.out[a.num_out++];
      o.q = static_cast<uint8_t*>(outs[t].data_ptr()) + j_bwd * kTile;
      o.q_sb = M * N;
      o.q_si = kTile * N;
      o.q_sj = kTile;
      o.q_sr = N;
      o.q_sc = 1;
      o.s = outs[t + 1].data_ptr<float>() + j_bwd;
      o.s_sb = TM * TN;
      o.s_si = TN;
      o.s_sj = 1;
    }
    k.tiles(in, fmt, ScaleRuleKind::kFp32Exact, a, w.device().index());
  }
  return outs;
}

std::vector<at::Tensor> quantize_blockwise_weight(const TileKernels& k, const at::Tensor& w, at::ScalarType fp8_dtype,
                                                  int which, bool as_bf16) {
  const char* op = which == 0   ? "quantize_blockwise_weight_rhs"
                   : which == 1 ? "quantize_blockwise_weight_transposed_rhs"
                                : "quantize_blockwise_weight_dual";
  return quantize_blockwise_weight_cat(k, {w}, fp8_dtype, which, op, false, as_bf16);
}

}  // namespace moe_fp8
