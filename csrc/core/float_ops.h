// fp32 arithmetic with the same bits on host and device: rounded once, never contracted
// (f_mul, f_add, f_div, f_rcp), div.rn's fast path where it is exact (CUDA device code),
// rounding to bf16 and fp16 bits. CUDA instructions chosen by MOE_FP8_CUDA_ARCH (portability.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "numerics.h"
#include "portability.h"

namespace moe_fp8 {

// fp32 multiply and add (f_rcp, f_div below too) rounded once, never contracted into an FMA, so the CPU and GPU give the
// same bits (e.g. swiglu.h). nvcc: the _rn intrinsics; clang (HIP device, clang host): the pragma; host GCC:
// -ffp-contract=off (CMakeLists.txt).
MOE_FP8_HD float f_mul(float a, float b) {
#if MOE_FP8_CUDA_ARCH
  return __fmul_rn(a, b);
#else
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  return a * b;
#endif
}

MOE_FP8_HD float f_add(float a, float b) {
#if MOE_FP8_CUDA_ARCH
  return __fadd_rn(a, b);
#else
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  return a + b;
#endif
}

// 1 / a rounded once (the same bits as f_div(1, a), cheaper on CUDA).
MOE_FP8_HD float f_rcp(float a) {
#if MOE_FP8_CUDA_ARCH
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

MOE_FP8_HD float f_div(float a, float b) {
#if MOE_FP8_CUDA_ARCH
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// RN(1 / d), RN(x / d) by div.rn's fast path minus its operand check (CUDA device only: MOE_FP8_HAS_FAST_DIV). rcp_rn_fast:
// MUFU.RCP and one Newton step (RN for d in [1, 2^126)); div_rn_fast(x, d, y = rcp_rn_fast(d)): q = RN(x y), one correction
// by the fma-exact residual, RN wherever div.rn's check passes. Callers keep operands there (swiglu.h), else f_div.
#if MOE_FP8_CUDA_ARCH
#define MOE_FP8_HAS_FAST_DIV 1
MOE_FP8_DEVICE float rcp_rn_fast(float d) {
  float r0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(d));
  return __fmaf_rn(r0, __fmaf_rn(-d, r0, 1.0f), r0);
}

MOE_FP8_DEVICE float div_rn_fast(float x, float d, float y) {
  const float q0 = __fmul_rn(x, y);
  return __fmaf_rn(y, __fmaf_rn(-d, q0, x), q0);
}
#else
#define MOE_FP8_HAS_FAST_DIV 0
#endif

// fp32 to bf16 bits, round to nearest even (subnormals kept, overflow to Inf); a NaN's
// result is unspecified (callers that keep NaNs check for them first). One cvt on sm80+
// CUDA, the same rounding done on the bits elsewhere.
MOE_FP8_HD uint16_t bf16_bits_rn(float f) {
#if MOE_FP8_CUDA_ARCH >= 800
  uint16_t b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
#else
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
#endif
}

// ---- rounding to the input dtype (bits), as torch's casts do ---------------------------

// Round to nearest even (subnormals kept, overflow to Inf); NaN becomes c10's 0x7FC0.
// bf16_bits_rn is one cvt on sm80+ CUDA: the SwiGLU kernels are bound by instruction
// issue (record 030), and this conversion runs two to five times an element.
MOE_FP8_HD uint16_t float_to_bf16_bits(float f) {
  const uint16_t b = bf16_bits_rn(f);  // unconditionally: a select, not a branch
  return f != f ? static_cast<uint16_t>(0x7FC0u) : b;
}

// f as its bf16 cast holds it (torch's x.to(torch.bfloat16)), as a float: kFP32AsBF16's read.
MOE_FP8_HD float float_as_bf16(float f) { return bits_float(static_cast<uint32_t>(float_to_bf16_bits(f)) << 16); }

// Integer ops only: the same bits on host and device; a NaN keeps its sign (0x7E00).
MOE_FP8_HD uint16_t float_to_half_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to Inf
  if (a >= 0x38800000u) return static_cast<uint16_t>(sign | rne_shift(a - (112u << 23), 13));
  const int e = static_cast<int>(a >> 23);  // fp16 subnormal: units of 2^-24
  const int shift = 126 - e;
  return static_cast<uint16_t>(sign | ((e == 0 || shift > 31) ? 0u : rne_shift((a & 0x7FFFFFu) | 0x800000u, shift)));
}

MOE_FP8_HD float half_bits_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return bits_float(sign | 0x7F800000u | (m << 13));
  if (e != 0) return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  return m == 0 ? bits_float(sign) : (sign ? -1.0f : 1.0f) * static_cast<float>(m) * 5.9604644775390625e-8f;
}

// One element of a bf16, fp16 or fp32 tensor: its storage (bits or a float), as fp32, from
// fp32 (nearest even; a NaN stays a NaN), and an fp32 intermediate rounded to the type.
template <InputKind K>
struct ElemBits;

template <>
struct ElemBits<InputKind::kBF16> {
  using storage = uint16_t;
  static MOE_FP8_HD float to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }
  static MOE_FP8_HD uint16_t from_float(float f) { return float_to_bf16_bits(f); }
  // An intermediate's rounding: a NaN stays a NaN of some payload (no canonical select;
  // every output goes through from_float). From bf16 inputs a NaN's low 16 bits are 0,
  // so the integer rounding off CUDA cannot carry it into the sign.
  static MOE_FP8_HD float round(float f) { return bits_float(static_cast<uint32_t>(bf16_bits_rn(f)) << 16); }
};

template <>
struct ElemBits<InputKind::kFP16> {
  using storage = uint16_t;
  static MOE_FP8_HD float to_float(uint16_t b) { return half_bits_float(b); }
  static MOE_FP8_HD uint16_t from_float(float f) { return float_to_half_bits(f); }
  static MOE_FP8_HD float round(float f) { return half_bits_float(float_to_half_bits(f)); }
};

template <>
struct ElemBits<InputKind::kFP32> {
  using storage = float;
  static MOE_FP8_HD float to_float(float f) { return f; }
  static MOE_FP8_HD float from_float(float f) { return f; }
  static MOE_FP8_HD float round(float f) { return f; }
};

}  // namespace moe_fp8
