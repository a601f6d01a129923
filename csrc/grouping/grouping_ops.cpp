// Torch glue of the token-group family (DESIGN §8) for both devices: checks, output allocation and each op mapped onto
// the row-copy shape of grouping.h; the data movement is the device's runner table (grouping_ops.h), so no op knows
// its device. No op syncs with the host unless MOE_FP8_DEBUG=1 (or on the CPU, where it is free).
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "../core/op_checks.h"
#include "../quant/quant_glue.h"
#include "grouping_ops.h"

namespace moe_fp8 {
namespace {

// The rows of a 2-D tensor as byte rows: the inner dimension must be dense, so a
// tensor with a strided inner dimension is made contiguous first (a copy).
at::Tensor byte_rows(const at::Tensor& x, const char* op, const char* name) {
  check_rank(x, 2, op, name);
  if (x.size(1) <= 1 || x.stride(1) == 1) return x;
  return x.contiguous();
}

// An output of `rows` rows like x's: its size in bytes fits in int64.
void check_rows_alloc(int64_t rows, const at::Tensor& x, const char* op, const char* name) {
  check_alloc({rows, x.size(1)}, static_cast<int64_t>(x.element_size()), op, name);
}

RowCopy row_copy(const at::Tensor& src, const at::Tensor& dst) {
  const int64_t es = src.element_size();
  RowCopy c;
  c.src = static_cast<const uint8_t*>(src.data_ptr());
  c.src_rows = src.size(0);
  c.src_stride = src.stride(0) * es;
  c.dst = static_cast<uint8_t*>(dst.data_ptr());
  c.dst_rows = dst.size(0);
  c.dst_stride = dst.stride(0) * es;
  c.row_bytes = src.size(1) * es;
  return c;
}

void run_copy_rows(const GroupingKernels& k, const at::Tensor& src, const at::Tensor& dst, const RowMapArgs& m) {
  if (dst.numel() == 0 && !(m.kind == RowMapKind::kPad && m.compute_pstart)) return;
  k.copy_rows(row_copy(src, dst), m, src.device().index());
}

RowMapArgs group_map(RowMapKind kind, const at::Tensor& offs, const int32_t* pstart, int64_t tokens,
                     int64_t padded_rows) {
  RowMapArgs m;
  m.kind = kind;
  m.layout.offs = offs.data_ptr<int32_t>();
  m.layout.pstart = pstart;
  m.layout.groups = static_cast<int>(offs.numel());
  m.layout.rows = tokens;
  m.layout.padded_rows = padded_rows;
  return m;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> pad_token_groups(const GroupingKernels& k, const at::Tensor& x_in,
                                                                const at::Tensor& offs, int64_t alignment) {
  constexpr const char* op = "pad_token_groups";
  check_same_device(op, {"x", x_in}, {{"offs", offs}});
  check_rank(x_in, 2, op, "x");
  check_index_tensor(offs, x_in, op, "offs");
  check_alignment(alignment, op);
  const int64_t M = x_in.size(0), G = offs.numel();
  const int64_t R = checked_padded_rows(M, G, alignment, op);
  check_rows_alloc(R, x_in, op, "the padded output");
  check_offs(offs, x_in, M, op);
  const at::Tensor x = byte_rows(x_in, op, "x");
  const at::Tensor offs_c = offs.contiguous();
  at::Tensor xp = at::empty({R, x.size(1)}, x.options());
  at::Tensor pstart = at::empty({G}, offs.options());
  at::Tensor pend = at::empty({G}, offs.options());
  RowMapArgs m = group_map(RowMapKind::kPad, offs_c, nullptr, M, R);
  m.compute_pstart = true;
  m.alignment = alignment;
  m.pstart_out = pstart.data_ptr<int32_t>();
  m.pend_out = pend.data_ptr<int32_t>();
  if (G > 0 || R > 0) run_copy_rows(k, x, xp, m);
  return {xp, pstart, pend};
}

at::Tensor pad_token_groups_at(const GroupingKernels& k, const at::Tensor& x_in, const at::Tensor& offs,
                               const at::Tensor& padded_starts, int64_t num_padded_rows) {
  constexpr const char* op = "pad_token_groups_at";
  check_same_device(op, {"x", x_in}, {{"offs", offs}, {"padded_starts", padded_starts}});
  check_rank(x_in, 2, op, "x");
  check_index_tensor(offs, x_in, op, "offs");
  check_index_tensor(padded_starts, x_in, op, "padded_starts");
  check_size_arg(num_padded_rows, op, "num_padded_rows");
  check_rows_alloc(num_padded_rows, x_in, op, "the padded output");
  check_offs(offs, x_in, x_in.size(0), op);
  check_padded_starts(padded_starts, offs, x_in.size(0), num_padded_rows, x_in, op);
  const at::Tensor x = byte_rows(x_in, op, "x");
  const at::Tensor offs_c = offs.contiguous(), ps = padded_starts.contiguous();
  at::Tensor xp = at::empty({num_padded_rows, x.size(1)}, x.options());
  run_copy_rows(k, x, xp, group_map(RowMapKind::kPad, offs_c, ps.data_ptr<int32_t>(), x.size(0), num_padded_rows));
  return xp;
}

at::Tensor unpad_token_groups(const GroupingKernels& k, const at::Tensor& xp_in, const at::Tensor& offs,
                              const at::Tensor& padded_starts, int64_t num_tokens) {
  constexpr const char* op = "unpad_token_groups";
  check_same_device(op, {"x_padded", xp_in}, {{"offs", offs}, {"padded_starts", padded_starts}});
  check_rank(xp_in, 2, op, "x_padded");
  check_index_tensor(offs, xp_in, op, "offs");
  check_index_tensor(padded_starts, xp_in, op, "padded_starts");
  check_size_arg(num_tokens, op, "num_tokens");
  check_rows_alloc(num_tokens, xp_in, op, "the output");
  check_offs(offs, xp_in, num_tokens, op);
  check_padded_starts(padded_starts, offs, num_tokens, xp_in.size(0), xp_in, op);
  const at::Tensor xp = byte_rows(xp_in, op, "x_padded");
  const at::Tensor offs_c = offs.contiguous(), ps = padded_starts.contiguous();
  at::Tensor x = at::empty({num_tokens, xp.size(1)}, xp.options());
  run_copy_rows(k, xp, x, group_map(RowMapKind::kUnpad, offs_c, ps.data_ptr<int32_t>(), num_tokens, xp.size(0)));
  return x;
}

std::tuple<at::Tensor, at::Tensor> padded_group_offsets(const GroupingKernels& k, const at::Tensor& offs,
                                                        int64_t num_tokens, int64_t alignment) {
  constexpr const char* op = "padded_group_offsets";
  check_index_tensor(offs, offs, op, "offs");
  check_alignment(alignment, op);
  check_size_arg(num_tokens, op, "num_tokens");
  // The padded ends are int32: the static bound of the layout must fit (no sync).
  checked_padded_rows(num_tokens, offs.numel(), alignment, op);
  check_offs(offs, offs, num_tokens, op);
  const at::Tensor offs_c = offs.contiguous();
  const int G = static_cast<int>(offs.numel());
  at::Tensor pstart = at::empty({G}, offs.options());
  at::Tensor pend = at::empty({G}, offs.options());
  if (G > 0) {
    k.padded_offsets(offs_c.data_ptr<int32_t>(), G, num_tokens, alignment, pstart.data_ptr<int32_t>(),
                     pend.data_ptr<int32_t>(), offs.device().index());
  }
  return {pstart, pend};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_indices(const GroupingKernels& k, const at::Tensor& counts,
                                                               int64_t experts_per_rank, int64_t num_ranks,
                                                               int64_t alignment, int64_t max_len) {
  constexpr const char* op = "permute_indices";
  check_index_tensor(counts, counts, op, "tokens_per_expert_group");
  TORCH_CHECK(experts_per_rank >= 1 && num_ranks >= 1, op,
              ": expected experts_per_rank >= 1 and num_ranks >= 1, got ", experts_per_rank, " and ", num_ranks);
  const int64_t groups = checked_mul(experts_per_rank, num_ranks, op, "num_ranks * experts_per_rank");
  TORCH_CHECK(groups <= (1 << 20), op, ": expected num_ranks * experts_per_rank <= 2^20, got ", groups);
  check_alignment(alignment, op);
  check_size_arg(max_len, op, "max_len", kInt32Max);
  TORCH_CHECK(counts.numel() == groups, op, ": expected tokens_per_expert_group of shape (", groups,
              ",) = num_ranks * experts_per_rank, got (", counts.numel(), ",)");
  const at::Tensor c = counts.contiguous();
  if (check_content(counts)) {
    // The exact padded total, in int64: on the device the sizes and ends are int32
    // and saturate, so they cannot tell an overflow apart from a fit.
    const at::Tensor h = c.cpu();  // host-sync-ok: CPU or MOE_FP8_DEBUG only
    const int32_t* hc = h.data_ptr<int32_t>();
    for (int64_t i = 0; i < groups; ++i) {
      TORCH_CHECK(hc[i] >= 0, op, ": expected non-negative token counts, got ", hc[i], " at ", i);
    }
    int64_t need = 0;
    for (int64_t e = 0; e < experts_per_rank; ++e) {
      int64_t tokens = 0;
      for (int64_t r = 0; r < num_ranks; ++r) tokens += hc[r * experts_per_rank + e];
      need += expert_padded_size(tokens, alignment);
    }
    TORCH_CHECK(need <= max_len, op, ": expected max_len >= ", need,
                " (the padded rows of all experts; num_tokens + experts_per_rank * alignment always suffices), got ",
                max_len);
  }
  at::Tensor indices = at::empty({max_len}, counts.options());
  at::Tensor sizes = at::empty({experts_per_rank}, counts.options());
  at::Tensor ends = at::empty({experts_per_rank}, counts.options());
  PermuteArgs p;
  p.counts = c.data_ptr<int32_t>();
  p.experts = static_cast<int>(experts_per_rank);
  p.ranks = static_cast<int>(num_ranks);
  p.alignment = alignment;
  p.max_len = max_len;
  p.indices = indices.data_ptr<int32_t>();
  p.padded_sizes = sizes.data_ptr<int32_t>();
  p.padded_ends = ends.data_ptr<int32_t>();
  k.permute_indices(p, counts.device().index());
  return {indices, sizes, ends};
}

void zero_rows_past_groups_(const GroupingKernels& k, const at::Tensor& x, const at::Tensor& offs) {
  constexpr const char* op = "zero_rows_past_groups_";
  check_same_device(op, {"x", x}, {{"offs", offs}});
  check_rank(x, 2, op, "x");
  check_index_tensor(offs, x, op, "offs");
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, op, ": expected x with a unit stride along dim 1, got strides ",
              x.strides());
  check_writable(x, op, "x");
  check_offs(offs, x, x.size(0), op);
  if (x.numel() == 0) return;
  const at::Tensor offs_c = offs.contiguous();
  const int64_t es = x.element_size();
  k.zero_rows_past_groups(static_cast<uint8_t*>(x.data_ptr()), x.size(0), x.stride(0) * es, x.size(1) * es,
                          offs_c.data_ptr<int32_t>(), static_cast<int>(offs.numel()), x.device().index());
}

namespace {

// indices: int32 (n,), entries -1 (a padding slot) or in [0, rows); checked on the
// CPU or with MOE_FP8_DEBUG=1. `unique`: no row may appear twice.
void check_indices(const at::Tensor& indices, const at::Tensor& x, int64_t rows, bool unique, const char* op) {
  check_index_tensor(indices, x, op, "indices");
  if (!check_content(indices)) return;
  const at::Tensor h = indices.cpu().contiguous();  // host-sync-ok: CPU or MOE_FP8_DEBUG only
  std::vector<bool> seen(unique ? static_cast<size_t>(rows) : 0, false);
  for (int64_t j = 0; j < h.numel(); ++j) {
    const int32_t i = h.data_ptr<int32_t>()[j];
    TORCH_CHECK(i >= -1 && i < rows, op, ": expected indices in [-1, ", rows, "), got ", i, " at ", j);
    if (unique && i >= 0) {
      TORCH_CHECK(!seen[i], op, ": expected every row at most once in indices, got row ", i, " twice");
      seen[i] = true;
    }
  }
}

at::Tensor gather_rows_unchecked(const GroupingKernels& k, const at::Tensor& x, const at::Tensor& idx) {
  at::Tensor y = at::empty({idx.numel(), x.size(1)}, x.options());
  RowMapArgs m;
  m.kind = RowMapKind::kGather;
  m.indices = idx.data_ptr<int32_t>();
  run_copy_rows(k, x, y, m);
  return y;
}

}  // namespace

at::Tensor gather_rows(const GroupingKernels& k, const at::Tensor& x_in, const at::Tensor& indices) {
  constexpr const char* op = "gather_rows";
  check_same_device(op, {"x", x_in}, {{"indices", indices}});
  check_rank(x_in, 2, op, "x");
  check_index_tensor(indices, x_in, op, "indices");
  check_indices(indices, x_in, x_in.size(0), /*unique=*/false, op);
  return gather_rows_unchecked(k, byte_rows(x_in, op, "x"), indices.contiguous());
}

at::Tensor scatter_rows(const GroupingKernels& k, const at::Tensor& y_in, const at::Tensor& indices,
                        int64_t num_rows) {
  constexpr const char* op = "scatter_rows";
  check_same_device(op, {"y", y_in}, {{"indices", indices}});
  check_rank(y_in, 2, op, "y");
  check_index_tensor(indices, y_in, op, "indices");
  check_size_arg(num_rows, op, "num_rows", kInt32Max);
  check_size_arg(y_in.size(0), op, "the rows of y", kInt32Max);  // (slots of the inverse map are int32)
  TORCH_CHECK(indices.numel() == y_in.size(0), op, ": expected indices of shape (", y_in.size(0),
              ",) (a row of y each), got ", indices.sizes());
  check_rows_alloc(num_rows, y_in, op, "the output");
  check_indices(indices, y_in, num_rows, /*unique=*/true, op);
  const at::Tensor y = byte_rows(y_in, op, "y");
  const at::Tensor idx = indices.contiguous();
  // The inverse map (row -> slot, -1 when no slot holds it) turns the scatter into a
  // gather: every output row is written exactly once, so no zero fill pass.
  at::Tensor inverse = at::empty({num_rows}, indices.options());
  k.invert_indices(idx.data_ptr<int32_t>(), idx.numel(), inverse.data_ptr<int32_t>(), num_rows, y.device().index());
  return gather_rows_unchecked(k, y, inverse);
}

at::Tensor dequantize_rows(const GroupingKernels& k, const at::Tensor& q_in, const at::Tensor& scale_in, int64_t block,
                           at::ScalarType out_dtype) {
  constexpr const char* op = "dequantize_rows";
  check_same_device(op, {"q", q_in}, {{"scale", scale_in}});
  check_rank(q_in, 2, op, "q");
  check_rank(scale_in, 2, op, "scale");
  TORCH_CHECK(scale_in.scalar_type() == at::kFloat, op, ": expected scale of dtype float32, got ",
              scale_in.scalar_type());
  const at::ScalarType qt = q_in.scalar_type();
  TORCH_CHECK(qt == at::kFloat8_e4m3fn || qt == at::kFloat8_e4m3fnuz || qt == at::kFloat8_e5m2, op,
              ": expected q of dtype float8_e4m3fn, float8_e4m3fnuz or float8_e5m2, got ", qt);
  const Fp8Format fmt = fp8_format(qt, op);
  TORCH_CHECK(block >= 1, op, ": expected block in [1, ", INT64_MAX, "], got ", block);
  const int64_t rows = q_in.size(0), cols = q_in.size(1);
  const int64_t scale_cols = cols == 0 ? 0 : (cols - 1) / block + 1;
  TORCH_CHECK(scale_in.size(0) == rows && scale_in.size(1) == scale_cols, op, ": expected scale of shape (", rows,
              ", ", scale_cols, ") (a scale per row and block of ", block, " columns), got ", scale_in.sizes());
  InputKind out = InputKind::kBF16;
  switch (out_dtype) {
    case at::kBFloat16: out = InputKind::kBF16; break;
    case at::kHalf: out = InputKind::kFP16; break;
    case at::kFloat: out = InputKind::kFP32; break;
    default: TORCH_CHECK(false, op, ": expected out_dtype bfloat16, float16 or float32, got ", out_dtype);
  }
  const at::Tensor q = q_in.contiguous(), s = scale_in.contiguous();
  at::Tensor y = at::empty({rows, cols}, q.options().dtype(out_dtype));
  if (y.numel() == 0) return y;
  DequantRows a;
  a.q = static_cast<const uint8_t*>(q.data_ptr());
  a.scale = s.data_ptr<float>();
  a.y = y.data_ptr();
  a.rows = rows;
  a.cols = cols;
  a.block = block;
  a.scale_cols = scale_cols;
  a.fmt = fmt;
  a.out = out;
  k.dequantize_rows(a, q.device().index());
  return y;
}

namespace {

// scores: fp32 (rows,) on x's device, one a row of x.
void check_scores(const at::Tensor& scores, const at::Tensor& x, int64_t rows, const char* op) {
  TORCH_CHECK(scores.scalar_type() == at::kFloat, op, ": expected scores of dtype float32, got ",
              scores.scalar_type());
  check_rank(scores, 1, op, "scores");
  TORCH_CHECK(scores.size(0) == rows, op, ": expected scores of ", rows, " elements (one a row of x), got ",
              scores.size(0));
  check_same_device(op, {"x", x}, {{"scores", scores}});
}

at::Tensor sum_rows_scaled(const GroupingKernels& k, const at::Tensor& x_in, const at::Tensor* scores,
                           const at::Tensor& indices, const at::Tensor& offs, const char* op) {
  check_same_device(op, {"x", x_in}, {{"indices", indices}, {"offs", offs}});
  check_rank(x_in, 2, op, "x");
  const InputKind kind = input_kind(x_in, op, "x");
  check_index_tensor(indices, x_in, op, "indices");
  check_offs(offs, x_in, indices.size(0), op);
  check_indices(indices, x_in, x_in.size(0), /*unique=*/false, op);
  if (scores != nullptr) check_scores(*scores, x_in, x_in.size(0), op);
  check_rows_alloc(offs.size(0), x_in, op, "the output");
  const at::Tensor x = byte_rows(x_in, op, "x");
  const at::Tensor idx = indices.contiguous(), offs_c = offs.contiguous();
  const at::Tensor s = scores != nullptr ? scores->contiguous() : at::Tensor();
  at::Tensor y = at::empty({offs.size(0), x.size(1)}, x.options());
  if (y.numel() == 0) return y;
  SumRows a;
  a.x = x.data_ptr();
  a.scale = s.defined() ? s.data_ptr<float>() : nullptr;
  a.x_rows = x.size(0);
  a.x_stride = x.stride(0);
  a.indices = idx.data_ptr<int32_t>();
  a.num_indices = idx.numel();
  a.offs = offs_c.data_ptr<int32_t>();
  a.y = y.data_ptr();
  a.rows = y.size(0);
  a.cols = y.size(1);
  a.kind = kind;
  k.sum_rows(a, x.device().index());
  return y;
}

}  // namespace

at::Tensor sum_rows(const GroupingKernels& k, const at::Tensor& x, const at::Tensor& indices, const at::Tensor& offs) {
  return sum_rows_scaled(k, x, nullptr, indices, offs, "sum_rows");
}

at::Tensor combine_rows(const GroupingKernels& k, const at::Tensor& x, const at::Tensor& scores,
                        const at::Tensor& indices, const at::Tensor& offs) {
  return sum_rows_scaled(k, x, &scores, indices, offs, "combine_rows");
}

std::tuple<at::Tensor, at::Tensor> combine_rows_backward(const GroupingKernels& k, const at::Tensor& grad_in,
                                                         const at::Tensor& x_in, const at::Tensor& scores,
                                                         const at::Tensor& token) {
  constexpr const char* op = "combine_rows_backward";
  check_same_device(op, {"x", x_in}, {{"grad", grad_in}, {"token", token}});
  check_rank(grad_in, 2, op, "grad");
  check_rank(x_in, 2, op, "x");
  const InputKind kind = input_kind(x_in, op, "x");
  TORCH_CHECK(grad_in.scalar_type() == x_in.scalar_type() && grad_in.size(1) == x_in.size(1), op,
              ": expected grad of x's dtype and columns (", x_in.scalar_type(), ", ", x_in.size(1), "), got ",
              grad_in.scalar_type(), " with ", grad_in.size(1), " columns");
  check_scores(scores, x_in, x_in.size(0), op);
  check_index_tensor(token, x_in, op, "token");
  TORCH_CHECK(token.size(0) == x_in.size(0), op, ": expected token of ", x_in.size(0),
              " elements (one a row of x), got ", token.size(0));
  check_indices(token, x_in, grad_in.size(0), /*unique=*/false, op);
  const at::Tensor g = byte_rows(grad_in, op, "grad"), x = byte_rows(x_in, op, "x");
  const at::Tensor s = scores.contiguous(), t = token.contiguous();
  at::Tensor gx = at::empty(x.sizes(), x.options());
  at::Tensor gs = at::empty({x.size(0)}, s.options());
  if (x.size(0) == 0) return {gx, gs};
  CombineBackward a;
  a.grad = g.data_ptr();
  a.grad_rows = g.size(0);
  a.grad_stride = g.stride(0);
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.scale = s.data_ptr<float>();
  a.token = t.data_ptr<int32_t>();
  a.grad_x = gx.data_ptr();
  a.grad_scale = gs.data_ptr<float>();
  a.rows = x.size(0);
  a.cols = x.size(1);
  a.kind = kind;
  k.combine_rows_backward(a, x.device().index());
  return {gx, gs};
}

}  // namespace moe_fp8
