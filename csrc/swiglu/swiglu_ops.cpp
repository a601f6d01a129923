// Torch glue of the SwiGLU family (DESIGN §10) for both devices: checks ("<op>: expected X, got Y"), allocation (h,
// grad_h13 contiguous in the input dtype; q row-major, scales (M, 1) fp32 as quantize_rowwise returns them) and the
// mapping onto one SwigluArgs launch.
#include <ATen/ATen.h>

#include <tuple>

#include "../core/op_checks.h"
#include "../quant/quant_glue.h"
#include "swiglu_ops.h"

namespace moe_fp8 {
namespace {

// h13 (M, 2H) with a unit column stride (other layouts are copied first).
at::Tensor checked_h13(const at::Tensor& h13, const char* op) {
  check_rank(h13, 2, op, "h13");
  input_kind(h13, op, "h13");
  TORCH_CHECK(h13.size(1) % 2 == 0, op, ": expected h13 with an even number of columns [h1 | h3], got ",
              h13.size(1));
  return (h13.size(1) <= 1 || h13.stride(1) == 1) ? h13 : h13.contiguous();
}

at::Tensor checked_grad(const at::Tensor& grad_h, const at::Tensor& h13, const char* op) {
  check_rank(grad_h, 2, op, "grad_h");
  TORCH_CHECK(grad_h.scalar_type() == h13.scalar_type(), op, ": expected grad_h of h13's dtype ",
              h13.scalar_type(), ", got ", grad_h.scalar_type());
  TORCH_CHECK(grad_h.device() == h13.device(), op, ": expected grad_h on ", h13.device(), " (the device of h13), got ",
              grad_h.device());
  TORCH_CHECK(grad_h.size(0) == h13.size(0) && 2 * grad_h.size(1) == h13.size(1), op,
              ": expected grad_h of shape (", h13.size(0), ", ", h13.size(1) / 2, ") for h13 of shape (",
              h13.size(0), ", ", h13.size(1), "), got (", grad_h.size(0), ", ", grad_h.size(1), ")");
  return (grad_h.size(1) <= 1 || grad_h.stride(1) == 1) ? grad_h : grad_h.contiguous();
}

SwigluArgs base_args(const at::Tensor& h13, const char* op) {
  TORCH_CHECK(h13.size(0) < (int64_t{1} << 31), op, ": expected fewer than 2^31 rows, got ", h13.size(0));
  SwigluArgs a;
  a.h13 = h13.data_ptr();
  a.h13_stride = h13.stride(0);
  a.rows = h13.size(0);
  a.hidden = h13.size(1) / 2;
  return a;
}

void set_out(SwigluArgs& a, const at::Tensor& out) {
  a.out = out.data_ptr();
  a.out_stride = out.size(1);
}

// q (M, hidden) row-major and scale (M, 1) of one half.
void set_quant(SwigluArgs& a, int half, const at::Tensor& q, const at::Tensor& scale, bool pow2) {
  a.q[half] = static_cast<uint8_t*>(q.data_ptr());
  a.q_stride = a.hidden;
  a.scale[half] = scale.data_ptr<float>();
  a.pow2 = pow2;
  a.quant = true;
}

void run(const SwigluKernels& k, const at::Tensor& h13, Fp8Format fmt, const SwigluArgs& args, const char* op) {
  // Quantizing empty rows still writes their scales (amax 0, as quantize_rowwise).
  if (args.rows == 0 || (args.hidden == 0 && !args.quant)) return;
  SwigluArgs a = args;
  at::Tensor table;  // the GPU bf16 forward's table (swiglu.h), filled by the launcher on the stream
  if (!a.backward && !h13.is_cpu() && h13.scalar_type() == at::kBFloat16) {
    table = at::empty({kSiluTableEntries}, h13.options().dtype(at::kShort));
    a.silu_table = static_cast<uint16_t*>(table.data_ptr());
  }
  k.run(input_kind(h13, op, "h13"), fmt, a, h13.device().index());
}

}  // namespace

at::Tensor swiglu(const SwigluKernels& k, const at::Tensor& h13_in) {
  constexpr const char* op = "swiglu";
  const at::Tensor h13 = checked_h13(h13_in, op);
  at::Tensor h = at::empty({h13.size(0), h13.size(1) / 2}, h13.options());
  SwigluArgs a = base_args(h13, op);
  set_out(a, h);
  run(k, h13, Fp8Format::kE4M3FN, a, op);
  return h;
}

std::tuple<at::Tensor, at::Tensor> swiglu_quantize_rowwise(const SwigluKernels& k, const at::Tensor& h13_in,
                                                           at::ScalarType fp8_dtype, bool pow2_scale) {
  constexpr const char* op = "swiglu_quantize_rowwise";
  const at::Tensor h13 = checked_h13(h13_in, op);
  const Fp8Format fmt = fp8_format(fp8_dtype, op);
  const int64_t M = h13.size(0), H = h13.size(1) / 2;
  at::Tensor q = at::empty({M, H}, h13.options().dtype(fp8_dtype));
  at::Tensor scale = at::empty({M, 1}, h13.options().dtype(at::kFloat));
  SwigluArgs a = base_args(h13, op);
  set_quant(a, 0, q, scale, pow2_scale);
  run(k, h13, fmt, a, op);
  return {q, scale};
}

at::Tensor swiglu_backward(const SwigluKernels& k, const at::Tensor& grad_in, const at::Tensor& h13_in) {
  constexpr const char* op = "swiglu_backward";
  const at::Tensor h13 = checked_h13(h13_in, op);
  const at::Tensor grad = checked_grad(grad_in, h13, op);
  at::Tensor grad_h13 = at::empty({h13.size(0), h13.size(1)}, h13.options());
  SwigluArgs a = base_args(h13, op);
  a.backward = true;
  a.grad = grad.data_ptr();
  a.grad_stride = grad.stride(0);
  set_out(a, grad_h13);
  run(k, h13, Fp8Format::kE4M3FN, a, op);
  return grad_h13;
}

namespace {

// grad_h13 with the rowwise fp8 of each half (joint = false: (q1, s1, q3, s3)) or of the
// whole (joint: q (M, 2H), s (M, 1) in the first pair, the second pair undefined);
// with `h`, also the forward value h.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_quantize(
    const SwigluKernels& k, const at::Tensor& grad_in, const at::Tensor& h13_in, at::ScalarType fp8_dtype,
    bool pow2_scale, bool joint, at::Tensor* h, const char* op) {
  const at::Tensor h13 = checked_h13(h13_in, op);
  const at::Tensor grad = checked_grad(grad_in, h13, op);
  const Fp8Format fmt = fp8_format(fp8_dtype, op);
  const int64_t M = h13.size(0), H = h13.size(1) / 2;
  at::Tensor grad_h13 = at::empty({M, 2 * H}, h13.options());
  at::Tensor q[2], scale[2];
  SwigluArgs a = base_args(h13, op);
  a.backward = true;
  a.grad = grad.data_ptr();
  a.grad_stride = grad.stride(0);
  set_out(a, grad_h13);
  if (h != nullptr) {
    *h = at::empty({M, H}, h13.options());
    a.h_out = h->data_ptr();
    a.h_out_stride = H;
  }
  if (joint) {
    q[0] = at::empty({M, 2 * H}, h13.options().dtype(fp8_dtype));
    scale[0] = at::empty({M, 1}, h13.options().dtype(at::kFloat));
    set_quant(a, 0, q[0], scale[0], pow2_scale);
    a.q[1] = a.q[0] == nullptr ? nullptr : a.q[0] + H;  // the second half of each q row
    a.scale[1] = a.scale[0];
    a.q_stride = 2 * H;
    a.joint = true;
  } else {
    for (int half = 0; half < 2; ++half) {
      q[half] = at::empty({M, H}, h13.options().dtype(fp8_dtype));
      scale[half] = at::empty({M, 1}, h13.options().dtype(at::kFloat));
      set_quant(a, half, q[half], scale[half], pow2_scale);
    }
  }
  run(k, h13, fmt, a, op);
  return {grad_h13, q[0], scale[0], q[1], scale[1]};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> swiglu_backward_quantize_rowwise(
    const SwigluKernels& k, const at::Tensor& grad_in, const at::Tensor& h13_in, at::ScalarType fp8_dtype,
    bool pow2_scale) {
  return backward_quantize(k, grad_in, h13_in, fp8_dtype, pow2_scale, false, nullptr,
                           "swiglu_backward_quantize_rowwise");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> swiglu_backward_with_h_quantize_rowwise(
    const SwigluKernels& k, const at::Tensor& grad_in, const at::Tensor& h13_in, at::ScalarType fp8_dtype,
    bool pow2_scale) {
  at::Tensor h;
  auto [g13, q, s, unused_q, unused_s] = backward_quantize(k, grad_in, h13_in, fp8_dtype, pow2_scale, true, &h,
                                                           "swiglu_backward_with_h_quantize_rowwise");
  return {g13, q, s, h};
}

}  // namespace moe_fp8
