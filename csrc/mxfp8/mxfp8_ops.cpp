// Torch glue of the MXFP8 recipe for both devices: checks, allocation in DESIGN §7's layouts, each op mapped onto the
// engine (E8M0 FLOOR/RCEIL, blocks of 32 along the contraction, linear or blocked scales). Blocked padding must read
// as zero scales: a rows launch writes it (engine.h); a cols launch writes only real blocks, so its buffer is zeroed.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <tuple>

#include "../core/groups.h"
#include "../core/op_checks.h"
#include "../quant/quant_glue.h"
#include "mxfp8_ops.h"

namespace moe_fp8 {
namespace {

QuantSpec mx_spec(c10::string_view rounding, bool blocked, const char* op) {
  QuantSpec spec;
  if (rounding == "rceil") {
    spec.rule = ScaleRuleKind::kE8m0Rceil;
  } else if (rounding == "floor") {
    spec.rule = ScaleRuleKind::kE8m0Floor;
  } else {
    TORCH_CHECK(false, op, ": expected rounding \"rceil\" or \"floor\", got \"", std::string(rounding), "\"");
  }
  spec.block = kMxBlock;
  spec.layout = blocked ? ScaleLayoutKind::kBlocked : ScaleLayoutKind::kLinear;
  return spec;
}

void check_multiple_of_block(int64_t n, const char* op, const char* what) {
  TORCH_CHECK(n % kMxBlock == 0, op, ": expected ", what, " to be a multiple of ", kMxBlock, ", got ", n);
}

// E8M0 scales (stored as bytes): zeroed when some elements have no block (the padding
// of blocked layouts, gaps of padded token groups), uninitialized otherwise (every
// element is written).
at::Tensor e8m0_scales(at::IntArrayRef shape, const at::Tensor& like, bool zeroed) {
  const auto opts = like.options().dtype(at::kByte);
  at::Tensor s = zeroed ? at::zeros(shape, opts) : at::empty(shape, opts);
  return s.view(at::kFloat8_e8m0fnu);
}

ScaleOut linear_scales(const at::Tensor& s, int64_t seg_stride, int64_t set_stride) {
  ScaleOut o;
  o.ptr = s.data_ptr();
  o.numel = s.numel();
  o.seg_stride = seg_stride;
  o.set_stride = set_stride;
  o.blk_stride = 1;
  return o;
}

ScaleOut blocked_scales(const at::Tensor& s, int64_t seg_stride, int64_t padded_cols, BlockedGroups groups) {
  ScaleOut o;
  o.ptr = s.data_ptr();
  o.numel = s.numel();
  o.seg_stride = seg_stride;
  o.padded_cols = padded_cols;
  o.groups = groups;
  o.block = kMxBlock;
  return o;
}

// Each token group's start in a grouped blocked layout, in rows of `alignment`: the
// padded starts of the token-group family (through the dispatcher: no family includes
// another's headers), computed on the device of offs without a sync.
at::Tensor group_starts(const at::Tensor& offs, int64_t rows, int64_t alignment) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("moe_fp8::padded_group_offsets", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, c10::SymInt, int64_t)>();
  return std::get<0>(op.call(offs, c10::SymInt(rows), alignment));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_mxfp8_rowwise(const QuantKernels& k, const at::Tensor& x,
                                                          c10::string_view rounding, bool blocked,
                                                          const std::optional<at::Tensor>& offs) {
  constexpr const char* op = "quantize_mxfp8_rowwise";
  check_rank(x, 2, op, "x");
  const InputKind in = input_kind(x, op, "x");
  const QuantSpec spec = mx_spec(rounding, blocked, op);
  const int64_t M = x.size(0), K = x.size(1);
  check_multiple_of_block(K, op, "K (x.size(1))");
  TORCH_CHECK(!offs.has_value() || blocked, op,
              ": expected offs only with blocked=True (plain scales do not depend on the token groups), got offs "
              "with blocked=False");
  if (offs.has_value()) {
    // Checked before any allocation: the groups' scale rows start at the padded
    // offsets of 128 (int32, group_starts).
    check_offs(*offs, x, M, op);
    checked_padded_rows(M, offs->numel(), 128, op);
  }
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kFloat8_e4m3fn));
  const int64_t C = K / kMxBlock, Cp = round_up(C, 4);
  RowsArgs a;
  a.rows = M;
  a.cols = K;
  a.rows_inner = std::max<int64_t>(M, 1);
  a.stride_inner = x.stride(0);
  a.stride_col = x.stride(1);
  at::Tensor scale, starts, offs_c;
  if (!blocked) {
    scale = e8m0_scales({M, C}, x, false);
    a.scale = linear_scales(scale, 0, C);
  } else if (!offs.has_value()) {
    scale = e8m0_scales({round_up(M, 128), Cp}, x, M == 0 || K == 0);  // written whole by the launch below
    a.scale = blocked_scales(scale, 0, Cp, BlockedGroups::kNone);
  } else {
    const int64_t G = offs->numel();
    scale = e8m0_scales({M + 128 * G, Cp}, x, M == 0 || K == 0);
    a.scale = blocked_scales(scale, 0, Cp, BlockedGroups::kMGroups);
    offs_c = offs->contiguous();  // the kernels index offs[g]: a strided view is copied
    a.offs = offs_c.data_ptr<int32_t>();
    // Up to kRowsLocalGroups groups the kernel on the contiguous path sums the groups'
    // starts itself (engine.h); the others read the table (no per-row sums).
    if (G > kRowsLocalGroups || !x.is_contiguous()) {
      starts = group_starts(*offs, M, 128);
      a.group_starts = starts.data_ptr<int32_t>();
    }
    a.groups = static_cast<int>(G);
  }
  if (M == 0 || K == 0) return {q, scale};
  a.x = x.data_ptr();
  a.q = static_cast<uint8_t*>(q.data_ptr());
  k.rows(in, Fp8Format::kE4M3FN, spec, a, x.device().index());
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor> quantize_mxfp8_colwise(const QuantKernels& k, const at::Tensor& x,
                                                          c10::string_view rounding, bool blocked,
                                                          const std::optional<at::Tensor>& offs,
                                                          const std::optional<at::Tensor>& padded_starts,
                                                          std::optional<int64_t> alignment) {
  constexpr const char* op = "quantize_mxfp8_colwise";
  check_rank(x, 2, op, "x");
  const InputKind in = input_kind(x, op, "x");
  const QuantSpec spec = mx_spec(rounding, blocked, op);
  const int64_t M = x.size(0), K = x.size(1);
  ColsArgs a;
  const JaggedCols j = jagged_cols(a, x, offs, padded_starts, alignment, kMxBlock, op);
  const int64_t q_rows = j.q_rows;
  at::Tensor gstarts;
  if (!a.padded) check_multiple_of_block(M, op, "M (x.size(0))");
  if (a.jagged && !a.padded && check_content(*offs)) {
    const at::Tensor host = j.offs.cpu();  // host-sync-ok: CPU or MOE_FP8_DEBUG only
    const int32_t* o = host.data_ptr<int32_t>();
    for (int64_t g = 0; g < a.num_segments; ++g) {
      const int64_t n = o[g] - (g == 0 ? 0 : o[g - 1]);
      TORCH_CHECK(n % kMxBlock == 0, op, ": expected token groups whose sizes are multiples of ", kMxBlock,
                  " (or padded_starts and alignment), got ", n, " rows in group ", g);
    }
  }
  // Blocked K-groups: the groups' scale columns start at the padded offsets of
  // max(alignment, 128) rows (int32: from group_starts, or summed by the kernel for
  // unpadded groups); checked before any allocation.
  if (blocked && a.jagged) checked_padded_rows(M, a.num_segments, std::max<int64_t>(a.alignment, 128), op);
  a.q_rows = q_rows;
  at::Tensor q = at::empty_strided({q_rows, K}, {1, std::max<int64_t>(q_rows, 1)}, x.options().dtype(at::kFloat8_e4m3fn));
  const int64_t C = q_rows / kMxBlock;
  at::Tensor scale;
  ScaleOut s;
  if (!blocked) {
    // Unpadded groups: the launch writes every scale (the tail's as zeros, and the
    // groups cover every block column before it); padded ones may leave gaps.
    scale = e8m0_scales({K, C}, x, a.jagged && a.padded);
    a.tail_scales = a.jagged && !a.padded;
    s = linear_scales(scale, 0, C);
  } else if (!a.jagged) {
    scale = e8m0_scales({round_up(K, 128), round_up(C, 4)}, x, true);
    s = blocked_scales(scale, 0, round_up(C, 4), BlockedGroups::kNone);
  } else {
    const int64_t width = round_up(C, 4) + 4 * a.num_segments;
    scale = e8m0_scales({round_up(K, 128), width}, x, true);
    s = blocked_scales(scale, 0, width, BlockedGroups::kKGroups);
    s.padded_rows = round_up(K, 128);
    // Unpadded groups: the kernel sums the groups' widths itself (cols_col_base_gpu; on
    // the CPU blocked_group_start), so no table launch. Padded groups take their
    // starts from the padded offsets (rows; the kernel divides).
    if (a.padded) {
      gstarts = group_starts(*offs, M, std::max<int64_t>(a.alignment, 128));
      a.group_starts = gstarts.data_ptr<int32_t>();
    }
  }
  run_jagged_cols(k, in, Fp8Format::kE4M3FN, spec, a, x, q, q_rows, s);
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor> quantize_mxfp8_experts(const QuantKernels& k, const at::Tensor& b,
                                                          c10::string_view rounding, bool blocked) {
  constexpr const char* op = "quantize_mxfp8_experts";
  check_rank(b, 3, op, "b");
  const InputKind in = input_kind(b, op, "b");
  const QuantSpec spec = mx_spec(rounding, blocked, op);
  const int64_t E = b.size(0), K = b.size(1), N = b.size(2);
  check_multiple_of_block(K, op, "K (b.size(1))");
  TORCH_CHECK(E <= 65535, op, ": expected at most 65535 experts, got ", E);
  at::Tensor q = at::empty_strided({E, K, N}, {K * N, 1, std::max<int64_t>(K, 1)}, b.options().dtype(at::kFloat8_e4m3fn));
  const int64_t C = K / kMxBlock, Cp = round_up(C, 4), per_expert = round_up(N, 128) * Cp;
  const bool empty = E == 0 || K == 0 || N == 0;
  const bool rows = b.stride(1) == 1 && K > 1;  // K contiguous: the rows kernel (see below)
  at::Tensor scale;
  ScaleOut s;
  if (!blocked) {
    scale = e8m0_scales({E, N, C}, b, false);
    s = linear_scales(scale, N * C, C);
  } else {
    scale = e8m0_scales({E, per_expert}, b, empty || !rows);  // a rows launch writes it whole
    s = blocked_scales(scale, per_expert, Cp, BlockedGroups::kNone);
  }
  if (empty) return {q, scale};
  if (rows) {
    // K contiguous (B_t = W^T of a row-major W): reduce along rows of the memory.
    RowsArgs a;
    a.x = b.data_ptr();
    a.q = static_cast<uint8_t*>(q.data_ptr());
    a.rows = E * N;
    a.cols = K;
    a.rows_inner = N;
    a.stride_outer = b.stride(0);
    a.stride_inner = b.stride(2);
    a.stride_col = 1;
    a.scale = s;
    k.rows(in, Fp8Format::kE4M3FN, spec, a, b.device().index());
    return {q, scale};
  }
  ColsArgs a;
  ColsOperand& o = a.op[0];
  o.x = b.data_ptr();
  o.sb = b.stride(0);
  o.sr = b.stride(1);
  o.sc = b.stride(2);
  o.cols = N;
  o.q = static_cast<uint8_t*>(q.data_ptr());
  o.q_sb = K * N;
  o.q_sc = K;
  o.scale = s;
  a.rows = K;
  a.q_rows = K;
  a.num_segments = static_cast<int>(E);
  k.cols(in, Fp8Format::kE4M3FN, spec, a, K, b.device().index());
  return {q, scale};
}

}  // namespace moe_fp8
