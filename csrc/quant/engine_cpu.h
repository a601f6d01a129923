// CPU twin of the quantization engine: the GPU's two shapes and policies as plain loops over core/numerics.h, so CI
// (no GPU) checks the exact rounding, scale rules and scale layouts the GPU uses. Each recipe's CPU file instantiates
// it through cpu_quant_kernels<...>().
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

#include "../core/dispatch.h"
#include "../core/float_ops.h"
#include "engine.h"

namespace moe_fp8 {
namespace engine_cpu {

template <InputKind K>
struct CpuInput;
template <>
struct CpuInput<InputKind::kBF16> {
  using type = c10::BFloat16;
};
template <>
struct CpuInput<InputKind::kFP16> {
  using type = c10::Half;
};
template <>
struct CpuInput<InputKind::kFP32> {
  using type = float;
};
// fp32 read as its bf16 rounding: the GPU's float_as_bf16.
struct Fp32AsBF16 {
  float v;
  operator float() const { return float_as_bf16(v); }
};
static_assert(sizeof(Fp32AsBF16) == sizeof(float), "read in place of fp32 elements");
template <>
struct CpuInput<InputKind::kFP32AsBF16> {
  using type = Fp32AsBF16;
};

template <class Rule>
void store_scale(const ScaleOut& s, int64_t index, typename Rule::stored_t v) {
  if (index >= 0 && index < s.numel) static_cast<typename Rule::stored_t*>(s.ptr)[index] = v;
}

template <typename T, Fp8Format F, class Rule, int kBlock, class Layout>
void rows(const RowsArgs& a) {
  constexpr float kMax = Fp8Spec<F>::kMax;
  const T* x = static_cast<const T*>(a.x);
  const int64_t block = kBlock == kWholeSet ? a.cols : kBlock;
  const int64_t nblocks = kBlock == kWholeSet ? 1 : ceil_div(a.cols, kBlock);
  // Blocked scales: a rows launch writes the whole buffer, padding zeros included.
  if (Layout::kBlocked && a.scale.numel > 0) {
    std::memset(a.scale.ptr, 0, static_cast<size_t>(a.scale.numel) * sizeof(typename Rule::stored_t));
  }
  at::parallel_for(0, a.rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + (r / a.rows_inner) * a.stride_outer + (r % a.rows_inner) * a.stride_inner;
      uint8_t* qr = a.q + rows_q_offset(a, r / a.rows_inner, r % a.rows_inner);
      for (int64_t j = 0; j < nblocks; ++j) {
        const int64_t k0 = j * block, k1 = std::min(a.cols, k0 + block);
        uint32_t amax = 0;
        for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, abs_bits(static_cast<float>(xr[k * a.stride_col])));
        const auto sc = Rule::template from_amax_bits<F>(amax);
        const int64_t si = rows_scale_index<Layout>(a, r / a.rows_inner, r % a.rows_inner, j);
        if (si >= 0) store_scale<Rule>(a.scale, si, sc.stored);
        for (int64_t k = k0; k < k1; ++k) {
          qr[k] = encode_fp8<F>(scale_clamp(static_cast<float>(xr[k * a.stride_col]), sc.encode, kMax));
        }
      }
    }
  });
}

template <typename T, Fp8Format F, class Rule, int kBlock, class Layout>
void cols(const ColsArgs& a) {
  constexpr float kMax = Fp8Spec<F>::kMax;
  const int segments = segments_with_tail(a);
  for (int o = 0; o < a.num_ops; ++o) {
    const ColsOperand& op = a.op[o];
    // One task per (segment, column): each owns its reduction sets and its q run.
    at::parallel_for(0, static_cast<int64_t>(segments) * op.cols, 64, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int seg_id = static_cast<int>(task / op.cols);
        const int64_t c = task % op.cols;
        const Segment seg = resolve_segment(a, seg_id);
        const T* xc = static_cast<const T*>(op.x) + seg.batch * op.sb + c * op.sc;
        const T* xc_hi = op.x_hi == nullptr ? nullptr : static_cast<const T*>(op.x_hi) + seg.batch * op.sb + c * op.sc;
        auto at = [&](int64_t row) {  // input row `row` of this column
          return static_cast<float>(xc_hi != nullptr && row >= op.row_split ? xc_hi[(row - op.row_split) * op.sr]
                                                                            : xc[row * op.sr]);
        };
        // q rows of this segment: its input rows first, then padding (a zero row
        // encoded with the block's scale, so NaN in a NaN block, as quantizing the
        // padded copy gives and the GPU kernel does) or the tail (zeros).
        uint8_t* qc = op.q + seg.batch * op.q_sb + c * op.q_sc + seg.q_start;
        if (seg.zero_fill) {
          std::memset(qc, 0, static_cast<size_t>(seg.q_len));
          if constexpr (kBlock != kWholeSet && !Layout::kBlocked) {
            if (a.tail_scales) {  // zero scales for the tail's blocks (ColsArgs::tail_scales)
              const int64_t col_base = cols_scale_col_base<Layout>(a, op.scale, seg_id, seg, kBlock);
              for (int64_t j = 0; j < ceil_div(seg.q_len, int64_t{kBlock}); ++j) {
                store_scale<Rule>(op.scale, Layout::index(op.scale, seg_id, c, j, 0, col_base),
                                  typename Rule::stored_t{});
              }
            }
          }
          continue;
        }
        const int64_t n = seg.end - seg.start;
        const int64_t block = kBlock == kWholeSet ? std::max<int64_t>(seg.q_len, 1) : kBlock;
        const int64_t nblocks = kBlock == kWholeSet ? 1 : ceil_div(seg.q_len, kBlock);
        const int64_t col_base = cols_scale_col_base<Layout>(a, op.scale, seg_id, seg, kBlock);
        const int64_t group_cols = round_up(nblocks, 4);  // a K group's own blocked width
        for (int64_t j = 0; j < nblocks; ++j) {
          const int64_t r0 = j * block, r1 = std::min(seg.q_len, r0 + block);
          uint32_t amax = 0;
          for (int64_t r = r0; r < std::min(r1, n); ++r) {
            amax = std::max(amax, abs_bits(at(seg.start + r)));
          }
          const auto sc = Rule::template from_amax_bits<F>(amax);
          store_scale<Rule>(op.scale, Layout::index(op.scale, seg_id, c, j, 0, col_base, group_cols), sc.stored);
          for (int64_t r = r0; r < std::min(r1, n); ++r) {
            qc[r] = encode_fp8<F>(scale_clamp(at(seg.start + r), sc.encode, kMax));
          }
          const uint8_t pad = encode_fp8<F>(scale_clamp(0.0f, sc.encode, kMax));
          for (int64_t r = std::max(r0, n); r < r1; ++r) qc[r] = pad;
        }
      }
    });
  }
}

// 128x128 tiles: the tile's amax (abs bits, NaN above Inf), its scale, every output.
template <typename T, Fp8Format F, class Rule>
void tiles(const TilesArgs& a) {
  constexpr float kMax = Fp8Spec<F>::kMax;
  const T* x = static_cast<const T*>(a.x);
  const int64_t ti = ceil_div(a.rows, kTile), tj = ceil_div(a.cols, kTile);
  at::parallel_for(0, a.batches * ti * tj, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (ti * tj), i = (t / tj) % ti, j = t % tj;
      const int64_t r0 = i * kTile, r1 = std::min(a.rows, r0 + kTile);
      const int64_t c0 = j * kTile, c1 = std::min(a.cols, c0 + kTile);
      const T* xb = x + b * a.sb;
      uint32_t amax = 0;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, abs_bits(static_cast<float>(xb[r * a.sr + c * a.sc])));
      }
      const auto sc = Rule::template from_amax_bits<F>(amax);
      for (int k = 0; k < a.num_out; ++k) {
        const TileOut& o = a.out[k];
        static_cast<typename Rule::stored_t*>(o.s)[b * o.s_sb + i * o.s_si + j * o.s_sj] = sc.stored;
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) {
            o.q[b * o.q_sb + i * o.q_si + j * o.q_sj + (r - r0) * o.q_sr + (c - c0) * o.q_sc] =
                encode_fp8<F>(scale_clamp(static_cast<float>(xb[r * a.sr + c * a.sc]), sc.encode, kMax));
          }
        }
      }
    }
  });
}

// The runners of one recipe's instantiations: policy lists -> a QuantKernels entry.
template <class Rules, class Blocks, class Layouts, bool kAsBF16>
void run_rows(InputKind in, Fp8Format fmt, const QuantSpec& spec, const RowsArgs& a, int /*device*/) {
  const auto run = [&](auto kin, auto kfmt, auto rule, auto block, auto layout) {
    using T = typename CpuInput<decltype(kin)::value>::type;
    rows<T, decltype(kfmt)::value, decltype(rule), decltype(block)::value, decltype(layout)>(a);
  };
  const bool ran = dispatch_engine<Rules, Blocks, Layouts, kAsBF16>(in, fmt, spec, run);
  TORCH_CHECK(ran, "moe_fp8: internal error: no CPU rows instantiation for this scale rule, block and layout");
}

template <class Rules, class Blocks, class Layouts, bool kAsBF16>
void run_cols(InputKind in, Fp8Format fmt, const QuantSpec& spec, const ColsArgs& a, int64_t /*expected*/,
              int /*device*/) {
  const auto run = [&](auto kin, auto kfmt, auto rule, auto block, auto layout) {
    using T = typename CpuInput<decltype(kin)::value>::type;
    cols<T, decltype(kfmt)::value, decltype(rule), decltype(block)::value, decltype(layout)>(a);
  };
  const bool ran = dispatch_engine<Rules, Blocks, Layouts, kAsBF16>(in, fmt, spec, run);
  TORCH_CHECK(ran, "moe_fp8: internal error: no CPU cols instantiation for this scale rule, block and layout");
}

template <class Rule, typename T, Fp8Format F>
bool try_tiles(ScaleRuleKind rule, const TilesArgs& a) {
  if constexpr (Rule::supports(F)) {
    if (rule_kind<Rule>() != rule) return false;
    tiles<T, F, Rule>(a);
    return true;
  } else {
    return false;
  }
}

// The first rule of the list that is `rule` (and supports F) runs.
template <typename T, Fp8Format F, class... Rules>
bool any_tiles(RuleList<Rules...>, ScaleRuleKind rule, const TilesArgs& a) {
  return (try_tiles<Rules, T, F>(rule, a) || ...);
}

template <class Rules>
void run_tiles(InputKind in, Fp8Format fmt, ScaleRuleKind rule, const TilesArgs& a, int /*device*/) {
  bool ran = false;
  const Rules rules{};
  dispatch_input_fp8<true>(in, fmt, [&](auto kin, auto kfmt) {
    ran = any_tiles<typename CpuInput<decltype(kin)::value>::type, decltype(kfmt)::value>(rules, rule, a);
  });
  TORCH_CHECK(ran, "moe_fp8: internal error: no CPU tiles instantiation for this scale rule");
}

}  // namespace engine_cpu

template <class Rules>
constexpr TileKernels cpu_tile_kernels() {
  TileKernels k{};  // (a one-member brace list would be read as a conversion of the overload set)
  k.tiles = &engine_cpu::run_tiles<Rules>;
  return k;
}

// kAsBF16: the runners take kFP32AsBF16 too (a recipe whose weights are quantized by them).
template <class Rules, class Blocks, class Layouts, bool kAsBF16 = false>
constexpr QuantKernels cpu_quant_kernels() {
  return {&engine_cpu::run_rows<Rules, Blocks, Layouts, kAsBF16>,
          &engine_cpu::run_cols<Rules, Blocks, Layouts, kAsBF16>};
}

}  // namespace moe_fp8
