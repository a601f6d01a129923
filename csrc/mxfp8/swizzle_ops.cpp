// Torch glue of the MXFP8 scale swizzles for both devices: checks ("<op>: expected X, got Y", in core/op_checks.h's
// order), DESIGN §7's output shapes and each op's SwizzleArgs. Outputs are allocated uninitialized: the runners write
// every byte (padding as zeros).
#include <ATen/ATen.h>

#include "../core/op_checks.h"
#include "swizzle_ops.h"

namespace moe_fp8 {
namespace {

// Any 1-byte dtype (scales are float8_e8m0fnu; uint8 / int8 / other float8 bytes move
// the same way); bool and quantized types are not scale bytes.
void check_byte_dtype(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.element_size() == 1 && t.scalar_type() != at::kBool && !at::isQIntType(t.scalar_type()), op,
              ": expected ", name, " of a 1-byte dtype (float8_e8m0fnu, uint8, int8 or another float8), got ",
              t.scalar_type());
}

// offs: int32 (G,) on the device of t. Its content (in [0, limit], non-decreasing) is
// checked last (check_offs: on the CPU; a GPU kernel clamps instead).
int64_t check_offs_tensor(const at::Tensor& offs, const at::Tensor& t, const char* tname, const char* op) {
  TORCH_CHECK(offs.scalar_type() == at::kInt, op, ": expected offs of dtype int32, got ", offs.scalar_type());
  check_rank(offs, 1, op, "offs");
  check_same_device(op, {tname, t}, {{"offs", offs}});
  check_groups(offs, op);
  return offs.numel();
}

int64_t ceil128(int64_t v) { return round_up(v, 128); }
int64_t ceil4(int64_t v) { return round_up(v, 4); }

// A size argument: [0, 2^40] keeps every padded size and product in int64.
constexpr int64_t kMaxDim = int64_t(1) << 40;

SwizzleArgs plain_source(const at::Tensor& s) {
  SwizzleArgs a;
  const bool three = s.dim() == 3;
  a.plain_in = static_cast<const uint8_t*>(s.data_ptr());
  a.E = three ? s.size(0) : 1;
  a.R = s.size(-2);
  a.C = s.size(-1);
  a.se = three ? s.stride(0) : 0;
  a.sr = s.stride(-2);
  a.sc = s.stride(-1);
  a.vec4 = a.sc == 1 && a.sr % 4 == 0 && a.se % 4 == 0 && reinterpret_cast<uintptr_t>(a.plain_in) % 4 == 0;
  return a;
}

at::Tensor scratch_for(int64_t groups, const at::Tensor& like) {
  if (groups <= kSwizzleSmemGroups) return at::Tensor();
  return at::empty({3 * groups + 1}, like.options().dtype(at::kInt));
}

at::Tensor run_to_blocked(const SwizzleKernels& k, SwizzleArgs a, const at::Tensor& s, at::IntArrayRef shape,
                          const at::Tensor& offs, const char* op) {
  const int64_t bytes = c10::multiply_integers(shape);  // no overflow: check_alloc
  TORCH_CHECK(bytes <= kSwizzleMaxBlockedBytes, op, ": expected at most ", kSwizzleMaxBlockedBytes,
              " bytes of blocked scales, got ", bytes);
  at::Tensor out = at::empty(shape, s.options());
  a.blocked_out = static_cast<uint8_t*>(out.data_ptr());
  a.blocked_bytes = out.numel();
  if (a.blocked_bytes == 0) return out;
  at::Tensor scratch, offs_c;
  if (offs.defined()) {
    offs_c = offs.contiguous();
    a.offs = offs_c.data_ptr<int32_t>();
    a.num_groups = static_cast<int>(offs.numel());
    scratch = scratch_for(offs.numel(), s);
  }
  k.run(a, true, scratch.defined() ? scratch.data_ptr<int32_t>() : nullptr, s.device().index());
  return out;
}

at::Tensor run_from_blocked(const SwizzleKernels& k, SwizzleArgs a, const at::Tensor& b, at::IntArrayRef shape,
                            const at::Tensor& offs) {
  at::Tensor out = at::empty(shape, b.options());
  if (out.numel() == 0) return out;
  const at::Tensor bc = b.contiguous();
  a.blocked_in = static_cast<const uint8_t*>(bc.data_ptr());
  a.blocked_bytes = bc.numel();
  a.plain_out = static_cast<uint8_t*>(out.data_ptr());
  at::Tensor scratch, offs_c;
  if (offs.defined()) {
    offs_c = offs.contiguous();
    a.offs = offs_c.data_ptr<int32_t>();
    a.num_groups = static_cast<int>(offs.numel());
    scratch = scratch_for(offs.numel(), b);
  }
  k.run(a, false, scratch.defined() ? scratch.data_ptr<int32_t>() : nullptr, b.device().index());
  return out;
}

}  // namespace

at::Tensor to_blocked_scales(const SwizzleKernels& k, const at::Tensor& s) {
  constexpr const char* op = "to_blocked_scales";
  TORCH_CHECK(s.dim() == 2 || s.dim() == 3, op, ": expected s to be a 2-D (R, C) or 3-D (E, R, C) tensor, got ",
              s.dim(), "-D");
  check_byte_dtype(s, op, "s");
  SwizzleArgs a = plain_source(s);
  const int64_t Rp = ceil128(a.R), Cp = ceil4(a.C);
  check_alloc({a.E, Rp, Cp}, 1, op, "the blocked scales");
  a.blocked_cols = Cp;
  if (s.dim() == 2) return run_to_blocked(k, a, s, {Rp, Cp}, at::Tensor(), op);
  return run_to_blocked(k, a, s, {a.E, Rp * Cp}, at::Tensor(), op);
}

at::Tensor to_blocked_scales_m_groups(const SwizzleKernels& k, const at::Tensor& s, const at::Tensor& offs) {
  constexpr const char* op = "to_blocked_scales_m_groups";
  check_rank(s, 2, op, "s");
  check_byte_dtype(s, op, "s");
  const int64_t M = s.size(0), G = check_offs_tensor(offs, s, "s", op);
  // group g's rows start at sum_{j<g} ceil128(n_j) <= M + 127 G (int32 tables)
  const int64_t rows = checked_add(M, checked_mul(128, G, op, "128 * groups"), op, "the blocked rows");
  checked_padded_rows(M, G, 128, op);
  check_offs(offs, s, M, op);
  SwizzleArgs a = plain_source(s);
  a.groups = SwizzleGroups::kMGroups;
  a.blocked_cols = ceil4(a.C);
  check_alloc({rows, a.blocked_cols}, 1, op, "the blocked scales");
  return run_to_blocked(k, a, s, {rows, a.blocked_cols}, offs, op);
}

at::Tensor to_blocked_scales_k_groups(const SwizzleKernels& k, const at::Tensor& s, const at::Tensor& offs) {
  constexpr const char* op = "to_blocked_scales_k_groups";
  check_rank(s, 2, op, "s");
  check_byte_dtype(s, op, "s");
  const int64_t R = s.size(0), C = s.size(1), G = check_offs_tensor(offs, s, "s", op);
  // group g's block columns start at sum_{j<g} ceil4(n_j) <= C + 4 G (int32 tables)
  checked_padded_rows(C, G, 4, op);
  check_offs(offs, s, checked_mul(C, kSwizzleBlock, op, "the tokens (32 * s.size(1))"), op);
  SwizzleArgs a = plain_source(s);
  a.vec4 = a.vec4 && C % 4 == 0;  // a group's first column is any column (swizzle_load4)
  a.groups = SwizzleGroups::kKGroups;
  a.blocked_cols = ceil4(C) + 4 * G;
  check_alloc({ceil128(R), a.blocked_cols}, 1, op, "the blocked scales");
  return run_to_blocked(k, a, s, {ceil128(R), a.blocked_cols}, offs, op);
}

at::Tensor from_blocked_scales(const SwizzleKernels& k, const at::Tensor& b, int64_t rows, int64_t cols) {
  constexpr const char* op = "from_blocked_scales";
  check_rank(b, 2, op, "b");
  check_byte_dtype(b, op, "b");
  check_size_arg(rows, op, "rows", kMaxDim);
  check_size_arg(cols, op, "cols", kMaxDim);
  const int64_t Rp = ceil128(rows), Cp = ceil4(cols);
  SwizzleArgs a;
  a.R = rows;
  a.C = cols;
  a.blocked_cols = Cp;
  if (b.size(0) == Rp && b.size(1) == Cp) return run_from_blocked(k, a, b, {rows, cols}, at::Tensor());
  const int64_t per_matrix = checked_mul(Rp, Cp, op, "one blocked matrix (ceil128(rows) * ceil4(cols))");
  TORCH_CHECK(b.size(1) == per_matrix, op, ": expected b of shape (", Rp, ", ", Cp, ") (one blocked matrix) or (E, ",
              per_matrix, ") (E blocked matrices) for rows=", rows, " and cols=", cols, ", got ", b.sizes());
  a.E = b.size(0);
  return run_from_blocked(k, a, b, {a.E, rows, cols}, at::Tensor());
}

at::Tensor from_blocked_scales_m_groups(const SwizzleKernels& k, const at::Tensor& b, const at::Tensor& offs,
                                        int64_t cols) {
  constexpr const char* op = "from_blocked_scales_m_groups";
  check_rank(b, 2, op, "b");
  check_byte_dtype(b, op, "b");
  const int64_t G = check_offs_tensor(offs, b, "b", op);
  check_size_arg(cols, op, "cols", kMaxDim);
  TORCH_CHECK(b.size(1) == ceil4(cols) && b.size(0) >= 128 * G, op, ": expected b of shape (M + 128 * ", G, ", ",
              ceil4(cols), ") (M tokens in ", G, " groups, cols=", cols, "), got ", b.sizes());
  const int64_t M = b.size(0) - 128 * G;
  checked_padded_rows(M, G, 128, op);
  check_offs(offs, b, M, op);
  SwizzleArgs a;
  a.R = M;
  a.C = cols;
  a.groups = SwizzleGroups::kMGroups;
  a.blocked_cols = ceil4(cols);
  return run_from_blocked(k, a, b, {M, cols}, offs);
}

at::Tensor from_blocked_scales_k_groups(const SwizzleKernels& k, const at::Tensor& b, const at::Tensor& offs,
                                        int64_t rows, int64_t cols) {
  constexpr const char* op = "from_blocked_scales_k_groups";
  check_rank(b, 2, op, "b");
  check_byte_dtype(b, op, "b");
  const int64_t G = check_offs_tensor(offs, b, "b", op);
  check_size_arg(rows, op, "rows", kMaxDim);
  check_size_arg(cols, op, "cols", kMaxDim);
  const int64_t width = ceil4(cols) + 4 * G;
  TORCH_CHECK(b.size(0) == ceil128(rows) && b.size(1) == width, op, ": expected b of shape (", ceil128(rows), ", ",
              width, ") (rows=", rows, ", cols=", cols, ", ", G, " groups), got ", b.sizes());
  checked_padded_rows(cols, G, 4, op);
  check_offs(offs, b, cols * kSwizzleBlock, op);
  SwizzleArgs a;
  a.R = rows;
  a.C = cols;
  a.groups = SwizzleGroups::kKGroups;
  a.blocked_cols = width;
  return run_from_blocked(k, a, b, {rows, cols}, offs);
}

}  // namespace moe_fp8
