// Scalar numerics shared bit-for-bit by the CPU and GPU kernels (DESIGN §4, §5): fp8 encoders (RNE, saturating,
// bit-exact with PyTorch's casts for finite inputs after the clamp; any NaN -> the format's positive NaN), the
// NaN-propagating amax, and the scale rule with exact power-of-two rounding from the exponent bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "portability.h"

namespace moe_fp8 {

enum class Fp8Format : int { kE4M3FN = 0, kE4M3FNUZ = 1, kE5M2 = 2 };

// High-precision input element types the quantizers accept. kFP32AsBF16: fp32 read as
// its bf16 rounding (what x.to(torch.bfloat16) holds), so a cast need not be written
// first; only the weight quantizers that opt in (dispatch_input_fp8<true>) take it.
enum class InputKind : int { kBF16 = 0, kFP16 = 1, kFP32 = 2, kFP32AsBF16 = 3 };

template <Fp8Format F>
struct Fp8Spec;

template <>
struct Fp8Spec<Fp8Format::kE4M3FN> {
  static constexpr int kManBits = 3;
  static constexpr int kBias = 7;
  static constexpr uint32_t kMaxCode = 0x7E;     // 448
  static constexpr uint32_t kMaxBits = 0x43E00000u;  // 448.0f
  static constexpr uint32_t kNaN = 0x7F;         // the NaN written (torch's cast of +NaN)
  static constexpr bool kSigned = true;          // has -0
  static constexpr float kMax = 448.0f;
};

template <>
struct Fp8Spec<Fp8Format::kE4M3FNUZ> {
  static constexpr int kManBits = 3;
  static constexpr int kBias = 8;
  static constexpr uint32_t kMaxCode = 0x7F;     // 240
  static constexpr uint32_t kMaxBits = 0x43700000u;  // 240.0f
  static constexpr uint32_t kNaN = 0x80;         // the only NaN; there is no -0
  static constexpr bool kSigned = false;
  static constexpr float kMax = 240.0f;
};

template <>
struct Fp8Spec<Fp8Format::kE5M2> {
  static constexpr int kManBits = 2;
  static constexpr int kBias = 15;
  static constexpr uint32_t kMaxCode = 0x7B;     // 57344
  static constexpr uint32_t kMaxBits = 0x47600000u;  // 57344.0f
  static constexpr uint32_t kNaN = 0x7F;
  static constexpr bool kSigned = true;
  static constexpr float kMax = 57344.0f;
};

MOE_FP8_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

MOE_FP8_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// The fp32 NaN of every NaN scale (a NaN amax): +NaN with every payload bit, the NaN
// NVIDIA GPUs make. scale_from_amax_bits divides by it, so payload propagation (x86)
// and canonicalization (CUDA) agree on the result, with no select after the division.
constexpr uint32_t kF32NaN = 0x7FFFFFFFu;

MOE_FP8_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
MOE_FP8_HD int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// |x| as bits. For non-negative floats the integer order is the float order and
// every NaN compares above +inf, so an integer max of these is a NaN-propagating
// amax that needs no float compare.
MOE_FP8_HD uint32_t abs_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }

// Round-to-nearest-even right shift of a positive integer by `shift` (1..31).
MOE_FP8_HD uint32_t rne_shift(uint32_t v, int shift) {
  return (v + ((1u << (shift - 1)) - 1u) + ((v >> shift) & 1u)) >> shift;
}

// Software encoder: integer-only so that host and device give identical bits. Every
// NaN, whatever its sign and payload, gives kNaN (DESIGN §4: the sign of a computed
// NaN is left open by IEEE and differs between x86, torch's kernels and GPUs).
template <Fp8Format F>
MOE_FP8_HD uint8_t encode_fp8_sw(float x) {
  using S = Fp8Spec<F>;
  const uint32_t bits = float_bits(x);
  const uint32_t sign = bits >> 31;
  const uint32_t a = bits & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint8_t>(S::kNaN);
  constexpr int kShift = 23 - S::kManBits;
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 - S::kBias + 1) << 23;
  uint32_t code;
  if (a >= S::kMaxBits) {
    code = S::kMaxCode;  // saturate (values in (max, max + ulp/2) round to max too)
  } else if (a >= kMinNormalBits) {
    // Re-bias the exponent in place, then drop the extra mantissa bits (RNE); a
    // mantissa carry correctly bumps the exponent.
    code = rne_shift(a - (static_cast<uint32_t>(127 - S::kBias) << 23), kShift);
  } else {
    // fp8 subnormal: the value in units of the smallest subnormal 2^(1-bias-man).
    const int e = static_cast<int>(a >> 23);
    const int shift = 150 - e - (S::kBias - 1 + S::kManBits);
    code = (e == 0 || shift > 31) ? 0u : rne_shift((a & 0x7FFFFFu) | 0x800000u, shift);
  }
  if (S::kSigned) return static_cast<uint8_t>(code | (sign << 7));
  return static_cast<uint8_t>(code == 0 ? 0u : (code | (sign << 7)));
}

// Decoder: the exact fp32 value of an fp8 code (every fp8 value is an fp32 value);
// e4m3fn 0x7F/0xFF, fnuz 0x80 and e5m2's NaN codes give +NaN, e5m2's 0x7C/0xFC +-Inf.
template <Fp8Format F>
MOE_FP8_HD float decode_fp8(uint32_t b) {
  using S = Fp8Spec<F>;
  constexpr int kExpBits = 7 - S::kManBits;
  const uint32_t sign = (b >> 7) & 1u;
  const uint32_t e = (b >> S::kManBits) & ((1u << kExpBits) - 1u);
  const uint32_t m = b & ((1u << S::kManBits) - 1u);
  if (F == Fp8Format::kE4M3FNUZ && b == 0x80u) return bits_float(0x7FC00000u);
  if (F == Fp8Format::kE4M3FN && e == 15u && m == 7u) return bits_float(0x7FC00000u);
  if (F == Fp8Format::kE5M2 && e == 31u) return bits_float(m != 0 ? 0x7FC00000u : (0x7F800000u | (sign << 31)));
  uint32_t bits;
  if (e != 0) {
    bits = ((e + 127u - S::kBias) << 23) | (m << (23 - S::kManBits));
  } else {  // subnormal (or zero): m units of 2^(1 - bias - man), exact in fp32
    bits = float_bits(static_cast<float>(m) * bits_float(static_cast<uint32_t>(128 - S::kBias - S::kManBits) << 23));
  }
  return bits_float(bits | (sign << 31));
}

// fnuz has one zero and one NaN (0x80): a hardware "-0" or a negative value that
// rounds to zero must come out as 0x00, and only a NaN input as 0x80.
MOE_FP8_HD uint32_t fnuz_fix_byte(uint32_t b, float x) {
  if (abs_bits(x) > 0x7F800000u) return 0x80u;
  return (b & 0x7Fu) == 0 ? 0u : b;
}

// Two values at once, low byte first; hardware conversion where it is bit-exact, NaN
// included (see portability.h for which instruction gives which encoding).
template <Fp8Format F>
MOE_FP8_HD uint16_t encode_fp8x2(float lo, float hi) {
#if MOE_FP8_HW_E4M3FNUZ
  if constexpr (F == Fp8Format::kE4M3FNUZ) {
    const uint16_t hw = hw_cvt_e4m3fnuz_x2(lo, hi);
    return static_cast<uint16_t>(fnuz_fix_byte(hw & 0xFFu, lo) | (fnuz_fix_byte(hw >> 8, hi) << 8));
  }
#endif
#if MOE_FP8_HW_E4M3FN
  if constexpr (F == Fp8Format::kE4M3FN) {
    return hw_cvt_e4m3fn_x2(lo, hi);
  }
#if !MOE_FP8_HW_E4M3FNUZ
  if constexpr (F == Fp8Format::kE4M3FNUZ) {
    // fnuz(x) == e4m3fn(2x) for |x| <= 232 (bias 8 vs 7, same mantissa); above 232
    // fnuz rounds to its max code 0x7F, which is NaN in e4m3fn.
    const uint16_t fn = hw_cvt_e4m3fn_x2(2.0f * lo, 2.0f * hi);
    uint32_t out = 0;
    const float v[2] = {lo, hi};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t b = (fn >> (8 * i)) & 0xFFu;
      const uint32_t a = abs_bits(v[i]);
      const uint32_t c = (a > 0x43680000u && a <= 0x7F800000u) ? (0x7Fu | (b & 0x80u)) : fnuz_fix_byte(b, v[i]);
      out |= c << (8 * i);
    }
    return static_cast<uint16_t>(out);
  }
#endif
#endif
  return static_cast<uint16_t>(encode_fp8_sw<F>(lo) | (encode_fp8_sw<F>(hi) << 8));
}

template <Fp8Format F>
MOE_FP8_HD uint8_t encode_fp8(float x) {
  return static_cast<uint8_t>(encode_fp8x2<F>(x, 0.0f) & 0xFFu);
}

// Encode scale s and decode scale 1/s from amax (DESIGN §5), IEEE fp32 with subnormals
// (nvcc: div.rn and rcp.rn; no flush to zero). A NaN amax gives NaN scales (kF32NaN
// from scale_from_amax_bits), so the whole reduction set becomes NaN, never finite.
struct QuantScale {
  float encode;
  float decode;
};

MOE_FP8_HD QuantScale scale_from_amax(float amax, float fp8_max, bool pow2) {
  const float clamped = (amax != amax) ? amax : (amax > 1e-12f ? amax : 1e-12f);
  float s = fp8_max / clamped;
  if (pow2 && s == s) s = bits_float(float_bits(s) & 0x7F800000u);  // 2^floor(log2 s)
  return {s, 1.0f / s};
}

// amax_bits: abs bits (no sign). A NaN gets every mantissa bit set, so it is kF32NaN,
// by integer ops before the division (nvcc turns a float select of the divisor into
// two divisions).
MOE_FP8_HD QuantScale scale_from_amax_bits(uint32_t amax_bits, float fp8_max, bool pow2) {
  const uint32_t bits = amax_bits | (amax_bits > 0x7F800000u ? 0x007FFFFFu : 0u);
  return scale_from_amax(bits_float(bits), fp8_max, pow2);
}

// E8M0 scale bytes (OCP MX, DESIGN §7): 2^(b - 127), b = 255 NaN. Rules map amax abs bits (NaN above 0x7F800000) to b;
// e8m0_*_multiplier gives the encode multiplier, bit-identical to torchao's to_mx, which divides by the scale
// (multiplying by an exact power of two rounds the same).
constexpr uint32_t kE8m0NaN = 255;

// FLOOR: b = clamp(E(amax) - 127 - 8, -127, 128) + 127, E the fp32 exponent field
// (8 = floor(log2 448), the e4m3fn max exponent).
MOE_FP8_HD uint32_t e8m0_floor_from_amax_bits(uint32_t amax_bits) {
  if (amax_bits > 0x7F800000u) return kE8m0NaN;
  const int unbiased = static_cast<int>(amax_bits >> 23) - 127 - 8;
  return static_cast<uint32_t>((unbiased < -127 ? -127 : (unbiased > 128 ? 128 : unbiased)) + 127);
}

// torchao divides by max(2^(b-127), 2^-126), and by +Inf for a NaN block (b = 255):
// finite values go to 0, NaN stays NaN. Multiplying by 0 does the same.
MOE_FP8_HD float e8m0_floor_multiplier(uint32_t b) {
  if (b == kE8m0NaN) return 0.0f;
  return bits_float(static_cast<uint32_t>(254 - (b < 1 ? 1 : b)) << 23);  // 2^(127 - max(b, 1))
}

// RCEIL: d = amax / 448 (an fp32 division, as to_mx), b = clamp(ceil(log2 d), -127,
// 127) + 127 from the bits of d: E(d) - 127 + (mantissa != 0) for normal d, the same
// on the exact value of a subnormal d. NaN gives 255, +Inf 254.
MOE_FP8_HD uint32_t e8m0_rceil_from_amax_bits(uint32_t amax_bits) {
  if (amax_bits > 0x7F800000u) return kE8m0NaN;
  const uint32_t d = float_bits(bits_float(amax_bits) / 448.0f);
  const int e = static_cast<int>(d >> 23);
  const uint32_t man = d & 0x7FFFFFu;
  int log2_ceil;
  if (e == 0) {
    if (man == 0) return 0;  // d == 0: log2 is -inf, clamped to -127
    // d = man * 2^-149: ceil(log2 man) - 149, with log2 man from its highest bit.
    int hi = 31;
    while (((man >> hi) & 1u) == 0) --hi;
    log2_ceil = hi + ((man & ((1u << hi) - 1u)) != 0 ? 1 : 0) - 149;
  } else {
    log2_ceil = e - 127 + (man != 0 ? 1 : 0);
  }
  return static_cast<uint32_t>((log2_ceil < -127 ? -127 : (log2_ceil > 127 ? 127 : log2_ceil)) + 127);
}

// m = 2^(127 - b); 1 for b = 0 (as torchao and TransformerEngine); the subnormal
// 2^-127 for b = 254; NaN for a NaN block.
MOE_FP8_HD float e8m0_rceil_multiplier(uint32_t b) {
  if (b == kE8m0NaN) return bits_float(0x7FC00000u);
  if (b == 0) return 1.0f;
  if (b == 254) return bits_float(0x00400000u);
  return bits_float((254 - b) << 23);
}

// x * s clamped to +-fp8_max. Compares (not fminf) so that NaN stays NaN.
MOE_FP8_HD float scale_clamp(float x, float s, float fp8_max) {
  float v = x * s;
  v = v < -fp8_max ? -fp8_max : v;
  return v > fp8_max ? fp8_max : v;
}

}  // namespace moe_fp8
