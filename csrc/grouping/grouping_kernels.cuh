// Device code of the token-group family (grouping.h): padded offsets, the row-copy
// kernel behind pad / unpad / gather, the expert-parallel permutation indices, an
// index inversion, dequantize_rows and sum_rows. Raw pointers, sizes and a stream only (no torch headers).
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "../core/device_runtime.h"
#include "../core/dispatch.h"
#include "../core/numerics.h"
#include "../core/portability.h"
#include "../core/scan.cuh"
#include "../core/vec.cuh"
#include "grouping.h"

namespace moe_fp8 {

constexpr int kGroupingThreads = 256;
// Group tables up to this size are copied (or computed) into each block's shared
// memory; larger ones are read from global memory (still correct, more L2 traffic).
constexpr int kTableSmemGroups = 4096;
constexpr int kRowUnroll = 4;  // vectors in flight per lane before the stores

// Padded starts (and ends, unless pend is null) of every group, by one block: the
// padded size of group g is its clamped size rounded up to the alignment.
MOE_FP8_DEVICE void block_padded_offsets(const int32_t* offs, int groups, int64_t rows, int64_t alignment,
                                         int32_t* pstart, int32_t* pend, int64_t* s_tmp) {
  auto padded = [&](int g) {
    int64_t s, e;
    group_range(offs, g, rows, &s, &e);
    return round_up(e - s, alignment);
  };
  block_exclusive_scan(padded, groups, pstart, s_tmp);
  if (pend == nullptr) return;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    const int64_t end = static_cast<int64_t>(pstart[g]) + padded(g);
    pend[g] = static_cast<int32_t>(end < INT32_MAX ? end : INT32_MAX);
  }
  __syncthreads();
}

__global__ void __launch_bounds__(1024) padded_offsets_kernel(const int32_t* __restrict__ offs, int groups,
                                                              int64_t rows, int64_t alignment, int32_t* pstart,
                                                              int32_t* pend) {
  __shared__ int64_t s_tmp[kMaxWarpsPerBlock];
  block_padded_offsets(offs, groups, rows, alignment, pstart, pend, s_tmp);
}

// dst row r <- src row map(r) or zeros; a warp per row, persistent over rows. V is
// the widest access that divides the row, both strides and both bases.
template <typename V, RowMapKind kKind>
__global__ void __launch_bounds__(kGroupingThreads) copy_rows_kernel(RowCopy c, RowMapArgs m, bool tables_in_smem) {
  extern __shared__ int32_t s_tables[];  // [groups] offs, [groups] padded starts (tables_in_smem)
  __shared__ int64_t s_tmp[kMaxWarpsPerBlock];
  GroupLayout l = m.layout;
  if (kKind != RowMapKind::kGather && tables_in_smem) {
    int32_t* s_offs = s_tables;
    int32_t* s_pstart = s_tables + l.groups;
    for (int g = threadIdx.x; g < l.groups; g += blockDim.x) s_offs[g] = l.offs[g];
    if (!m.compute_pstart) {
      for (int g = threadIdx.x; g < l.groups; g += blockDim.x) s_pstart[g] = l.pstart[g];
    }
    __syncthreads();
    if (m.compute_pstart) {
      // Block 0 also writes the op's padded ends (and starts, below).
      block_padded_offsets(s_offs, l.groups, l.rows, m.alignment, s_pstart, blockIdx.x == 0 ? m.pend_out : nullptr,
                           s_tmp);
      if (blockIdx.x == 0) {
        for (int g = threadIdx.x; g < l.groups; g += blockDim.x) m.pstart_out[g] = s_pstart[g];
      }
    }
    l.offs = s_offs;
    l.pstart = s_pstart;
  }
  const int lane = threadIdx.x % kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  const int64_t nv = c.row_bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / kWarpSize; r < c.dst_rows;
       r += static_cast<int64_t>(gridDim.x) * warps) {
    int64_t s;
    if constexpr (kKind == RowMapKind::kPad) s = pad_source_row(l, r);
    else if constexpr (kKind == RowMapKind::kUnpad) s = unpad_source_row(l, r);
    else s = m.indices[r];
    V* d = reinterpret_cast<V*>(c.dst + r * c.dst_stride);
    if (s < 0 || s >= c.src_rows) {
      const V zero{};
      for (int64_t v = lane; v < nv; v += kWarpSize) d[v] = zero;
      continue;
    }
    const V* sp = reinterpret_cast<const V*>(c.src + s * c.src_stride);
    int64_t v = lane;
    for (; v + (kRowUnroll - 1) * kWarpSize < nv; v += kRowUnroll * kWarpSize) {
      V buf[kRowUnroll];
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) buf[u] = sp[v + u * kWarpSize];
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) d[v + u * kWarpSize] = buf[u];
    }
    for (; v < nv; v += kWarpSize) d[v] = sp[v];
  }
}

// The padded expert-major layout of tokens that arrive rank-major (DESIGN §8). Every
// block rebuilds the small tables in shared memory, block 0 writes the padded sizes
// and ends, and all blocks fill the index slots.
__global__ void __launch_bounds__(1024) permute_indices_kernel(PermuteArgs p) {
  extern __shared__ int32_t s_perm[];
  __shared__ int64_t s_tmp[kMaxWarpsPerBlock];
  const int E = p.experts, R = p.ranks, n = E * R;
  int32_t* s_cnt = s_perm;          // [n] rank-major counts, negatives as 0
  int32_t* s_start = s_cnt + n;     // [n] first source row of (rank, expert)
  int32_t* s_cum = s_start + n;     // [n] expert-major exclusive sums, index e * R + r
  int32_t* s_pstart = s_cum + n;    // [E] padded start of each expert
  int32_t* s_total = s_pstart + E;  // [E] tokens of each expert
  for (int i = threadIdx.x; i < n; i += blockDim.x) s_cnt[i] = max(p.counts[i], 0);
  __syncthreads();
  block_exclusive_scan([&](int i) { return static_cast<int64_t>(s_cnt[i]); }, n, s_start, s_tmp);
  const int64_t all = block_exclusive_scan(
      [&](int j) { return static_cast<int64_t>(s_cnt[(j % R) * E + j / R]); }, n, s_cum, s_tmp);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int64_t next = e + 1 < E ? static_cast<int64_t>(s_cum[(e + 1) * R]) : all;
    s_total[e] = static_cast<int32_t>(std::min<int64_t>(next - s_cum[e * R], INT32_MAX));
  }
  __syncthreads();
  auto padded = [&](int e) { return expert_padded_size(s_total[e], p.alignment); };
  block_exclusive_scan(padded, E, s_pstart, s_tmp);
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const int64_t size = padded(e);
      const int64_t end = static_cast<int64_t>(s_pstart[e]) + size;
      p.padded_sizes[e] = static_cast<int32_t>(std::min<int64_t>(size, INT32_MAX));
      p.padded_ends[e] = static_cast<int32_t>(std::min<int64_t>(end, INT32_MAX));
    }
  }
  for (int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; slot < p.max_len;
       slot += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int32_t src = -1;
    const int e = last_at_most(s_pstart, E, slot);
    if (e >= 0) {
      const int64_t pos = slot - s_pstart[e];
      if (pos < s_total[e]) {
        const int32_t* cum = s_cum + static_cast<int64_t>(e) * R;
        const int r = last_at_most(cum, R, cum[0] + pos);
        src = static_cast<int32_t>(s_start[r * E + e] + (cum[0] + pos - cum[r]));
      }
    }
    p.indices[slot] = src;
  }
}

__global__ void invert_indices_kernel(const int32_t* __restrict__ indices, int64_t n, int32_t* inverse,
                                      int64_t inverse_len) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t i = indices[j];
    if (i >= 0 && i < inverse_len) inverse[i] = static_cast<int32_t>(j);
  }
}

// Rows of x at or past the last group end (clamp(offs[G-1])) become zeros; the rows
// before it are not touched. Warps start at the first such row, so the work is the
// tail's size whatever M is.
template <typename V>
__global__ void __launch_bounds__(kGroupingThreads) zero_rows_past_groups_kernel(uint8_t* x, int64_t rows,
                                                                                  int64_t stride, int64_t row_bytes,
                                                                                  const int32_t* __restrict__ offs,
                                                                                  int groups) {
  const int64_t end = groups > 0 ? clamp_offset(offs[groups - 1], rows) : 0;
  const int lane = threadIdx.x % kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  const int64_t nv = row_bytes / static_cast<int64_t>(sizeof(V));
  const V zero{};
  for (int64_t r = end + static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / kWarpSize; r < rows;
       r += static_cast<int64_t>(gridDim.x) * warps) {
    V* d = reinterpret_cast<V*>(x + r * stride);
    for (int64_t v = lane; v < nv; v += kWarpSize) d[v] = zero;
  }
}

// fn(r, c) for each run of V elements (row r, columns [c, c + V)) of a rows x cols
// array, V dividing cols: a thread a run, grid-stride.
template <int V, typename Fn>
MOE_FP8_DEVICE void for_each_row_vector(int64_t rows, int64_t cols, Fn&& fn) {
  const int64_t per_row = cols / V;
  const int64_t n = rows * per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row;
    fn(r, (i - r * per_row) * V);
  }
}

// dequantize_rows (grouping.h): V consecutive elements of one row a thread (V divides
// cols, and block or the run is in one block: one scale, one V-byte load, one store).
template <Fp8Format F, InputKind O, int V>
__global__ void __launch_bounds__(kGroupingThreads) dequantize_rows_kernel(DequantRows a) {
  using T = typename RowsOut<O>::T;
  struct alignas(sizeof(T) * V) Out {
    T v[V];
  };
  struct alignas(V) In {
    uint8_t b[V];
  };
  for_each_row_vector<V>(a.rows, a.cols, [&](int64_t r, int64_t c) {
    const float s = a.scale[r * a.scale_cols + c / a.block];
    const In in = *reinterpret_cast<const In*>(a.q + r * a.cols + c);
    Out out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = dequantize_value<F, O>(in.b[k], s);
    *reinterpret_cast<Out*>(static_cast<T*>(a.y) + r * a.cols + c) = out;
  });
}

// sum_rows (grouping.h): V consecutive elements of one output row a thread, its rows'
// vectors loaded four at a time and added in order (V divides cols, stride and bases).
template <InputKind K, int V>
__global__ void __launch_bounds__(kGroupingThreads) sum_rows_kernel(SumRows a) {
  using S = ElemBits<K>;
  using T = typename S::storage;
  using Vec = Array<T, V>;
  constexpr int kAhead = 4;
  const T* x = static_cast<const T*>(a.x);
  for_each_row_vector<V>(a.rows, a.cols, [&](int64_t r, int64_t c) {
    int64_t j, end;
    group_range(a.offs, static_cast<int>(r), a.num_indices, &j, &end);
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.0f;
    while (j < end) {
      Vec v[kAhead];
      int32_t src[kAhead];
      bool ok[kAhead];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        src[u] = j + u < end ? a.indices[j + u] : -1;
        ok[u] = src[u] >= 0 && src[u] < a.x_rows;
        if (ok[u]) v[u] = *reinterpret_cast<const Vec*>(x + src[u] * a.x_stride + c);
      }
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        if (!ok[u]) continue;
        if (a.scale == nullptr) {
#pragma unroll
          for (int k = 0; k < V; ++k) acc[k] = S::round(acc[k] + S::to_float(v[u].v[k]));
        } else {
          const float s = a.scale[src[u]];
#pragma unroll
          for (int k = 0; k < V; ++k) acc[k] = S::round(f_add(acc[k], S::round(f_mul(S::to_float(v[u].v[k]), s))));
        }
      }
      j += kAhead;
    }
    Vec out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = S::from_float(acc[k]);
    *reinterpret_cast<Vec*>(static_cast<T*>(a.y) + r * a.cols + c) = out;
  });
}

// combine_rows_backward (grouping.h): kDotLanes threads a row, lane l on the kDotChunk-column
// chunks l, l + kDotLanes, ...; V = kDotChunk loads a chunk at once (V divides cols, strides, bases).
template <InputKind K, int V>
__global__ void __launch_bounds__(kGroupingThreads) combine_rows_backward_kernel(CombineBackward a) {
  using S = ElemBits<K>;
  using T = typename S::storage;
  using Vec = Array<T, V>;
  const int lane = threadIdx.x % kDotLanes;
  const int64_t per_block = blockDim.x / kDotLanes;
  const T* grad = static_cast<const T*>(a.grad);
  const T* x = static_cast<const T*>(a.x);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * per_block + threadIdx.x / kDotLanes; r < a.rows;
       r += static_cast<int64_t>(gridDim.x) * per_block) {
    const int32_t t = a.token[r];
    const bool live = t >= 0 && t < a.grad_rows;
    const float s = a.scale[r];
    const T* g = grad + (live ? t : 0) * a.grad_stride;
    const T* xr = x + r * a.x_stride;
    T* out = static_cast<T*>(a.grad_x) + r * a.cols;
    float dot = 0.0f;
    for (int64_t c0 = static_cast<int64_t>(lane) * kDotChunk; c0 < a.cols; c0 += kDotLanes * kDotChunk) {
      const int64_t n = a.cols - c0 < kDotChunk ? a.cols - c0 : kDotChunk;
      for (int64_t c = c0; c < c0 + n; c += V) {
        Vec gv, xv, ov;
        if (live) {
          gv = *reinterpret_cast<const Vec*>(g + c);
          xv = *reinterpret_cast<const Vec*>(xr + c);
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
          if (live) {
            const float gc = S::to_float(gv.v[k]);
            ov.v[k] = S::from_float(f_mul(gc, s));
            dot = f_add(dot, f_mul(gc, S::to_float(xv.v[k])));
          } else {
            ov.v[k] = S::from_float(0.0f);
          }
        }
        *reinterpret_cast<Vec*>(out + c) = ov;
      }
    }
#pragma unroll
    for (int off = kDotLanes / 2; off > 0; off /= 2) dot = f_add(dot, bits_float(warp_shfl_xor(float_bits(dot), off)));
    if (lane == 0) a.grad_scale[r] = dot;
  }
}

// ---- launchers ---------------------------------------------------------------------

inline int launch_padded_offsets(const int32_t* offs, int groups, int64_t rows, int64_t alignment, int32_t* pstart,
                                 int32_t* pend, gpuStream_t stream) {
  if (groups == 0) return 0;
  return launch_kernel(padded_offsets_kernel, dim3(1), dim3(1024), 0, stream, 1, offs, groups, rows, alignment,
                       pstart, pend);
}

template <typename V, RowMapKind kKind>
int launch_copy_rows_as(const RowCopy& c, const RowMapArgs& m, gpuStream_t stream) {
  const bool smem_tables = kKind != RowMapKind::kGather && m.layout.groups <= kTableSmemGroups;
  const size_t smem = smem_tables ? static_cast<size_t>(2 * m.layout.groups) * sizeof(int32_t) : 0;
  auto kernel = copy_rows_kernel<V, kKind>;
  const int64_t warps = kGroupingThreads / kWarpSize;
  const int64_t resident = static_cast<int64_t>(resident_blocks(kernel, kGroupingThreads, smem)) * multiprocessor_count();
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(c.dst_rows, warps), resident));
  return launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kGroupingThreads), smem, stream, 1, c, m,
                       smem_tables);
}

// Calls fn(V{}) with the widest access type V that divides the row length, every
// stride and every base address (all in bytes).
template <typename Fn>
int with_row_vector(int64_t row_bytes, std::initializer_list<int64_t> strides,
                    std::initializer_list<const void*> bases, Fn&& fn) {
  auto fits = [&](int64_t w) {
    bool ok = row_bytes % w == 0;
    for (int64_t s : strides) ok = ok && s % w == 0;
    for (const void* b : bases) ok = ok && reinterpret_cast<uintptr_t>(b) % w == 0;
    return ok;
  };
  if (fits(16)) return fn(uint4{});
  if (fits(8)) return fn(uint2{});
  if (fits(4)) return fn(uint32_t{});
  if (fits(2)) return fn(uint16_t{});
  return fn(uint8_t{});
}

template <RowMapKind kKind>
int launch_copy_rows_kind(const RowCopy& c, const RowMapArgs& m, gpuStream_t stream) {
  return with_row_vector(c.row_bytes, {c.src_stride, c.dst_stride}, {c.src, c.dst}, [&](auto v) {
    return launch_copy_rows_as<decltype(v), kKind>(c, m, stream);
  });
}

inline int launch_copy_rows(const RowCopy& c, const RowMapArgs& m, gpuStream_t stream) {
  if (c.dst_rows == 0) return 0;
  RowMapArgs mm = m;
  if (m.kind == RowMapKind::kPad && m.compute_pstart && m.layout.groups > kTableSmemGroups) {
    // Too many groups for the per-block tables: one block computes the padded offsets
    // into the outputs first, and the copy reads them from there.
    const int err = launch_padded_offsets(m.layout.offs, m.layout.groups, m.layout.rows, m.alignment, m.pstart_out,
                                          m.pend_out, stream);
    if (err != 0) return err;
    mm.compute_pstart = false;
    mm.layout.pstart = m.pstart_out;
  }
  switch (mm.kind) {
    case RowMapKind::kPad: return launch_copy_rows_kind<RowMapKind::kPad>(c, mm, stream);
    case RowMapKind::kUnpad: return launch_copy_rows_kind<RowMapKind::kUnpad>(c, mm, stream);
    case RowMapKind::kGather: return launch_copy_rows_kind<RowMapKind::kGather>(c, mm, stream);
  }
  return 0;
}

inline size_t permute_smem_bytes(const PermuteArgs& p) {
  return (3 * static_cast<size_t>(p.experts) * p.ranks + 2 * static_cast<size_t>(p.experts)) * sizeof(int32_t);
}

inline int launch_permute_indices(const PermuteArgs& p, gpuStream_t stream) {
  const size_t smem = permute_smem_bytes(p);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(p.max_len, 4096), 2 * multiprocessor_count()));
  return launch_kernel(permute_indices_kernel, dim3(static_cast<unsigned>(blocks)), dim3(1024), smem, stream, 1, p);
}

inline int launch_invert_indices(const int32_t* indices, int64_t n, int32_t* inverse, int64_t inverse_len,
                                 gpuStream_t stream) {
  if (n == 0) return 0;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, 256), 4 * multiprocessor_count()));
  return launch_kernel(invert_indices_kernel, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream, 1, indices, n,
                       inverse, inverse_len);
}

inline int launch_zero_rows_past_groups(uint8_t* x, int64_t rows, int64_t stride, int64_t row_bytes,
                                        const int32_t* offs, int groups, gpuStream_t stream) {
  if (rows == 0 || row_bytes == 0) return 0;
  return with_row_vector(row_bytes, {stride}, {x}, [&](auto v) {
    auto kernel = zero_rows_past_groups_kernel<decltype(v)>;
    // Usually the tail is empty and every block exits at once: keep the grid small.
    const int64_t warps = kGroupingThreads / kWarpSize;
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(rows, warps), 2 * multiprocessor_count()));
    return launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kGroupingThreads), 0, stream, 1, x, rows,
                         stride, row_bytes, offs, groups);
  });
}

template <Fp8Format F, InputKind O, int V>
int launch_dequantize_rows_as(const DequantRows& a, gpuStream_t stream) {
  auto kernel = dequantize_rows_kernel<F, O, V>;
  const int64_t n = a.rows * (a.cols / V);
  const int64_t resident = static_cast<int64_t>(resident_blocks(kernel, kGroupingThreads, 0)) * multiprocessor_count();
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, kGroupingThreads), resident));
  return launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kGroupingThreads), 0, stream, 1, a);
}

inline int launch_dequantize_rows(const DequantRows& a, gpuStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return 0;
  int err = 0;
  dispatch_input_fp8(a.out, a.fmt, [&](auto o, auto f) {
    constexpr InputKind O = decltype(o)::value;
    constexpr Fp8Format F = decltype(f)::value;
    // V = 8: 8-element runs stay in one block and every access is aligned
    const bool vec = a.cols % 8 == 0 && (a.block % 8 == 0 || a.block >= a.cols) &&
                     reinterpret_cast<uintptr_t>(a.q) % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(a.y) % (8 * sizeof(typename RowsOut<O>::T)) == 0;
    err = vec ? launch_dequantize_rows_as<F, O, 8>(a, stream) : launch_dequantize_rows_as<F, O, 1>(a, stream);
  });
  return err;
}

template <InputKind K, int V>
int launch_sum_rows_as(const SumRows& a, gpuStream_t stream) {
  auto kernel = sum_rows_kernel<K, V>;
  const int64_t n = a.rows * (a.cols / V);
  const int64_t resident = static_cast<int64_t>(resident_blocks(kernel, kGroupingThreads, 0)) * multiprocessor_count();
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, kGroupingThreads), resident));
  return launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kGroupingThreads), 0, stream, 1, a);
}

template <InputKind K>
int launch_sum_rows_kind(const SumRows& a, gpuStream_t stream) {
  using T = typename ElemBits<K>::storage;
  constexpr int kV = 16 / static_cast<int>(sizeof(T));
  const bool vec = a.cols % kV == 0 && a.x_stride % kV == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(a.y) % 16 == 0;
  return vec ? launch_sum_rows_as<K, kV>(a, stream) : launch_sum_rows_as<K, 1>(a, stream);
}

template <InputKind K, int V>
int launch_combine_rows_backward_as(const CombineBackward& a, gpuStream_t stream) {
  auto kernel = combine_rows_backward_kernel<K, V>;
  const int64_t per_block = kGroupingThreads / kDotLanes;
  const int64_t resident = static_cast<int64_t>(resident_blocks(kernel, kGroupingThreads, 0)) * multiprocessor_count();
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(a.rows, per_block), resident));
  return launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kGroupingThreads), 0, stream, 1, a);
}

template <InputKind K>
int launch_combine_rows_backward_kind(const CombineBackward& a, gpuStream_t stream) {
  using T = typename ElemBits<K>::storage;
  constexpr int kAlign = kDotChunk * static_cast<int>(sizeof(T));
  const bool vec = a.cols % kDotChunk == 0 && a.grad_stride % kDotChunk == 0 && a.x_stride % kDotChunk == 0 &&
                   reinterpret_cast<uintptr_t>(a.grad) % kAlign == 0 && reinterpret_cast<uintptr_t>(a.x) % kAlign == 0 &&
                   reinterpret_cast<uintptr_t>(a.grad_x) % kAlign == 0;
  return vec ? launch_combine_rows_backward_as<K, kDotChunk>(a, stream) : launch_combine_rows_backward_as<K, 1>(a, stream);
}

inline int launch_combine_rows_backward(const CombineBackward& a, gpuStream_t stream) {
  if (a.rows == 0) return 0;
  switch (a.kind) {
    case InputKind::kBF16: return launch_combine_rows_backward_kind<InputKind::kBF16>(a, stream);
    case InputKind::kFP16: return launch_combine_rows_backward_kind<InputKind::kFP16>(a, stream);
    default: return launch_combine_rows_backward_kind<InputKind::kFP32>(a, stream);
  }
}

inline int launch_sum_rows(const SumRows& a, gpuStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return 0;
  switch (a.kind) {
    case InputKind::kBF16: return launch_sum_rows_kind<InputKind::kBF16>(a, stream);
    case InputKind::kFP16: return launch_sum_rows_kind<InputKind::kFP16>(a, stream);
    default: return launch_sum_rows_kind<InputKind::kFP32>(a, stream);
  }
}

}  // namespace moe_fp8
