// CPU implementation of the token-group family: the same index math as the GPU
// kernels (grouping.h), in plain loops, and the family's CPU registration.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../core/dispatch.h"
#include "grouping.h"
#include "grouping_ops.h"

namespace moe_fp8 {
namespace {

void padded_offsets_cpu(const int32_t* offs, int groups, int64_t rows, int64_t alignment, int32_t* pstart,
                        int32_t* pend, int /*device*/ = -1) {
  int64_t run = 0;
  for (int g = 0; g < groups; ++g) {
    int64_t s, e;
    group_range(offs, g, rows, &s, &e);
    pstart[g] = static_cast<int32_t>(std::min<int64_t>(run, INT32_MAX));
    run += round_up(e - s, alignment);
    pend[g] = static_cast<int32_t>(std::min<int64_t>(run, INT32_MAX));
  }
}

void copy_rows_cpu(const RowCopy& c, const RowMapArgs& m, int /*device*/) {
  GroupLayout l = m.layout;
  if (m.kind == RowMapKind::kPad && m.compute_pstart) {
    padded_offsets_cpu(l.offs, l.groups, l.rows, m.alignment, m.pstart_out, m.pend_out);
    l.pstart = m.pstart_out;
  }
  at::parallel_for(0, c.dst_rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t s;
      switch (m.kind) {
        case RowMapKind::kPad: s = pad_source_row(l, r); break;
        case RowMapKind::kUnpad: s = unpad_source_row(l, r); break;
        default: s = m.indices[r]; break;
      }
      uint8_t* d = c.dst + r * c.dst_stride;
      if (s < 0 || s >= c.src_rows) {
        std::memset(d, 0, static_cast<size_t>(c.row_bytes));
      } else {
        std::memcpy(d, c.src + s * c.src_stride, static_cast<size_t>(c.row_bytes));
      }
    }
  });
}

void permute_indices_cpu(const PermuteArgs& p, int /*device*/) {
  const int E = p.experts, R = p.ranks;
  std::vector<int64_t> start(static_cast<size_t>(E) * R), total(E, 0);
  int64_t run = 0;
  for (int i = 0; i < E * R; ++i) {
    start[i] = run;
    run += std::max(p.counts[i], 0);
  }
  for (int r = 0; r < R; ++r) {
    for (int e = 0; e < E; ++e) total[e] += std::max(p.counts[r * E + e], 0);
  }
  std::fill(p.indices, p.indices + p.max_len, -1);
  int64_t slot = 0;
  for (int e = 0; e < E; ++e) {
    const int64_t size = expert_padded_size(total[e], p.alignment);
    p.padded_sizes[e] = static_cast<int32_t>(std::min<int64_t>(size, INT32_MAX));
    int64_t k = slot;
    for (int r = 0; r < R; ++r) {  // this expert's tokens, rank by rank
      const int64_t n = std::max(p.counts[r * E + e], 0);
      for (int64_t j = 0; j < n; ++j, ++k) {
        if (k < p.max_len) p.indices[k] = static_cast<int32_t>(start[r * E + e] + j);
      }
    }
    slot += size;
    p.padded_ends[e] = static_cast<int32_t>(std::min<int64_t>(slot, INT32_MAX));
  }
}

void zero_rows_past_groups_cpu(uint8_t* x, int64_t rows, int64_t stride, int64_t row_bytes, const int32_t* offs,
                               int groups, int /*device*/) {
  const int64_t end = groups > 0 ? clamp_offset(offs[groups - 1], rows) : 0;
  for (int64_t r = end; r < rows; ++r) std::memset(x + r * stride, 0, static_cast<size_t>(row_bytes));
}

void invert_indices_cpu(const int32_t* indices, int64_t n, int32_t* inverse, int64_t inverse_len, int /*device*/) {
  std::fill(inverse, inverse + inverse_len, -1);
  for (int64_t j = 0; j < n; ++j) {
    if (indices[j] >= 0 && indices[j] < inverse_len) inverse[indices[j]] = static_cast<int32_t>(j);
  }
}

void dequantize_rows_cpu(const DequantRows& a, int /*device*/) {
  dispatch_input_fp8(a.out, a.fmt, [&](auto o, auto f) {
    constexpr InputKind O = decltype(o)::value;
    constexpr Fp8Format F = decltype(f)::value;
    auto* y = static_cast<typename RowsOut<O>::T*>(a.y);
    at::parallel_for(0, a.rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t c = 0; c < a.cols; ++c) {
          y[r * a.cols + c] = dequantize_value<F, O>(a.q[r * a.cols + c], a.scale[r * a.scale_cols + c / a.block]);
        }
      }
    });
  });
}

template <InputKind K>
void sum_rows_as(const SumRows& a) {
  using S = ElemBits<K>;
  using T = typename S::storage;
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  at::parallel_for(0, a.rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(a.cols));
    for (int64_t r = begin; r < end; ++r) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      int64_t j, stop;
      group_range(a.offs, static_cast<int>(r), a.num_indices, &j, &stop);
      for (; j < stop; ++j) {
        const int32_t src = a.indices[j];
        if (src < 0 || src >= a.x_rows) continue;
        const T* row = x + src * a.x_stride;
        if (a.scale == nullptr) {
          for (int64_t c = 0; c < a.cols; ++c) acc[c] = S::round(acc[c] + S::to_float(row[c]));
        } else {
          const float s = a.scale[src];
          for (int64_t c = 0; c < a.cols; ++c) acc[c] = S::round(f_add(acc[c], S::round(f_mul(S::to_float(row[c]), s))));
        }
      }
      for (int64_t c = 0; c < a.cols; ++c) y[r * a.cols + c] = S::from_float(acc[c]);
    }
  });
}

void sum_rows_cpu(const SumRows& a, int /*device*/) {
  switch (a.kind) {
    case InputKind::kBF16: return sum_rows_as<InputKind::kBF16>(a);
    case InputKind::kFP16: return sum_rows_as<InputKind::kFP16>(a);
    default: return sum_rows_as<InputKind::kFP32>(a);
  }
}

template <InputKind K>
void combine_rows_backward_as(const CombineBackward& a) {
  using S = ElemBits<K>;
  using T = typename S::storage;
  const T* grad = static_cast<const T*>(a.grad);
  const T* x = static_cast<const T*>(a.x);
  T* gx = static_cast<T*>(a.grad_x);
  at::parallel_for(0, a.rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t t = a.token[r];
      T* out = gx + r * a.cols;
      if (t < 0 || t >= a.grad_rows) {
        std::fill(out, out + a.cols, S::from_float(0.0f));
        a.grad_scale[r] = 0.0f;
        continue;
      }
      const T* g = grad + t * a.grad_stride;
      const T* xr = x + r * a.x_stride;
      const float s = a.scale[r];
      float part[kDotLanes] = {};
      for (int64_t c = 0; c < a.cols; ++c) {
        const float gc = S::to_float(g[c]);
        out[c] = S::from_float(f_mul(gc, s));
        float& p = part[(c / kDotChunk) % kDotLanes];
        p = f_add(p, f_mul(gc, S::to_float(xr[c])));
      }
      for (int off = kDotLanes / 2; off > 0; off /= 2) {
        for (int l = 0; l < off; ++l) part[l] = f_add(part[l], part[l + off]);
      }
      a.grad_scale[r] = part[0];
    }
  });
}

void combine_rows_backward_cpu(const CombineBackward& a, int /*device*/) {
  switch (a.kind) {
    case InputKind::kBF16: return combine_rows_backward_as<InputKind::kBF16>(a);
    case InputKind::kFP16: return combine_rows_backward_as<InputKind::kFP16>(a);
    default: return combine_rows_backward_as<InputKind::kFP32>(a);
  }
}

}  // namespace

extern const GroupingKernels kGroupingCpu = {
    padded_offsets_cpu, copy_rows_cpu,       permute_indices_cpu, zero_rows_past_groups_cpu,
    invert_indices_cpu, dequantize_rows_cpu, sum_rows_cpu,      combine_rows_backward_cpu,
};

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CPU, m) { moe_fp8::GroupingOn<moe_fp8::kGroupingCpu>::register_impls(m); }
