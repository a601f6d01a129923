// Device code of the FP8 rowwise family: the two kernel shapes of rowwise.h and
// their launchers. Raw pointers, sizes and a stream only (no torch headers), so the
// file can be compile-checked for any target and hipified as is.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../core/numerics.h"
#include "../core/portability.h"
#include "../core/reduce.cuh"
#include "../core/vec.cuh"
#include "rowwise.h"

namespace moe_fp8 {

// ---------------------------------------------------------------------------------
// "rows": a thread block per reduction row at a time. The first kRowsRegVecs vectors
// of each thread stay in registers between the amax pass and the encode pass, so a row
// of up to kRowsRegVecs * 1024 vectors (32K bf16) is read from memory exactly once;
// longer rows re-read the remainder (an L2 hit in practice).
// ---------------------------------------------------------------------------------
constexpr int kRowsRegVecs = 4;

template <InputKind K, int kVec>
MOE_FP8_DEVICE void load_row(const typename DeviceInput<K>::storage* xr, int64_t nvec, int64_t stride_col,
                             Array<typename DeviceInput<K>::storage, kVec> (&buf)[kRowsRegVecs]) {
#pragma unroll
  for (int j = 0; j < kRowsRegVecs; ++j) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (v < nvec) buf[j] = load_elems<typename DeviceInput<K>::storage, kVec>(xr + v * stride_col * kVec, stride_col);
  }
}

// Reduce and encode one row whose head is already in `buf` (the tail past the
// register cache is re-read).
template <InputKind K, Fp8Format F, int kVec>
MOE_FP8_DEVICE void encode_row(const typename DeviceInput<K>::storage* xr, uint8_t* qr, float* scale_r,
                               int64_t nvec, int64_t stride_col, bool pow2,
                               const Array<typename DeviceInput<K>::storage, kVec> (&buf)[kRowsRegVecs],
                               uint32_t* s_red) {
  using In = DeviceInput<K>;
  using T = typename In::storage;
  const int64_t step = stride_col * kVec;  // the vector path has stride_col == 1
  uint32_t amax = 0;
#pragma unroll
  for (int j = 0; j < kRowsRegVecs; ++j) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (v < nvec) amax = amax_bits_of<In>(buf[j], amax);
  }
  const int64_t spill = threadIdx.x + static_cast<int64_t>(kRowsRegVecs) * blockDim.x;
  for (int64_t v = spill; v < nvec; v += blockDim.x) {
    amax = amax_bits_of<In>(load_elems<T, kVec>(xr + v * step, stride_col), amax);
  }
  amax = block_max(amax, s_red);
  const QuantScale sc = scale_from_amax_bits(amax, Fp8Spec<F>::kMax, pow2);
  if (threadIdx.x == 0) *scale_r = sc.decode;
#pragma unroll
  for (int j = 0; j < kRowsRegVecs; ++j) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (v < nvec) store_elems<uint8_t, kVec>(qr + v * kVec, quantize_elems<F, In>(buf[j], sc.encode));
  }
  for (int64_t v = spill; v < nvec; v += blockDim.x) {
    const Array<T, kVec> e = load_elems<T, kVec>(xr + v * step, stride_col);
    store_elems<uint8_t, kVec>(qr + v * kVec, quantize_elems<F, In>(e, sc.encode));
  }
}

// Persistent over rows with the next row's loads in flight while the current row is
// reduced and written: a block never waits on memory with nothing requested.
template <InputKind K, Fp8Format F, int kVec>
__global__ void __launch_bounds__(1024) quantize_rows_kernel(
    const typename DeviceInput<K>::storage* __restrict__ x,  // rows addressed as in RowsArgs
    uint8_t* __restrict__ q,                                 // [rows, cols] row-major
    float* __restrict__ scale,                               // [rows]
    RowsArgs a) {
  using T = typename DeviceInput<K>::storage;
  static_assert(kVec == 1 || kVec * sizeof(T) == 16, "vector path moves 16 bytes per access");
  __shared__ uint32_t s_red[kMaxWarpsPerBlock + 1];
  const int64_t nvec = a.cols / kVec;
  auto row_ptr = [&](int64_t r) {
    return x + (r / a.rows_inner) * a.stride_outer + (r % a.rows_inner) * a.stride_inner;
  };
  Array<T, kVec> buf0[kRowsRegVecs], buf1[kRowsRegVecs];
  int64_t r = blockIdx.x;
  if (r >= a.rows) return;
  load_row<K, kVec>(row_ptr(r), nvec, a.stride_col, buf0);
  while (true) {
    int64_t next = r + gridDim.x;
    if (next < a.rows) load_row<K, kVec>(row_ptr(next), nvec, a.stride_col, buf1);
    encode_row<K, F, kVec>(row_ptr(r), q + r * a.cols, scale + r, nvec, a.stride_col, a.pow2, buf0, s_red);
    if (next >= a.rows) break;
    r = next;
    next = r + gridDim.x;
    if (next < a.rows) load_row<K, kVec>(row_ptr(next), nvec, a.stride_col, buf0);
    encode_row<K, F, kVec>(row_ptr(r), q + r * a.cols, scale + r, nvec, a.stride_col, a.pow2, buf1, s_red);
    if (next >= a.rows) break;
    r = next;
  }
}

// The vector path for rows that fit in shared memory: persistent blocks stream rows
// through a ring of kRowsStages row buffers with async copies, so that the next
// kRowsStages - 1 rows are always in flight while one row is reduced and encoded,
// and no registers are spent holding data. Two stages and about eight 16-byte
// vectors per thread measured best on H200 (sweep of 2/3/4/6 stages x 2/4/8 vectors:
// small blocks, many per SM, beat deeper rings; bench/RESULTS.md).
constexpr int kRowsStages = 2;
constexpr int kRowsVecsPerThread = 8;
constexpr int64_t kRowsMaxStageBytes = 32 * 1024;

template <InputKind K, Fp8Format F>
__global__ void __launch_bounds__(1024) quantize_rows_pipelined_kernel(
    const typename DeviceInput<K>::storage* __restrict__ x,  // rows addressed as in RowsArgs, stride_col == 1
    uint8_t* __restrict__ q,                                 // [rows, cols] row-major
    float* __restrict__ scale,                               // [rows]
    RowsArgs a) {
  using In = DeviceInput<K>;
  using T = typename In::storage;
  constexpr int kVec = 16 / sizeof(T);
  extern __shared__ uint4 ring[];  // [kRowsStages][nvec]
  __shared__ uint32_t s_red[kMaxWarpsPerBlock + 1];
  const int64_t nvec = a.cols / kVec;
  auto issue = [&](int64_t r, int stage) {
    if (r < a.rows) {
      const T* xr = x + (r / a.rows_inner) * a.stride_outer + (r % a.rows_inner) * a.stride_inner;
      for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) async_copy_16(ring + stage * nvec + v, xr + v * kVec);
    }
    async_copy_commit();  // every thread commits every time, so group counts agree
  };
  int64_t r = blockIdx.x;
#pragma unroll
  for (int s = 0; s < kRowsStages - 1; ++s) issue(r + static_cast<int64_t>(s) * gridDim.x, s);
  for (int64_t i = 0; r < a.rows; ++i, r += gridDim.x) {
    issue(r + static_cast<int64_t>(kRowsStages - 1) * gridDim.x, static_cast<int>((i + kRowsStages - 1) % kRowsStages));
    async_copy_wait<kRowsStages - 1>();
    __syncthreads();
    const Array<T, kVec>* row = reinterpret_cast<const Array<T, kVec>*>(ring + (i % kRowsStages) * nvec);
    uint32_t amax = 0;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) amax = amax_bits_of<In>(row[v], amax);
    amax = block_max(amax, s_red);
    const QuantScale sc = scale_from_amax_bits(amax, Fp8Spec<F>::kMax, a.pow2);
    if (threadIdx.x == 0) scale[r] = sc.decode;
    uint8_t* qr = q + r * a.cols;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      store_elems<uint8_t, kVec>(qr + v * kVec, quantize_elems<F, In>(row[v], sc.encode));
    }
    __syncthreads();  // this stage is refilled next iteration
  }
  async_copy_wait_all();
}

// Whether the 16-byte path applies: unit column stride, every row start and the row
// length a multiple of the vector, and a 16-byte aligned base.
template <typename T>
inline bool rows_vector_ok(const void* x, const RowsArgs& a) {
  constexpr int64_t n = 16 / sizeof(T);
  return a.stride_col == 1 && a.cols % n == 0 && a.stride_inner % n == 0 &&
         a.stride_outer % n == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

template <InputKind K, Fp8Format F>
int launch_quantize_rows(const void* x, uint8_t* q, float* scale, const RowsArgs& a,
                         gpuStream_t stream) {
  using T = typename DeviceInput<K>::storage;
  constexpr int kVecN = 16 / sizeof(T);
  if (a.rows == 0) return 0;
  const bool vec = rows_vector_ok<T>(x, a);
  const int64_t nvec = vec ? a.cols / kVecN : a.cols;
  // Just enough threads that the register cache covers the row: small rows get small
  // blocks (many per SM), long rows up to 1024 threads.
  const int64_t threads =
      std::min<int64_t>(round_up(std::max<int64_t>(ceil_div(nvec, kRowsRegVecs), 1), kWarpSize), 1024);
  const T* xt = static_cast<const T*>(x);
  const int64_t stage_bytes = a.cols * static_cast<int64_t>(sizeof(T));
  if (vec && stage_bytes <= kRowsMaxStageBytes) {
    const int64_t pthreads =
        std::min<int64_t>(std::max<int64_t>(round_up(ceil_div(nvec, kRowsVecsPerThread), kWarpSize), 2 * kWarpSize), 256);
    const size_t smem = static_cast<size_t>(kRowsStages * stage_bytes);
    auto kernel = quantize_rows_pipelined_kernel<K, F>;
    const int64_t resident =
        static_cast<int64_t>(resident_blocks(kernel, static_cast<int>(pthreads), smem)) * multiprocessor_count();
    const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(a.rows, resident))));
    return launch_kernel(kernel, grid, dim3(static_cast<unsigned>(pthreads)), smem, stream, 1, xt, q, scale, a);
  }
  const dim3 block(static_cast<unsigned>(threads));
  auto kernel = vec ? quantize_rows_kernel<K, F, kVecN> : quantize_rows_kernel<K, F, 1>;
  // Persistent grid: as many blocks as can be resident, each looping over rows.
  const int64_t resident = static_cast<int64_t>(resident_blocks(kernel, static_cast<int>(threads), 0)) *
                           multiprocessor_count();
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(a.rows, resident))));
  return launch_kernel(kernel, grid, block, 0, stream, 1, xt, q, scale, a);
}

// ---------------------------------------------------------------------------------
// "cols": a block owns a tile of kTileCols columns (64 bytes of each input row) and
// one slice of one segment. The slice is copied into shared memory in chunks of
// `cache_rows` rows (16-byte async copies on the vector path: no registers held, so
// the whole chunk is in flight at once), the column amax is reduced from shared
// memory, and the encode pass writes each column's rows as contiguous 32-byte runs
// of q (the transpose). A slice longer than the cache is read twice.
//
// Why clusters: a reduction over a long segment (K = 7168 rows of one expert) does
// not fit one SM's shared memory, so `cluster` blocks (one cluster, sm90+) split the
// segment, each caching its slice, and exchange the partial column amax through
// distributed shared memory: every input byte is still read once.
// ---------------------------------------------------------------------------------
constexpr int kColsThreads = 256;
constexpr int kColsTileBytes = 128;  // of each input row per block (measured: 64/128/256 within 5%)
constexpr int kColsRunRows = 32;  // q bytes a thread writes per column run: one full 32-byte sector
constexpr int kColsUnroll = 4;    // loads in flight per thread on the scalar (strided) path
constexpr int kColsMaxCluster = 8;
constexpr int kColsMinBlocks = 5;  // register cap (48; ptxas spills at most 8 bytes) so that five blocks fit an SM

template <InputKind K, int kVecN>
struct ColsGeometry {
  using T = typename DeviceInput<K>::storage;
  static constexpr int kTileCols = kColsTileBytes / static_cast<int>(sizeof(T));
  static constexpr int kThreadsPerRow = kTileCols / kVecN;
  static constexpr int kRowsPerStep = kColsThreads / kThreadsPerRow;
  static constexpr int kWriterGroups = kColsThreads / kTileCols;
  static_assert(kColsThreads % kTileCols == 0, "every thread owns one column in the encode pass");
};

// Copies rows [lo, lo + n) of the block's slice into tile rows [0, n) and waits.
template <typename T, int kVecN, int kTileCols, int kRowsPerStep>
MOE_FP8_DEVICE void stage_rows(const T* xcol, int64_t sr, int64_t sc, int64_t lo, int64_t n, int ty, int tx,
                               T* tile) {
  if constexpr (kVecN * sizeof(T) == 16) {
    (void)sc;
    for (int64_t i = ty; i < n; i += kRowsPerStep) async_copy_16(tile + i * kTileCols + tx * kVecN, xcol + (lo + i) * sr);
    async_copy_wait_all();
  } else {
    for (int64_t i0 = 0; i0 < n; i0 += kRowsPerStep * kColsUnroll) {
      Array<T, kVecN> v[kColsUnroll];
#pragma unroll
      for (int u = 0; u < kColsUnroll; ++u) {
        const int64_t i = i0 + ty + u * kRowsPerStep;
        if (i < n) v[u] = load_elems<T, kVecN>(xcol + (lo + i) * sr, sc);
      }
#pragma unroll
      for (int u = 0; u < kColsUnroll; ++u) {
        const int64_t i = i0 + ty + u * kRowsPerStep;
        if (i < n) store_elems<T, kVecN>(tile + i * kTileCols + tx * kVecN, v[u]);
      }
    }
  }
}

template <InputKind K, Fp8Format F, int kVecN>
__global__ void __launch_bounds__(kColsThreads, kColsMinBlocks) quantize_cols_kernel(ColsArgs a, int cluster, int cache_rows) {
  using In = DeviceInput<K>;
  using T = typename In::storage;
  using G = ColsGeometry<K, kVecN>;
  constexpr int kTileCols = G::kTileCols;
  extern __shared__ uint4 smem_dyn[];
  T* tile = reinterpret_cast<T*>(smem_dyn);  // [cache_rows][kTileCols]
  __shared__ uint32_t s_part[G::kWriterGroups][kTileCols];
  __shared__ uint32_t s_amax[kTileCols];
  __shared__ float s_enc[kTileCols];

  // Which operand and column tile (a dual launch puts operand 1's tiles after 0's).
  const int tiles0 = static_cast<int>(ceil_div(a.op[0].cols, kTileCols));
  const bool second = static_cast<int>(blockIdx.x) >= tiles0;
  const ColsOperand op = second ? a.op[1] : a.op[0];
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) - (second ? tiles0 : 0)) * kTileCols;

  // Which segment, and this block's slice of its q rows (and of the input rows that
  // land there: a padded segment has q rows past its input, which encode to zero).
  const int seg_id = blockIdx.y / cluster;
  const int rank = blockIdx.y % cluster;
  const Segment seg = resolve_segment(a, seg_id);
  const int64_t chunk = round_up(ceil_div(seg.q_len, cluster), kColsRunRows);
  const int64_t my_off = std::min<int64_t>(seg.q_len, rank * chunk);
  const int64_t my_qlen = std::min<int64_t>(seg.q_len, my_off + chunk) - my_off;
  const int64_t my_start = seg.start + my_off;
  const int64_t my_len = std::max<int64_t>(0, std::min<int64_t>(seg.end - seg.start - my_off, my_qlen));

  const int tid = threadIdx.x;
  const int tx = tid % G::kThreadsPerRow;  // staging layout: a tile row per kThreadsPerRow threads
  const int ty = tid / G::kThreadsPerRow;
  const bool load_ok = !seg.zero_fill && c0 + tx * kVecN < op.cols;
  const T* xcol = static_cast<const T*>(op.x) + seg.batch * op.sb + (c0 + tx * kVecN) * op.sc;
  const int wc = tid % kTileCols;  // encode layout: one column per thread
  const int wg = tid / kTileCols;
  const int64_t col = c0 + wc;
  const bool col_ok = col < op.cols;

  // Pass 1: stage chunk by chunk, reducing each column's amax from shared memory.
  // The last chunk stays in the tile for pass 2.
  uint32_t amax = 0;
  const int64_t nchunks = ceil_div(my_len, cache_rows);
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t n = std::min<int64_t>(cache_rows, my_len - ch * cache_rows);
    if (ch > 0) __syncthreads();  // the previous chunk's readers are done
    if (load_ok) stage_rows<T, kVecN, kTileCols, G::kRowsPerStep>(xcol, op.sr, op.sc, my_start + ch * cache_rows, n, ty, tx, tile);
    __syncthreads();
    if (col_ok && !seg.zero_fill) {
      for (int64_t r = wg; r < n; r += G::kWriterGroups) amax = umax(amax, abs_bits(In::to_float(tile[r * kTileCols + wc])));
    }
  }
  s_part[wg][wc] = amax;
  __syncthreads();
  if (tid < kTileCols) {
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < G::kWriterGroups; ++w) m = umax(m, s_part[w][tid]);
    s_amax[tid] = m;
  }
  if (cluster > 1) {  // uniform over the cluster: every block reaches both syncs
    cluster_sync();
    uint32_t m = 0;
    if (tid < kTileCols) {
      for (int k = 0; k < cluster; ++k) m = umax(m, cluster_map_shared(s_amax, k)[tid]);
    }
    cluster_sync();  // no block may overwrite or release s_amax while others read it
    if (tid < kTileCols) s_amax[tid] = m;
  }
  if (tid < kTileCols) {
    const QuantScale sc = scale_from_amax_bits(s_amax[tid], Fp8Spec<F>::kMax, a.pow2);
    s_enc[tid] = seg.zero_fill ? 0.0f : sc.encode;
    if (rank == 0 && !seg.zero_fill && c0 + tid < op.cols) op.scale[seg_id * op.scale_ss + c0 + tid] = sc.decode;
  }
  __syncthreads();

  // Pass 2: encode from the tile, 32 rows of one column per thread and store. The
  // last input chunk is in the tile already; earlier chunks are staged again, and
  // chunks past the input (padding) encode zero rows with the column's scale.
  uint8_t* qcol = op.q + seg.batch * op.q_sb + col * op.q_sc + seg.q_start + my_off;
  const float s = s_enc[wc];
  constexpr float kMax = Fp8Spec<F>::kMax;
  const int64_t qchunks = ceil_div(my_qlen, cache_rows);
  const int64_t first = nchunks > 0 ? nchunks - 1 : 0;
  for (int64_t i = 0; i < qchunks; ++i) {
    const int64_t ch = (first + i) % qchunks;
    const int64_t base = ch * cache_rows;
    const int64_t nq = std::min<int64_t>(cache_rows, my_qlen - base);
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(nq, my_len - base));
    if (i > 0 && n > 0) {
      __syncthreads();
      if (load_ok) stage_rows<T, kVecN, kTileCols, G::kRowsPerStep>(xcol, op.sr, op.sc, my_start + base, n, ty, tx, tile);
      __syncthreads();
    }
    if (!col_ok) continue;
    auto code = [&](int64_t r) {  // tile row r of this thread's column, scaled and clamped
      return scale_clamp(r < n ? In::to_float(tile[r * kTileCols + wc]) : 0.0f, s, kMax);
    };
    for (int64_t rb = static_cast<int64_t>(wg) * kColsRunRows; rb < nq; rb += G::kWriterGroups * kColsRunRows) {
      uint8_t* dst = qcol + base + rb;
      if (rb + kColsRunRows <= nq && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
        // A whole aligned run: packed in registers, 16-byte stores.
#pragma unroll
        for (int v = 0; v < kColsRunRows / 16; ++v) {
          uint32_t w[4];
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            const int64_t r0 = rb + 16 * v + 4 * p;
            w[p] = encode_fp8x2<F>(code(r0), code(r0 + 1)) |
                   (static_cast<uint32_t>(encode_fp8x2<F>(code(r0 + 2), code(r0 + 3))) << 16);
          }
          reinterpret_cast<uint4*>(dst)[v] = make_uint4(w[0], w[1], w[2], w[3]);
        }
      } else {
        // A partial or unaligned run, byte by byte. No run buffer: indexed at run
        // time it would live in local memory for every thread, and ncu showed that
        // spill traffic keeping the kernel L2-bound (bench/RESULTS.md).
        for (int64_t k = 0; k < kColsRunRows && rb + k < nq; ++k) dst[k] = encode_fp8<F>(code(rb + k));
      }
    }
  }
}

template <typename T>
inline bool cols_vector_ok(const ColsOperand& op) {
  constexpr int64_t n = 16 / sizeof(T);
  return op.sc == 1 && op.cols % n == 0 && op.sr % n == 0 && op.sb % n == 0 &&
         reinterpret_cast<uintptr_t>(op.x) % 16 == 0;
}

struct ColsLaunchPlan {
  int cluster;
  int cache_rows;
};

// Choose the cluster size and the cached rows per block from the expected segment
// length: split a segment over up to kColsMaxCluster blocks until a slice is at most
// kColsTargetRows, and cap the cache at the shared-memory budget; the part of a
// longer slice that does not fit is read twice. The constants are the best of a
// sweep on H200 (tile 64/128/256 B, slices 128..1024 rows, clusters 1/4/8, 48/96 KB);
// bench/RESULTS.md has the numbers.
constexpr int64_t kColsTargetRows = 256;
constexpr int64_t kColsSmemBudget = 96 * 1024;

inline ColsLaunchPlan plan_cols_launch(int64_t expected_rows, int num_segments, int max_smem_bytes,
                                       bool clusters) {
  const int64_t budget = std::min<int64_t>(max_smem_bytes - 8192, kColsSmemBudget);
  const int64_t max_rows = std::max<int64_t>(budget / kColsTileBytes / kColsRunRows * kColsRunRows, kColsRunRows);
  int cluster = 1;
  if (clusters) {
    while (cluster < kColsMaxCluster && ceil_div(expected_rows, cluster) > kColsTargetRows) cluster *= 2;
    while (cluster > 1 && static_cast<int64_t>(num_segments) * cluster > 65535) cluster /= 2;
  }
  const int64_t rows = std::min<int64_t>(round_up(std::max<int64_t>(ceil_div(expected_rows, cluster), 1), kColsRunRows), max_rows);
  return {cluster, static_cast<int>(rows)};
}

template <InputKind K, Fp8Format F>
int launch_quantize_cols(const ColsArgs& a, ColsLaunchPlan plan, gpuStream_t stream) {
  using T = typename DeviceInput<K>::storage;
  constexpr int kVecN = 16 / sizeof(T);
  constexpr int kTileCols = kColsTileBytes / sizeof(T);
  int64_t tiles = ceil_div(a.op[0].cols, kTileCols);
  if (a.num_ops == 2) tiles += ceil_div(a.op[1].cols, kTileCols);
  if (tiles == 0) return 0;
  bool vec = cols_vector_ok<T>(a.op[0]);
  if (a.num_ops == 2) vec = vec && cols_vector_ok<T>(a.op[1]);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(segments_with_tail(a) * plan.cluster));
  const size_t smem = static_cast<size_t>(plan.cache_rows) * kColsTileBytes;
  auto kernel = vec ? quantize_cols_kernel<K, F, kVecN> : quantize_cols_kernel<K, F, 1>;
  return launch_kernel(kernel, grid, dim3(kColsThreads), smem, stream, plan.cluster, a, plan.cluster, plan.cache_rows);
}

}  // namespace moe_fp8
