// The torch-facing ops of the SwiGLU family (DESIGN §10; schemas in csrc/bindings.cpp) and their per-device
// registration: swiglu_ops.cpp holds the checks and allocation, written once against a table of device runners;
// swiglu_cpu.cpp and swiglu.cu each fill a table and register SwigluOn<their table>.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <tuple>

#include "../core/numerics.h"
#include "swiglu.h"

namespace moe_fp8 {

// What one device provides: one launch over checked, allocated pointers. `fmt` is used
// only with a.quant; `device` is the tensors' device index (ignored on the CPU).
struct SwigluKernels {
  void (*run)(InputKind in, Fp8Format fmt, const SwigluArgs& a, int device);
};

at::Tensor swiglu(const SwigluKernels& k, const at::Tensor& h13);
std::tuple<at::Tensor, at::Tensor> swiglu_quantize_rowwise(const SwigluKernels& k, const at::Tensor& h13,
                                                           at::ScalarType fp8_dtype, bool pow2_scale);
at::Tensor swiglu_backward(const SwigluKernels& k, const at::Tensor& grad_h, const at::Tensor& h13);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> swiglu_backward_quantize_rowwise(
    const SwigluKernels& k, const at::Tensor& grad_h, const at::Tensor& h13, at::ScalarType fp8_dtype,
    bool pow2_scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> swiglu_backward_with_h_quantize_rowwise(
    const SwigluKernels& k, const at::Tensor& grad_h, const at::Tensor& h13, at::ScalarType fp8_dtype,
    bool pow2_scale);

template <const SwigluKernels& K>
struct SwigluOn {
  static at::Tensor fwd(const at::Tensor& h13) { return swiglu(K, h13); }
  static std::tuple<at::Tensor, at::Tensor> fwd_q(const at::Tensor& h13, at::ScalarType t, bool pow2) {
    return swiglu_quantize_rowwise(K, h13, t, pow2);
  }
  static at::Tensor bwd(const at::Tensor& g, const at::Tensor& h13) { return swiglu_backward(K, g, h13); }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_q(const at::Tensor& g,
                                                                                      const at::Tensor& h13,
                                                                                      at::ScalarType t, bool pow2) {
    return swiglu_backward_quantize_rowwise(K, g, h13, t, pow2);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_h_q(const at::Tensor& g,
                                                                          const at::Tensor& h13, at::ScalarType t,
                                                                          bool pow2) {
    return swiglu_backward_with_h_quantize_rowwise(K, g, h13, t, pow2);
  }
  static void register_impls(torch::Library& m) {
    m.impl("swiglu", TORCH_FN(fwd));
    m.impl("swiglu_quantize_rowwise", TORCH_FN(fwd_q));
    m.impl("swiglu_backward", TORCH_FN(bwd));
    m.impl("swiglu_backward_quantize_rowwise", TORCH_FN(bwd_q));
    m.impl("swiglu_backward_with_h_quantize_rowwise", TORCH_FN(bwd_h_q));
  }
};

}  // namespace moe_fp8
