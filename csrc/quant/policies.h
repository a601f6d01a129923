// Policies of the quantization engine (DESIGN §2, §5–§7), host and device, so the CPU twin and GPU kernels share them:
// scale rule (block amax -> encode multiplier and stored scale, fp32 or E8M0), block (elements of the reduced dimension
// per scale; kWholeSet: the whole set), scale layout (linear strides, or DESIGN §7's swizzled "blocked" with group starts).
#pragma once

#include <cstdint>

#include "../core/groups.h"
#include "../core/numerics.h"

namespace moe_fp8 {

// ---- scale rules --------------------------------------------------------------------

template <typename Stored>
struct ScaleCode {
  float encode;   // the data is quantized as fp8(clamp(x * encode, +-max))
  Stored stored;  // what goes to the scale tensor
};

// fp32 decode scales (DESIGN §5, §6): s = max / max(amax, 1e-12), an exact fp32 division, stored as 1/s. kPow2 rounds
// s down to a power of two from its exponent bits (FP8 rowwise default); else exact (pow2_scale=False, FP8 blockwise).
template <bool kPow2>
struct Fp32Scale {
  using stored_t = float;
  static constexpr bool supports(Fp8Format) { return true; }
  template <Fp8Format F>
  static MOE_FP8_HD ScaleCode<float> from_amax_bits(uint32_t amax_bits) {
    const QuantScale s = scale_from_amax_bits(amax_bits, Fp8Spec<F>::kMax, kPow2);
    return {s.encode, s.decode};
  }
};
using Fp32Pow2 = Fp32Scale<true>;
using Fp32Exact = Fp32Scale<false>;

// MXFP8 (DESIGN §7): E8M0 bytes, e4m3fn data only.
struct E8m0Floor {
  using stored_t = uint8_t;
  static constexpr bool supports(Fp8Format f) { return f == Fp8Format::kE4M3FN; }
  template <Fp8Format F>
  static MOE_FP8_HD ScaleCode<uint8_t> from_amax_bits(uint32_t amax_bits) {
    static_assert(F == Fp8Format::kE4M3FN, "MXFP8 data is float8_e4m3fn");
    const uint32_t b = e8m0_floor_from_amax_bits(amax_bits);
    return {e8m0_floor_multiplier(b), static_cast<uint8_t>(b)};
  }
};

struct E8m0Rceil {
  using stored_t = uint8_t;
  static constexpr bool supports(Fp8Format f) { return f == Fp8Format::kE4M3FN; }
  template <Fp8Format F>
  static MOE_FP8_HD ScaleCode<uint8_t> from_amax_bits(uint32_t amax_bits) {
    static_assert(F == Fp8Format::kE4M3FN, "MXFP8 data is float8_e4m3fn");
    const uint32_t b = e8m0_rceil_from_amax_bits(amax_bits);
    return {e8m0_rceil_multiplier(b), static_cast<uint8_t>(b)};
  }
};

enum class ScaleRuleKind : int { kFp32Pow2 = 0, kFp32Exact = 1, kE8m0Floor = 2, kE8m0Rceil = 3 };

// ---- blocks ---------------------------------------------------------------------------

// Elements of the reduced dimension per scale; kWholeSet reduces the whole set (a row,
// an expert's column, a token group's column) to one scale.
constexpr int kWholeSet = 0;

// ---- scale layouts ----------------------------------------------------------------------

// Swizzled index of scale (r, c) in a blocked matrix of padded width `padded_cols` (a multiple of 4): 128x4 tiles of
// 512 bytes, row-major over tiles, (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4 inside (torchao's to_blocked; the
// layout tcgen05 and cuBLAS read).
MOE_FP8_HD int64_t blocked_scale_index(int64_t r, int64_t c, int64_t padded_cols) {
  return ((r / 128) * (padded_cols / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + (c % 4);
}

// How the segments of a launch place their part of a blocked scale matrix.
enum class BlockedGroups : int {
  kNone = 0,     // plain (one matrix), or per expert: segment s at s * seg_stride
  kMGroups = 1,  // token groups along the rows: group g starts at row sum_{j<g} ceil128(n_j)
  kKGroups = 2,  // token groups along the contraction (the grouped GEMM's 2-D x 2-D scales): group g's scales are
                 // a blocked matrix of their own (width ceil4(ceil(n_g / block))), contiguous from flat offset
                 // padded_rows * sum_{j<g} ceil4(...)
};

// Where a scale goes: (seg, set, blk) = (batch / expert / token group, reduction set within it, block along the reduced
// dimension); LinearScales and BlockedScales below give the index. Blocked padding is zero: a rows launch writes it,
// the op allocates a cols launch's buffer zeroed.
struct ScaleOut {
  void* ptr = nullptr;
  int64_t numel = 0;  // writes outside [0, numel) are dropped: no offs content reaches past it
  int64_t seg_stride = 0;
  int64_t set_stride = 0;
  int64_t blk_stride = 0;
  // blocked only
  int64_t padded_cols = 0;
  int64_t padded_rows = 0;         // kKGroups: ceil128(rows of the scale matrix)
  BlockedGroups groups = BlockedGroups::kNone;
  int block = 32;                  // kKGroups: elements per block (columns per group from n_j)
};

struct LinearScales {
  static constexpr bool kBlocked = false;
  static MOE_FP8_HD int64_t index(const ScaleOut& s, int64_t seg, int64_t set, int64_t blk, int64_t row_base,
                                  int64_t col_base, int64_t /*group_cols*/ = 0) {
    return seg * s.seg_stride + (set + row_base) * s.set_stride + (blk + col_base) * s.blk_stride;
  }
};

struct BlockedScales {
  static constexpr bool kBlocked = true;
  // row_base / col_base: the group's start row (M groups) or block column (K groups),
  // 0 otherwise; group_cols: the K group's own padded width. The caller resolves them
  // once per segment.
  static MOE_FP8_HD int64_t index(const ScaleOut& s, int64_t seg, int64_t set, int64_t blk, int64_t row_base,
                                  int64_t col_base, int64_t group_cols = 0) {
    if (s.groups == BlockedGroups::kKGroups) return s.padded_rows * col_base + blocked_scale_index(set, blk, group_cols);
    return seg * s.seg_stride + blocked_scale_index(set + row_base, blk + col_base, s.padded_cols);
  }
};

enum class ScaleLayoutKind : int { kLinear = 0, kBlocked = 1 };

// The padded extent of a token group of rows [a, b) in a grouped blocked layout: rows
// for M groups (ceil128 of its size), block columns for K groups (ceil4 of its blocks).
MOE_FP8_HD int64_t blocked_group_extent(const ScaleOut& s, int64_t a, int64_t b) {
  return s.groups == BlockedGroups::kMGroups ? round_up(b - a, int64_t{128})
                                             : round_up(ceil_div(b - a, static_cast<int64_t>(s.block)), int64_t{4});
}

// The blocked start of token group g (rows for M groups, block columns for K groups):
// the sum of the padded extents of the groups before it, from the clamped offs.
MOE_FP8_HD int64_t blocked_group_start(const ScaleOut& s, const int32_t* offs, int g, int64_t rows) {
  if (s.groups == BlockedGroups::kNone || g <= 0) return 0;
  int64_t start = 0;
  for (int j = 0; j < g; ++j) {
    int64_t a, b;
    group_range(offs, j, rows, &a, &b);
    start += blocked_group_extent(s, a, b);
  }
  return start;
}

}  // namespace moe_fp8
