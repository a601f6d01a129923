// CPU implementation of the FP8 rowwise family: the same two shapes as the GPU
// kernels, as plain loops over the numerics of core/numerics.h, so CI (no GPU)
// checks the exact rounding and scale rules the GPU uses.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../core/dispatch.h"
#include "rowwise.h"

namespace moe_fp8 {
namespace {

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

template <typename T, Fp8Format F>
void rows_cpu(const T* x, uint8_t* q, float* scale, const RowsArgs& a) {
  constexpr float kMax = Fp8Spec<F>::kMax;
  at::parallel_for(0, a.rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + (r / a.rows_inner) * a.stride_outer + (r % a.rows_inner) * a.stride_inner;
      uint32_t amax = 0;
      for (int64_t k = 0; k < a.cols; ++k) {
        const uint32_t b = abs_bits(static_cast<float>(xr[k * a.stride_col]));
        amax = b > amax ? b : amax;
      }
      const QuantScale sc = scale_from_amax_bits(amax, kMax, a.pow2);
      scale[r] = sc.decode;
      uint8_t* qr = q + r * a.cols;
      for (int64_t k = 0; k < a.cols; ++k) {
        qr[k] = encode_fp8<F>(scale_clamp(static_cast<float>(xr[k * a.stride_col]), sc.encode, kMax));
      }
    }
  });
}

template <typename T, Fp8Format F>
void cols_cpu(const ColsArgs& a) {
  constexpr float kMax = Fp8Spec<F>::kMax;
  const int segments = segments_with_tail(a);
  for (int o = 0; o < a.num_ops; ++o) {
    const ColsOperand& op = a.op[o];
    // One task per (segment, column): each owns its reduction set and its q run.
    at::parallel_for(0, static_cast<int64_t>(segments) * op.cols, 64, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int seg_id = static_cast<int>(task / op.cols);
        const int64_t c = task % op.cols;
        const Segment seg = resolve_segment(a, seg_id);
        const T* xc = static_cast<const T*>(op.x) + seg.batch * op.sb + c * op.sc;
        // q rows of this segment: its input rows first, then padding (a zero row
        // encoded with the group's scale, so NaN in a NaN column, as quantizing the
        // padded copy gives and the GPU kernel does) or the tail (zeros).
        uint8_t* qc = op.q + seg.batch * op.q_sb + c * op.q_sc + seg.q_start;
        if (seg.zero_fill) {
          for (int64_t r = 0; r < seg.q_len; ++r) qc[r] = 0;
          continue;
        }
        uint32_t amax = 0;
        for (int64_t r = seg.start; r < seg.end; ++r) {
          const uint32_t b = abs_bits(static_cast<float>(xc[r * op.sr]));
          amax = b > amax ? b : amax;
        }
        const QuantScale sc = scale_from_amax_bits(amax, kMax, a.pow2);
        op.scale[seg_id * op.scale_ss + c] = sc.decode;
        for (int64_t r = seg.start; r < seg.end; ++r) {
          qc[r - seg.start] = encode_fp8<F>(scale_clamp(static_cast<float>(xc[r * op.sr]), sc.encode, kMax));
        }
        const uint8_t pad = encode_fp8<F>(scale_clamp(0.0f, sc.encode, kMax));
        for (int64_t r = seg.end - seg.start; r < seg.q_len; ++r) qc[r] = pad;
      }
    });
  }
}

}  // namespace

void run_rows_cpu(InputKind in, Fp8Format fmt, const void* x, uint8_t* q, float* scale,
                  const RowsArgs& a) {
  dispatch_input_fp8(in, fmt, [&](auto kin, auto kfmt) {
    using T = typename CpuInput<decltype(kin)::value>::type;
    rows_cpu<T, decltype(kfmt)::value>(static_cast<const T*>(x), q, scale, a);
  });
}

void run_cols_cpu(InputKind in, Fp8Format fmt, const ColsArgs& a) {
  dispatch_input_fp8(in, fmt, [&](auto kin, auto kfmt) {
    using T = typename CpuInput<decltype(kin)::value>::type;
    cols_cpu<T, decltype(kfmt)::value>(a);
  });
}

}  // namespace moe_fp8
