// Torch glue of the FP8 rowwise recipe for both devices: checks ("<op>: expected X, got Y"), allocation in DESIGN §5's
// layouts, and each op mapped onto the engine's "rows" or "cols" shape with the recipe's policies (fp32 scales, pow2
// or exact, whole sets, linear).
#include <ATen/ATen.h>

#include <tuple>

#include "../core/groups.h"
#include "../core/op_checks.h"
#include "../quant/quant_glue.h"
#include "rowwise_ops.h"

namespace moe_fp8 {
namespace {

QuantSpec rowwise_spec(bool pow2) {
  QuantSpec spec;
  spec.rule = pow2 ? ScaleRuleKind::kFp32Pow2 : ScaleRuleKind::kFp32Exact;
  return spec;
}

// Linear fp32 scales: (segment, set) at seg * seg_stride + set.
ScaleOut linear_scales(const at::Tensor& scale, int64_t seg_stride) {
  ScaleOut s;
  s.ptr = scale.data_ptr<float>();
  s.numel = scale.numel();
  s.seg_stride = seg_stride;
  s.set_stride = 1;
  return s;
}

void run_rows(const QuantKernels& k, const at::Tensor& x, at::ScalarType fp8_dtype, bool pow2, RowsArgs& a,
              const at::Tensor& q, const char* op, bool as_bf16 = false) {
  a.x = x.data_ptr();
  a.q = static_cast<uint8_t*>(q.data_ptr());
  k.rows(input_kind(x, op, "x", as_bf16), fp8_format(fp8_dtype, op), rowwise_spec(pow2), a, x.device().index());
}

void run_cols(const QuantKernels& k, const at::Tensor& x, at::ScalarType fp8_dtype, bool pow2, const ColsArgs& a,
              int64_t expected_segment_rows, const char* op, bool as_bf16 = false) {
  k.cols(input_kind(x, op, "x", as_bf16), fp8_format(fp8_dtype, op), rowwise_spec(pow2), a, expected_segment_rows,
         x.device().index());
}

ColsOperand cols_operand(const at::Tensor& x, int64_t sb, int64_t sr, int64_t sc, int64_t cols, const at::Tensor& q,
                         int64_t q_sb, int64_t q_sc, const at::Tensor& scale, int64_t scale_ss) {
  ColsOperand o;
  o.x = x.data_ptr();
  o.sb = sb;
  o.sr = sr;
  o.sc = sc;
  o.cols = cols;
  o.q = static_cast<uint8_t*>(q.data_ptr());
  o.q_sb = q_sb;
  o.q_sc = q_sc;
  o.scale = linear_scales(scale, scale_ss);
  return o;
}

// Expert weights b (E, ., .) reduced over dim `rdim` (1 or 2) into q (E, R, C), strides (q_E, 1, R) (each reduction
// run contiguous), and scale (E, 1, C), strides (s_E, ., 1); q_E, s_E exceed R * C, C for a slice of a concatenation
// along C. The "rows" shape where R is b's contiguous dimension, else "cols".
void quantize_per_expert_into(const QuantKernels& k, const at::Tensor& b, int rdim, at::ScalarType fp8_dtype,
                              bool pow2, const at::Tensor& q, const at::Tensor& scale, const char* op,
                              bool as_bf16 = false) {
  const int cdim = 3 - rdim;
  const int64_t E = b.size(0), R = b.size(rdim), C = b.size(cdim);
  const int64_t s_r = b.stride(rdim), s_c = b.stride(cdim);
  if (E == 0 || C == 0) return;
  const int64_t scale_extent = (E - 1) * scale.stride(0) + C;  // the view's last scale + 1
  if (s_r == 1 && R > 1) {
    RowsArgs a;
    a.rows = E * C;
    a.cols = R;
    a.rows_inner = C;
    a.stride_outer = b.stride(0);
    a.stride_inner = s_c;
    a.stride_col = 1;
    a.q_stride_outer = q.stride(0);
    a.scale = linear_scales(scale, scale.stride(0));
    a.scale.numel = scale_extent;
    run_rows(k, b, fp8_dtype, pow2, a, q, op, as_bf16);
    return;
  }
  TORCH_CHECK(E <= 65535, op, ": expected at most 65535 experts, got ", E);
  ColsArgs a;
  a.op[0] = cols_operand(b, b.stride(0), s_r, s_c, C, q, q.stride(0), R, scale, scale.stride(0));
  a.op[0].scale.numel = scale_extent;
  a.rows = R;
  a.num_segments = static_cast<int>(E);
  run_cols(k, b, fp8_dtype, pow2, a, R, op, as_bf16);
}

std::tuple<at::Tensor, at::Tensor> quantize_per_expert(const QuantKernels& k, const at::Tensor& b, int rdim,
                                                       at::ScalarType fp8_dtype, bool pow2, const char* op,
                                                       bool as_bf16 = false) {
  check_rank(b, 3, op, "b_t");
  input_kind(b, op, "b_t", as_bf16);
  fp8_format(fp8_dtype, op);
  const int64_t E = b.size(0), R = b.size(rdim), C = b.size(3 - rdim);
  at::Tensor q = at::empty_strided({E, R, C}, {R * C, 1, R}, b.options().dtype(fp8_dtype));
  at::Tensor scale = at::empty({E, 1, C}, b.options().dtype(at::kFloat));
  quantize_per_expert_into(k, b, rdim, fp8_dtype, pow2, q, scale, op, as_bf16);
  return {q, scale};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_rowwise(const QuantKernels& k, const at::Tensor& x,
                                                    at::ScalarType fp8_dtype, bool pow2_scale) {
  constexpr const char* op = "quantize_rowwise";
  check_rank(x, 2, op, "x");
  input_kind(x, op, "x");
  fp8_format(fp8_dtype, op);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(fp8_dtype));
  at::Tensor scale = at::empty({M, 1}, x.options().dtype(at::kFloat));
  if (M == 0) return {q, scale};
  if (x.stride(0) == 1 && x.stride(1) != 1 && K > 1 && M > 1) {
    // Column-major input: reduce along the strided dim and write q transposed.
    ColsArgs a;
    a.op[0] = cols_operand(x, 0, x.stride(1), 1, M, q, 0, K, scale, 0);
    a.rows = K;
    a.num_segments = 1;
    run_cols(k, x, fp8_dtype, pow2_scale, a, K, op);
    return {q, scale};
  }
  RowsArgs a;
  a.rows = M;
  a.cols = K;
  a.rows_inner = M;
  a.stride_outer = 0;
  a.stride_inner = x.stride(0);
  a.stride_col = x.stride(1);
  a.scale = linear_scales(scale, 0);
  run_rows(k, x, fp8_dtype, pow2_scale, a, q, op);
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor> quantize_experts_fwd(const QuantKernels& k, const at::Tensor& b_t,
                                                        at::ScalarType fp8_dtype, bool pow2_scale, bool as_bf16) {
  return quantize_per_expert(k, b_t, /*rdim=K*/ 1, fp8_dtype, pow2_scale, "quantize_experts_fwd", as_bf16);
}

namespace {

// The weights of a concatenation along N (b_ts non-empty): each (E, K, N_i) as the
// per-expert ops take it, all of one dtype, device, E and K. Returns the sum of N_i.
int64_t check_cat_weights(at::TensorList b_ts, const char* op) {
  const at::Tensor& b0 = b_ts[0];
  int64_t n_total = 0;
  for (size_t i = 0; i < b_ts.size(); ++i) {
    const at::Tensor& b = b_ts[i];
    check_rank(b, 3, op, "b_t");
    input_kind(b, op, "b_t");
    TORCH_CHECK(b.scalar_type() == b0.scalar_type() && b.device() == b0.device(), op,
                ": expected every weight of one dtype and device, got ", b0.scalar_type(), " on ", b0.device(),
                " and ", b.scalar_type(), " on ", b.device(), " (weight ", i, ")");
    TORCH_CHECK(b.size(0) == b0.size(0) && b.size(1) == b0.size(1), op,
                ": expected every weight of shape (E, K, N_i) with the E and K of the first, (", b0.size(0), ", ",
                b0.size(1), ", .), got (", b.size(0), ", ", b.size(1), ", ", b.size(2), ") (weight ", i, ")");
    n_total += b.size(2);
  }
  return n_total;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_experts_fwd_cat(const QuantKernels& k, at::TensorList b_ts,
                                                            at::ScalarType fp8_dtype, bool pow2_scale, bool as_bf16) {
  constexpr const char* op = "quantize_experts_fwd_cat";
  TORCH_CHECK(!b_ts.empty(), op, ": expected at least one weight, got none");
  fp8_format(fp8_dtype, op);
  const int64_t n_total = check_cat_weights(b_ts, op);
  input_kind(b_ts[0], op, "b_t", as_bf16);
  const at::Tensor& b0 = b_ts[0];
  const int64_t E = b0.size(0), K = b0.size(1);
  at::Tensor q = at::empty_strided({E, K, n_total}, {K * n_total, 1, K}, b0.options().dtype(fp8_dtype));
  at::Tensor scale = at::empty({E, 1, n_total}, b0.options().dtype(at::kFloat));
  int64_t n0 = 0;
  for (const at::Tensor& b : b_ts) {
    const int64_t n = b.size(2);
    quantize_per_expert_into(k, b, /*rdim=K*/ 1, fp8_dtype, pow2_scale, q.narrow(2, n0, n), scale.narrow(2, n0, n),
                             op, as_bf16);
    n0 += n;
  }
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor> quantize_experts_bwd_cat(const QuantKernels& k, at::TensorList b_ts,
                                                            at::ScalarType fp8_dtype, bool pow2_scale, bool as_bf16) {
  constexpr const char* op = "quantize_experts_bwd_cat";
  TORCH_CHECK(b_ts.size() == 1 || b_ts.size() == 2, op, ": expected one or two weights, got ", b_ts.size());
  fp8_format(fp8_dtype, op);
  const int64_t N = check_cat_weights(b_ts, op);
  input_kind(b_ts[0], op, "b_t", as_bf16);
  if (b_ts.size() == 1) return quantize_per_expert(k, b_ts[0], /*rdim=N*/ 2, fp8_dtype, pow2_scale, op, as_bf16);
  const at::Tensor &b0 = b_ts[0], &b1 = b_ts[1];
  const int64_t E = b0.size(0), K = b0.size(1), N0 = b0.size(2);
  // The reduction over N spans both weights: one "cols" launch whose rows from N0 on
  // come from the second (same strides, N strided). Other layouts reduce a copy.
  const bool same_strides = b0.stride(0) == b1.stride(0) && b0.stride(1) == b1.stride(1) &&
                            b0.stride(2) == b1.stride(2);
  if (!same_strides || b0.stride(2) == 1 || N0 == 0 || b1.size(2) == 0 || E > 65535) {
    return quantize_per_expert(k, at::cat({b0, b1}, 2), /*rdim=N*/ 2, fp8_dtype, pow2_scale, op, as_bf16);
  }
  at::Tensor q = at::empty_strided({E, N, K}, {N * K, 1, N}, b0.options().dtype(fp8_dtype));
  at::Tensor scale = at::empty({E, 1, K}, b0.options().dtype(at::kFloat));
  if (E == 0 || K == 0) return {q, scale};
  ColsArgs a;
  a.op[0] = cols_operand(b0, b0.stride(0), b0.stride(2), b0.stride(1), K, q, N * K, N, scale, K);
  a.op[0].x_hi = b1.data_ptr();
  a.op[0].row_split = N0;
  a.rows = N;
  a.num_segments = static_cast<int>(E);
  run_cols(k, b0, fp8_dtype, pow2_scale, a, N, op, as_bf16);
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_experts_dual_cat(const QuantKernels& k,
                                                                                    at::TensorList b_ts,
                                                                                    at::ScalarType fp8_dtype,
                                                                                    bool pow2_scale) {
  constexpr const char* op = "quantize_experts_dual_cat";
  TORCH_CHECK(b_ts.size() == 1 || b_ts.size() == 2, op, ": expected one or two weights, got ", b_ts.size());
  const Fp8Format fmt = fp8_format(fp8_dtype, op);
  const int64_t N = check_cat_weights(b_ts, op);
  const at::Tensor& b0 = b_ts[0];
  const int64_t E = b0.size(0), K = b0.size(1);
  // One read for both orientations where the device has the dual kernel and two
  // experts' [W1; W3] fit its L2 budget: each weight W_i (E, N_i, K) contiguous in K
  // (b_t = W_i^T), as a torchtitan weight is.
  if (k.dual != nullptr && E > 0 && K > 0 && 2 * N * K * b0.element_size() <= k.dual_budget(b0.get_device())) {
    DualArgs a;
    a.experts = E;
    a.rows = N;
    a.cols = K;
    a.row_split = b_ts[0].size(2);
    bool parts_ok = true;  // every part non-empty, K contiguous
    for (size_t i = 0; i < b_ts.size(); ++i) {
      parts_ok = parts_ok && b_ts[i].size(2) > 0 && b_ts[i].stride(1) == 1;
      a.x[i] = b_ts[i].data_ptr();
      a.x_se[i] = b_ts[i].stride(0);
      a.x_sr[i] = b_ts[i].stride(2);
    }
    if (parts_ok && dual_kernel_ok(a, b0.element_size())) {
      at::Tensor q_fwd = at::empty_strided({E, K, N}, {K * N, 1, K}, b0.options().dtype(fp8_dtype));
      at::Tensor s_fwd = at::empty({E, 1, N}, b0.options().dtype(at::kFloat));
      at::Tensor q_bwd = at::empty_strided({E, N, K}, {N * K, 1, N}, b0.options().dtype(fp8_dtype));
      at::Tensor s_bwd = at::empty({E, 1, K}, b0.options().dtype(at::kFloat));
      at::Tensor work = at::zeros({dual_work_words(E, N, K)}, b0.options().dtype(at::kInt));
      a.q_rows = static_cast<uint8_t*>(q_fwd.data_ptr());
      a.s_rows = s_fwd.data_ptr<float>();
      a.q_cols = static_cast<uint8_t*>(q_bwd.data_ptr());
      a.s_cols = s_bwd.data_ptr<float>();
      a.work = reinterpret_cast<uint32_t*>(work.data_ptr<int32_t>());
      k.dual(input_kind(b0, op, "b_t"), fmt, pow2_scale, a, b0.get_device());
      return {q_fwd, s_fwd, q_bwd, s_bwd};
    }
  }
  auto [q_fwd, s_fwd] = quantize_experts_fwd_cat(k, b_ts, fp8_dtype, pow2_scale, false);
  auto [q_bwd, s_bwd] = quantize_experts_bwd_cat(k, b_ts, fp8_dtype, pow2_scale, false);
  return {q_fwd, s_fwd, q_bwd, s_bwd};
}

std::tuple<at::Tensor, at::Tensor> quantize_experts_bwd(const QuantKernels& k, const at::Tensor& b_t,
                                                        at::ScalarType fp8_dtype, bool pow2_scale, bool as_bf16) {
  return quantize_per_expert(k, b_t, /*rdim=N*/ 2, fp8_dtype, pow2_scale, "quantize_experts_bwd", as_bf16);
}

namespace {

void check_jagged_input(const at::Tensor& x, const char* op, const char* name) {
  check_rank(x, 2, op, name);
  input_kind(x, op, name);
}

// q (q_rows, D) column-major, scale (G, D): one "cols" operand over the token groups.
std::tuple<at::Tensor, at::Tensor, ColsOperand> jagged_operand(const at::Tensor& x, at::ScalarType fp8_dtype,
                                                               int64_t G, int64_t q_rows) {
  const int64_t D = x.size(1);
  at::Tensor q = at::empty_strided({q_rows, D}, {1, q_rows}, x.options().dtype(fp8_dtype));
  at::Tensor scale = at::empty({G, D}, x.options().dtype(at::kFloat));
  return {q, scale, cols_operand(x, 0, x.stride(0), x.stride(1), D, q, 0, q_rows, scale, D)};
}

void run_jagged(const QuantKernels& k, const at::Tensor& x, const at::Tensor& offs, const JaggedLayout& l,
                at::ScalarType fp8_dtype, bool pow2, ColsArgs& a, const char* op) {
  const int64_t M = x.size(0), G = offs.numel();
  TORCH_CHECK(G <= 65534, op, ": expected at most 65534 groups, got ", G);
  a.rows = M;
  a.jagged = true;
  a.offs = offs.data_ptr<int32_t>();
  a.num_segments = static_cast<int>(G);
  a.q_rows = l.q_rows;
  // Padded is a flag of its own: an empty padded_starts (G = 0) has no data pointer.
  if (l.padded_starts.defined()) {
    a.padded = true;
    a.padded_starts = l.padded_starts.data_ptr<int32_t>();
    a.alignment = l.alignment;
  }
  // The cluster/cache plan sizes for a group an eighth above the mean; larger
  // groups stay correct and re-read what does not fit.
  const int64_t expected = G > 0 ? ceil_div(M, G) + ceil_div(M, 8 * G) : M;
  run_cols(k, x, fp8_dtype, pow2, a, expected, op);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_jagged_colwise(const QuantKernels& k, const at::Tensor& x,
                                                           const at::Tensor& offs, at::ScalarType fp8_dtype,
                                                           bool pow2_scale,
                                                           const std::optional<at::Tensor>& padded_starts,
                                                           int64_t alignment) {
  constexpr const char* op = "quantize_jagged_colwise";
  check_jagged_input(x, op, "x");
  fp8_format(fp8_dtype, op);
  check_offs(offs, x, x.size(0), op);
  const JaggedLayout l = jagged_layout(x, offs, padded_starts, alignment, op);
  const at::Tensor offs_c = offs.contiguous();
  auto [q, scale, operand] = jagged_operand(x, fp8_dtype, offs.numel(), l.q_rows);
  ColsArgs a;
  a.op[0] = operand;
  if (x.size(1) > 0) run_jagged(k, x, offs_c, l, fp8_dtype, pow2_scale, a, op);
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_jagged_colwise_dual(
    const QuantKernels& k, const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& offs,
    at::ScalarType fp8_dtype, bool pow2_scale, const std::optional<at::Tensor>& padded_starts, int64_t alignment) {
  constexpr const char* op = "quantize_jagged_colwise_dual";
  check_jagged_input(x1, op, "x1");
  check_jagged_input(x2, op, "x2");
  fp8_format(fp8_dtype, op);
  TORCH_CHECK(x1.scalar_type() == x2.scalar_type(), op, ": expected x1 and x2 of one dtype, got ",
              x1.scalar_type(), " and ", x2.scalar_type());
  TORCH_CHECK(x1.size(0) == x2.size(0), op, ": expected x1 and x2 with the same number of rows, got ", x1.size(0),
              " and ", x2.size(0));
  TORCH_CHECK(x1.device() == x2.device(), op, ": expected x1 and x2 on one device, got ", x1.device(), " and ",
              x2.device());
  check_offs(offs, x1, x1.size(0), op);
  const JaggedLayout l = jagged_layout(x1, offs, padded_starts, alignment, op);
  const at::Tensor offs_c = offs.contiguous();
  auto [q1, s1, op1] = jagged_operand(x1, fp8_dtype, offs.numel(), l.q_rows);
  auto [q2, s2, op2] = jagged_operand(x2, fp8_dtype, offs.numel(), l.q_rows);
  ColsArgs a;
  a.op[0] = op1;
  a.op[1] = op2;
  a.num_ops = 2;
  if (x1.size(1) == 0) {  // an operand with no columns drops out of the launch
    a.op[0] = op2;
    a.num_ops = 1;
  } else if (x2.size(1) == 0) {
    a.num_ops = 1;
  }
  if (a.op[0].cols > 0) run_jagged(k, x1, offs_c, l, fp8_dtype, pow2_scale, a, op);
  return {q1, s1, q2, s2};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_rowwise_jagged_dual(
    const QuantKernels& k, const at::Tensor& x, const at::Tensor& offs, at::ScalarType fp8_dtype, bool pow2_scale,
    const std::optional<at::Tensor>& padded_starts, int64_t alignment) {
  constexpr const char* op = "quantize_rowwise_jagged_dual";
  check_jagged_input(x, op, "x");
  (void)fp8_format(fp8_dtype, op);
  check_offs(offs, x, x.size(0), op);
  (void)jagged_layout(x, offs, padded_starts, alignment, op);
  // The two ops: a one-read kernel was slower (docs/decisions/029).
  auto [q_rows, s_rows] = quantize_rowwise(k, x, fp8_dtype, pow2_scale);
  auto [q_cols, s_cols] = quantize_jagged_colwise(k, x, offs, fp8_dtype, pow2_scale, padded_starts, alignment);
  return {q_rows, s_rows, q_cols, s_cols};
}

}  // namespace moe_fp8
