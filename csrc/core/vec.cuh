// Device-side storage types and vector access: input elements are handled as raw
// bits (bf16/fp16) or floats and converted to fp32 here, so kernels need no
// bf16/half C++ types; Array<T, N> gives 16-byte (or narrower) loads and stores.
#pragma once

#include <cstdint>

#include "float_ops.h"
#include "numerics.h"
#include "portability.h"

namespace moe_fp8 {

template <typename T, int N>
struct alignas(sizeof(T) * N) Array {
  T v[N];
};

template <InputKind K>
struct DeviceInput;

template <>
struct DeviceInput<InputKind::kBF16> {
  using storage = uint16_t;
  static MOE_FP8_DEVICE float to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }
};

template <>
struct DeviceInput<InputKind::kFP16> {
  using storage = uint16_t;
  static MOE_FP8_DEVICE float to_float(uint16_t b) { return half_bits_to_float(b); }
};

template <>
struct DeviceInput<InputKind::kFP32> {
  using storage = float;
  static MOE_FP8_DEVICE float to_float(float f) { return f; }
};

template <>
struct DeviceInput<InputKind::kFP32AsBF16> {
  using storage = float;
  static MOE_FP8_DEVICE float to_float(float f) { return float_as_bf16(f); }
};

// N consecutive elements (one 16-byte access when N * sizeof(T) == 16); N == 1 reads
// one element at an arbitrary stride.
template <typename T, int N>
MOE_FP8_DEVICE Array<T, N> load_elems(const T* p, int64_t stride) {
  if constexpr (N == 1) {
    Array<T, 1> a;
    a.v[0] = *p;
    (void)stride;
    return a;
  } else {
    (void)stride;
    return *reinterpret_cast<const Array<T, N>*>(p);
  }
}

template <typename T, int N>
MOE_FP8_DEVICE void store_elems(T* p, const Array<T, N>& a) {
  *reinterpret_cast<Array<T, N>*>(p) = a;
}

// x * s as fp8: CUDA's e4m3fn conversion saturates to +-448 and writes 0x7F for NaN
// (cvt.rn.satfinite), exactly what scale_clamp and the encoder do; others clamp first.
// (Each value with its own scale: the two columns of a column-scaled pair.)
template <Fp8Format F>
MOE_FP8_DEVICE uint16_t scaled_fp8x2(float lo, float hi, float s_lo, float s_hi) {
#if MOE_FP8_HW_E4M3FN_SATFINITE
  if constexpr (F == Fp8Format::kE4M3FN) return hw_cvt_e4m3fn_x2(lo * s_lo, hi * s_hi);
#endif
  constexpr float kMax = Fp8Spec<F>::kMax;
  return encode_fp8x2<F>(scale_clamp(lo, s_lo, kMax), scale_clamp(hi, s_hi, kMax));
}

template <Fp8Format F>
MOE_FP8_DEVICE uint16_t scaled_fp8x2(float lo, float hi, float s) {
  return scaled_fp8x2<F>(lo, hi, s, s);
}

// Scale, clamp and encode N values into N fp8 bytes (pairs go through the
// two-value encoder so that hardware conversion can be used).
template <Fp8Format F, class In, typename T, int N>
MOE_FP8_DEVICE Array<uint8_t, N> quantize_elems(const Array<T, N>& a, float s) {
  constexpr float kMax = Fp8Spec<F>::kMax;
  Array<uint8_t, N> out;
  if constexpr (N == 1) {
    out.v[0] = encode_fp8<F>(scale_clamp(In::to_float(a.v[0]), s, kMax));
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const uint16_t two = scaled_fp8x2<F>(In::to_float(a.v[i]), In::to_float(a.v[i + 1]), s);
      out.v[i] = static_cast<uint8_t>(two & 0xFF);
      out.v[i + 1] = static_cast<uint8_t>(two >> 8);
    }
  }
  return out;
}

// Element j (0..7) of eight 2-byte values packed in a uint4 (one 16-byte load), as a
// float.
template <InputKind K>
MOE_FP8_DEVICE float uint4_elem(const uint4& v, int j) {
  const uint32_t w = j < 4 ? (j < 2 ? v.x : v.y) : (j < 6 ? v.z : v.w);
  return DeviceInput<K>::to_float(static_cast<uint16_t>((j % 2) ? (w >> 16) : (w & 0xFFFFu)));
}

// The 4x4 byte transpose: rows a, b, c, d (byte k of a row is column k) to columns
// (byte k of column j is row k's byte j). Eight byte permutes.
MOE_FP8_DEVICE void transpose_bytes_4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t col[4]) {
  const uint32_t ab01 = byte_perm(a, b, 0x5140u), ab23 = byte_perm(a, b, 0x7362u);  // a0 b0 a1 b1, a2 b2 a3 b3
  const uint32_t cd01 = byte_perm(c, d, 0x5140u), cd23 = byte_perm(c, d, 0x7362u);
  col[0] = byte_perm(ab01, cd01, 0x5410u);
  col[1] = byte_perm(ab01, cd01, 0x7632u);
  col[2] = byte_perm(ab23, cd23, 0x5410u);
  col[3] = byte_perm(ab23, cd23, 0x7632u);
}

// Packed amax of 16-bit inputs (bf16/fp16) for the rows and tiles kernels: a running max of sign-cleared lanes, two a
// word. Cleared, integer order is |x| order with NaN above inf (as abs_bits), so the max lane's float bits are the amax.
MOE_FP8_DEVICE uint32_t amax16x2_add(uint32_t m, uint32_t w) { return umax_u16x2(m, w & 0x7FFF7FFFu); }

// Float abs bits of lane `hi ? 1 : 0` of a packed amax word.
template <class In>
MOE_FP8_DEVICE uint32_t amax16x2_lane_bits(uint32_t m, bool hi) {
  return abs_bits(In::to_float(static_cast<uint16_t>(hi ? (m >> 16) : (m & 0xFFFFu))));
}

template <class In, typename T, int N>
MOE_FP8_DEVICE uint32_t amax_bits_of(const Array<T, N>& a, uint32_t m) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const uint32_t b = abs_bits(In::to_float(a.v[i]));
    m = b > m ? b : m;
  }
  return m;
}

}  // namespace moe_fp8
