// SwiGLU family (DESIGN §10): h = silu(h1) * h3 of the experts layer's FFN and its gradient, fused with the FP8
// rowwise quantization of their result. Plain data and the scalar math shared bit for bit by the CPU loops and the
// GPU kernels (and reference.py): no torch, no CUDA headers.
#pragma once

#include <cmath>
#include <cstdint>

#include "../core/float_ops.h"
#include "../core/numerics.h"
#include "../core/portability.h"

namespace moe_fp8 {

// One launch over rows of h13 = [h1 | h3] (hidden columns each, unit column stride); strides in elements, q's in bytes.
// Forward: out = h (rows, hidden); backward: out = grad_h13 (rows, 2 hidden); each when non-null. With `quant`, q[i] /
// scale[i] are the rowwise fp8 of h, or of half i of grad_h13 (a flag: an empty q has a null pointer, yet scales).
struct SwigluArgs {
  const void* h13 = nullptr;
  int64_t h13_stride = 0;
  const void* grad = nullptr;  // grad_h (rows, hidden), backward only
  int64_t grad_stride = 0;
  void* out = nullptr;
  int64_t out_stride = 0;
  void* h_out = nullptr;  // backward only: h (rows, hidden) recomputed, for the W2 weight gradient; null: none
  int64_t h_out_stride = 0;
  uint8_t* q[2] = {nullptr, nullptr};
  int64_t q_stride = 0;  // bytes between q rows
  float* scale[2] = {nullptr, nullptr};
  int64_t rows = 0;
  int64_t hidden = 0;
  // The bf16 forward's table of R(silu(x)) (kSiluTableEntries uint16, device memory the
  // launcher fills first); required for a bf16 forward on the GPU, unused elsewhere.
  uint16_t* silu_table = nullptr;
  bool backward = false;
  bool quant = false;
  bool joint = false;  // quant of grad_h13 as a whole, one scale a row: q[1] = q[0] + hidden, scale[1] = scale[0]
  bool pow2 = true;
};

// ---- fp32 arithmetic with one rounding per operation (f_mul, f_add, f_div: float_ops.h)

MOE_FP8_HD float f_sub(float a, float b) { return f_add(a, -b); }

// exp(x) from fp32 operations each rounded on its own (no FMA), so the CPU, the GPU and reference.py agree to the bit
// (within 2 ulp): n = rint(x log2 e), r = x - n ln2 (ln2 in two parts), degree-7 Taylor on |r| <= ln2/2, times 2^n.
// Branch-free (the kernels are bound by instruction issue): the polynomial runs on x clamped, out-of-range selected.
MOE_FP8_HD float exp_f32(float x) {
  constexpr float kHi = 88.72283935546875f, kLo = -87.3365478515625f;
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  const float xc = fminf(fmaxf(x, kLo), 88.72283172607421875f);  // the float below kHi; NaN -> kLo
  const float t = f_add(f_mul(xc, 1.44269502162933349609375f), kMagic);
  const float n = f_sub(t, kMagic);
  const float r = f_sub(f_sub(xc, f_mul(n, 0.693359375f)), f_mul(n, -2.12194440e-4f));
  float p = 1.98412698e-4f;  // 1/5040
  p = f_add(f_mul(p, r), 1.38888889e-3f);  // 1/720
  p = f_add(f_mul(p, r), 8.33333377e-3f);  // 1/120
  p = f_add(f_mul(p, r), 4.16666679e-2f);  // 1/24
  p = f_add(f_mul(p, r), 1.66666672e-1f);  // 1/6
  p = f_add(f_mul(p, r), 0.5f);
  p = f_add(f_mul(p, r), 1.0f);
  p = f_add(f_mul(p, r), 1.0f);
  const int ni = static_cast<int>(float_bits(t)) - static_cast<int>(float_bits(kMagic));  // n, in [-126, 128]
  const int a = ni >> 1, b = ni - a;  // each in [-63, 64]: 2^a, 2^b are normal floats
  const float e = f_mul(f_mul(p, bits_float(static_cast<uint32_t>(a + 127) << 23)),
                        bits_float(static_cast<uint32_t>(b + 127) << 23));
  const float lo = x < kLo ? 0.0f : e;  // 1 + exp(x) is 1 there
  return x < kHi ? lo : f_add(x, bits_float(0x7F800000u));  // +Inf, NaN stays NaN (a select, not a branch)
}

// d = 1 + exp(-x), the denominator of both silu(x) = x / d and sigmoid(x) = 1 / d.
MOE_FP8_HD float sigmoid_denominator(float x) { return f_add(1.0f, exp_f32(-x)); }

// silu's two divisions by d = 1 + exp(-x): q = x / d (silu) and, for the backward (kRcp), r = 1 / d (the sigmoid),
// each IEEE-rounded once. The bf16 results differ from torch's silu by at most one bf16 ulp, and rarely.
struct SiluQuot {
  float q = 0.0f, r = 0.0f;
};

template <bool kRcp>
MOE_FP8_HD SiluQuot silu_quot(float x) {
  const float d = sigmoid_denominator(x);
  SiluQuot o;
  o.q = f_div(x, d);
  if constexpr (kRcp) o.r = f_rcp(d);
  return o;
}

#if MOE_FP8_HAS_FAST_DIV
// silu_quot's bits without div.rn's operand check and per-element branch (rcp_rn_fast, div_rn_fast: div.rn's own fast
// path). ANDs into `ok` whether that path is sure: x >= -40 (d <= 2^58) and 2^-100 <= |x| <= 2^100, or x == 0 (its
// sign kept by a select); the caller recomputes with silu_quot where `ok` fell (NaN, Inf, out of range).
template <bool kRcp>
MOE_FP8_DEVICE SiluQuot silu_quot_fast(float x, bool& ok) {
  const float d = sigmoid_denominator(x);
  const float y = rcp_rn_fast(d);
  const float ax = fabsf(x);
  ok = ok && x >= -40.0f && ax <= 0x1p100f && (ax >= 0x1p-100f || x == 0.0f);
  SiluQuot o;
  o.q = x == 0.0f ? x : div_rn_fast(x, d, y);
  o.r = y;
  return o;
}
#endif

// silu_backward(g, x) = (g * sig) * (1 + x * (1 - sig)) as aten writes it, for x's sigmoid sig = 1 / d.
MOE_FP8_HD float silu_backward_f32(float g, float x, float sig) {
  return f_mul(f_mul(g, sig), f_add(1.0f, f_mul(x, f_sub(1.0f, sig))));
}

// Storage of one input element and its rounding (core/float_ops.h).
template <InputKind K>
using SwigluElem = ElemBits<K>;

// The bf16 module's math (torchtitan: F.silu(x w1) * (x w3)): R rounds to the input dtype (nearest even) what autograd
// materializes, the rest is fp32. h = R(R(silu(h1)) * h3), with silu(x) = x / (1 + exp(-x)) from silu_quot<false>(h1).
template <InputKind K>
MOE_FP8_HD typename SwigluElem<K>::storage swiglu_elem(const SiluQuot& sq, typename SwigluElem<K>::storage h3) {
  using E = SwigluElem<K>;
  return E::from_float(f_mul(E::round(sq.q), E::to_float(h3)));
}

template <InputKind K>
MOE_FP8_HD typename SwigluElem<K>::storage swiglu_elem(typename SwigluElem<K>::storage h1,
                                                       typename SwigluElem<K>::storage h3) {
  return swiglu_elem<K>(silu_quot<false>(SwigluElem<K>::to_float(h1)), h3);
}

// For the incoming gradient g: gs = R(g * h3), grad_h1 = R(silu_backward(gs, h1)), grad_h3 = R(g * R(silu(h1))), and,
// when h is non-null, h itself (bit for bit swiglu_elem's: W2's backward needs it); sq is silu_quot<true>(h1).
template <InputKind K>
MOE_FP8_HD void swiglu_backward_elem(const SiluQuot& sq, typename SwigluElem<K>::storage g,
                                     typename SwigluElem<K>::storage h1, typename SwigluElem<K>::storage h3,
                                     typename SwigluElem<K>::storage* gh1, typename SwigluElem<K>::storage* gh3,
                                     typename SwigluElem<K>::storage* h) {
  using E = SwigluElem<K>;
  const float gf = E::to_float(g), x = E::to_float(h1), x3 = E::to_float(h3);
  const float gs = E::round(f_mul(gf, x3));
  *gh1 = E::from_float(silu_backward_f32(gs, x, sq.r));
  const float s = E::round(sq.q);
  *gh3 = E::from_float(f_mul(gf, s));
  if (h != nullptr) *h = E::from_float(f_mul(s, x3));
}

template <InputKind K>
MOE_FP8_HD void swiglu_backward_elem(typename SwigluElem<K>::storage g, typename SwigluElem<K>::storage h1,
                                     typename SwigluElem<K>::storage h3, typename SwigluElem<K>::storage* gh1,
                                     typename SwigluElem<K>::storage* gh3, typename SwigluElem<K>::storage* h) {
  swiglu_backward_elem<K>(silu_quot<true>(SwigluElem<K>::to_float(h1)), g, h1, h3, gh1, gh3, h);
}

// ---- the bf16 forward by table -------------------------------------------------------

// s = R(silu(x)) of a bf16 x is a function of its 16 bits: the GPU forward reads silu_quot's own bits from a table of
// 2^-24 <= |x| < 128 (exponents 103..133, positive then negative; 15.5 KB, shared memory). Outside it s is R(x / 2),
// x from 128 up, x * 0 from -128 down; NaN stays NaN. A GPU test runs every bf16 h1 against the CPU.
constexpr int kSiluTableLoExp = 103;
constexpr int kSiluTableHalf = 31 * 128;
constexpr int kSiluTableEntries = 2 * kSiluTableHalf;

MOE_FP8_HD uint16_t silu_table_entry(int i) {
  const uint32_t b = (i >= kSiluTableHalf ? 0x8000u : 0u) +
                     (static_cast<uint32_t>(kSiluTableLoExp) << 7) + static_cast<uint32_t>(i % kSiluTableHalf);
  return float_to_bf16_bits(silu_quot<false>(bits_float(b << 16)).q);
}

// R(silu(x)) as a float for the bf16 bits b of x, from the table.
MOE_FP8_HD float silu_round_bf16(uint16_t b, const uint16_t* table) {
  const float x = bits_float(static_cast<uint32_t>(b) << 16);
  const uint32_t u = (b & 0x7FFFu) - (static_cast<uint32_t>(kSiluTableLoExp) << 7);  // wraps below the table
  const uint32_t i = (u < kSiluTableHalf ? u : 0u) + ((b & 0x8000u) ? kSiluTableHalf : 0u);
  const float from_table = bits_float(static_cast<uint32_t>(table[i]) << 16);
  const float small = SwigluElem<InputKind::kBF16>::round(f_mul(x, 0.5f));
  const float big = x > 0.0f ? x : f_mul(x, 0.0f);
  const bool below = (b & 0x7FFFu) < (static_cast<uint32_t>(kSiluTableLoExp) << 7);
  return u < kSiluTableHalf ? from_table : (below ? small : big);
}

// The runners of one device (CPU loops in swiglu_cpu.cpp, kernels in swiglu.cu),
// gathered in a SwigluKernels table (swiglu_ops.h): run(in, fp8 format, args, device).

}  // namespace moe_fp8
