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

// Packed amax of 16-bit inputs (bf16/fp16), used by both kernel shapes: a running max
// of the sign-cleared lanes, two a word. Clearing the sign makes the integer order the
// |x| order with NaN above inf (as abs_bits does for floats), so the max lane
// converted to float bits once at the end equals the per-element amax bits.
MOE_FP8_DEVICE uint32_t amax16x2_add(uint32_t m, uint32_t w) { return umax_u16x2(m, w & 0x7FFF7FFFu); }

// Float abs bits of lane `hi ? 1 : 0` of a packed amax word.
template <class In>
MOE_FP8_DEVICE uint32_t amax16x2_lane_bits(uint32_t m, bool hi) {
  return abs_bits(In::to_float(static_cast<uint16_t>(hi ? (m >> 16) : (m & 0xFFFFu))));
}

// Start of reduction row r (RowsArgs addressing). 32-bit division: the launcher checks
// rows < 2^31, and a 64-bit division is a long software sequence, paid once per row.
template <typename T>
MOE_FP8_DEVICE const T* rows_row_ptr(const T* x, const RowsArgs& a, int64_t r) {
  const uint32_t ri = static_cast<uint32_t>(r);
  const uint32_t inner = static_cast<uint32_t>(a.rows_inner);
  const uint32_t outer = ri / inner;
  return x + static_cast<int64_t>(outer) * a.stride_outer + static_cast<int64_t>(ri - outer * inner) * a.stride_inner;
}

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
  auto row_ptr = [&](int64_t r) { return rows_row_ptr(x, a, r); };
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
      const T* xr = rows_row_ptr(x, a, r);
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
    if constexpr (sizeof(T) == 2) {
      const uint4* words = ring + (i % kRowsStages) * nvec;
      uint32_t m = 0;
      for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
        const uint4 w = words[v];
        m = amax16x2_add(amax16x2_add(amax16x2_add(amax16x2_add(m, w.x), w.y), w.z), w.w);
      }
      amax = umax(amax16x2_lane_bits<In>(m, false), amax16x2_lane_bits<In>(m, true));
    } else {
      for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) amax = amax_bits_of<In>(row[v], amax);
    }
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
// "cols": a block owns a tile of 128 bytes of each input row (64 bf16 columns) and
// one slice of one segment. The slice is copied into shared memory in chunks of
// `cache_rows` rows (16-byte async copies on the vector path: no registers held, so
// the whole chunk is in flight at once). From there each thread takes a fragment of
// kColsFragRows rows x 8 bytes (four bf16 columns): it reduces the fragment's column
// amax, and after the exchange encodes the fragment into one 8-byte run of q per
// column (the transpose). Of a slice longer than the cache, the rows past the first
// cache-full are read twice.
//
// Thread layout: thread t owns column group t / kColsRowBlocks (8 bytes of the tile
// row) and rows [8 * rb, 8 * rb + 8) of each 128-row pass, rb = t % kColsRowBlocks.
// The sixteen threads of one column group are adjacent lanes, so a column's amax is a
// 4-step butterfly, and one warp store writes a whole 128-byte line of each of two
// columns. The tile is swizzled (16-byte chunk j of row r sits at chunk
// j ^ ((r / 8) % 8)) so that the fragment reads and the row-wise staging writes both
// run at the full shared-memory width.
//
// Why clusters: a reduction over a long segment (K = 7168 rows of one expert) does
// not fit one SM's shared memory, so `cluster` blocks (one cluster, sm90+) split the
// segment, each caching its slice, and exchange the partial column amax through
// distributed shared memory: every input byte is still read once.
// ---------------------------------------------------------------------------------
constexpr int kColsThreads = 256;
constexpr int kColsTileBytes = 128;  // of each input row per block
constexpr int kColsGroupBytes = 8;   // of each tile row per thread fragment
constexpr int kColsFragRows = 8;     // rows per fragment: one 8-byte q run per column
constexpr int kColsColGroups = kColsTileBytes / kColsGroupBytes;
constexpr int kColsRowBlocks = kColsThreads / kColsColGroups;
constexpr int kColsPassRows = kColsRowBlocks * kColsFragRows;  // rows one pass of the block covers
constexpr int kColsUnroll = 4;  // loads in flight per thread on the scalar (strided) path
constexpr int kColsMaxCluster = 8;
constexpr int kColsMinBlocks = 4;  // 64 registers: no spills in any instantiation (ptxas -v, sm_90a and sm_100a)
static_assert(kColsThreads % kColsColGroups == 0 && kColsRowBlocks <= 16, "row blocks are lanes of one warp");

template <InputKind K>
struct ColsGeometry {
  using T = typename DeviceInput<K>::storage;
  static constexpr int kTileCols = kColsTileBytes / static_cast<int>(sizeof(T));
  static constexpr int kColsPer = kColsGroupBytes / static_cast<int>(sizeof(T));  // columns per fragment
};

// Byte offset of (row r, byte b of the row) in the swizzled tile.
MOE_FP8_DEVICE int tile_offset(int r, int b) {
  return r * kColsTileBytes + ((((b >> 4) ^ ((r / kColsFragRows) & 7)) << 4) | (b & 15));
}

MOE_FP8_DEVICE uint32_t ceil_div_u32(uint32_t a, uint32_t b) { return (a + b - 1) / b; }
MOE_FP8_DEVICE uint32_t round_up_u32(uint32_t a, uint32_t b) { return ceil_div_u32(a, b) * b; }

// Copies rows [lo, lo + n) of the block's slice (columns from the block's first) into
// tile rows [0, n) and waits. The vector path moves 16 bytes per thread and row
// (8 threads a row); the scalar path one element of any stride.
template <typename T, bool kVec>
MOE_FP8_DEVICE void stage_rows(const T* xblk, int64_t sr, int64_t sc, int64_t lo, int n, int64_t valid_cols,
                               uint8_t* tile) {
  constexpr int kTileCols = kColsTileBytes / static_cast<int>(sizeof(T));
  if constexpr (kVec) {
    constexpr int kPerRow = kColsTileBytes / 16;
    constexpr int kElems = 16 / static_cast<int>(sizeof(T));
    const int tx = threadIdx.x % kPerRow;
    if (tx * kElems >= valid_cols) return;  // the block's columns past the operand (vector path: whole chunks)
    (void)sc;
    for (int i = threadIdx.x / kPerRow; i < n; i += kColsThreads / kPerRow) {
      async_copy_16(tile + tile_offset(i, tx * 16), xblk + (lo + i) * sr + tx * kElems);
    }
    async_copy_wait_all();
  } else {
    constexpr int kRowsPerStep = kColsThreads / kTileCols;
    const int tx = threadIdx.x % kTileCols;
    const int ty = threadIdx.x / kTileCols;
    if (tx >= valid_cols) return;
    const T* xc = xblk + tx * sc;
    for (int i0 = 0; i0 < n; i0 += kRowsPerStep * kColsUnroll) {
      T v[kColsUnroll];
#pragma unroll
      for (int u = 0; u < kColsUnroll; ++u) {
        const int i = i0 + ty + u * kRowsPerStep;
        if (i < n) v[u] = xc[(lo + i) * sr];
      }
#pragma unroll
      for (int u = 0; u < kColsUnroll; ++u) {
        const int i = i0 + ty + u * kRowsPerStep;
        if (i < n) *reinterpret_cast<T*>(tile + tile_offset(i, tx * static_cast<int>(sizeof(T)))) = v[u];
      }
    }
  }
}

// A thread's fragment: kColsFragRows rows x 8 bytes of the tile, two 32-bit words a
// row; rows at or past `n` (past the staged input: padding rows, or past the slice)
// read as zero. `first` is a multiple of kColsFragRows, so the whole fragment shares
// one swizzle and each row is one load at a constant offset.
struct ColsFragment {
  uint2 row[kColsFragRows];
};
static_assert(kColsGroupBytes == 8, "a fragment row is one 8-byte word pair");

MOE_FP8_DEVICE void load_fragment(const uint8_t* tile, int first, int n, int cg, ColsFragment& f) {
  const int b = cg * kColsGroupBytes;
  const uint8_t* p = tile + first * kColsTileBytes + ((((b >> 4) ^ ((first / kColsFragRows) & 7)) << 4) | (b & 15));
  if (first + kColsFragRows <= n) {
#pragma unroll
    for (int i = 0; i < kColsFragRows; ++i) f.row[i] = *reinterpret_cast<const uint2*>(p + i * kColsTileBytes);
  } else {
#pragma unroll
    for (int i = 0; i < kColsFragRows; ++i) {
      f.row[i] = first + i < n ? *reinterpret_cast<const uint2*>(p + i * kColsTileBytes) : make_uint2(0u, 0u);
    }
  }
}

// Element c of fragment row i as a float.
template <InputKind K>
MOE_FP8_DEVICE float fragment_value(const ColsFragment& f, int i, int c) {
  using T = typename DeviceInput<K>::storage;
  const uint32_t w = (c * sizeof(T)) < 4 ? f.row[i].x : f.row[i].y;
  if constexpr (sizeof(T) == 4) {
    return bits_float(w);
  } else if constexpr (K == InputKind::kBF16) {
    return bits_float((c % 2) ? (w & 0xFFFF0000u) : (w << 16));  // the bf16 bits in place
  } else {
    return DeviceInput<K>::to_float(static_cast<uint16_t>((c % 2) ? (w >> 16) : (w & 0xFFFFu)));
  }
}

// Running column amax of fragments, kept packed: per 32-bit word, the max of the
// sign-cleared elements (two 16-bit lanes, see amax16x2_add, or one float's abs_bits).
template <InputKind K>
struct ColsAmax {
  static constexpr bool kPacked = sizeof(typename DeviceInput<K>::storage) == 2;
  uint32_t w[2] = {0u, 0u};
  MOE_FP8_DEVICE static uint32_t max_word(uint32_t a, uint32_t b) { return kPacked ? umax_u16x2(a, b) : umax(a, b); }
  MOE_FP8_DEVICE static uint32_t add_word(uint32_t m, uint32_t x) {
    return kPacked ? amax16x2_add(m, x) : umax(m, x & 0x7FFFFFFFu);
  }
  MOE_FP8_DEVICE void add(const ColsFragment& f) {
#pragma unroll
    for (int i = 0; i < kColsFragRows; ++i) {
      w[0] = add_word(w[0], f.row[i].x);
      w[1] = add_word(w[1], f.row[i].y);
    }
  }
  // Max over the lanes whose index differs in bits below `lanes` (a power of two).
  MOE_FP8_DEVICE void reduce_lanes(int lanes) {
    for (int m = 1; m < lanes; m <<= 1) {
      w[0] = max_word(w[0], warp_shfl_xor(w[0], m));
      w[1] = max_word(w[1], warp_shfl_xor(w[1], m));
    }
  }
  // The amax of column c as float abs bits.
  MOE_FP8_DEVICE uint32_t column_bits(int c) const {
    if constexpr (!kPacked) return w[c];
    else return amax16x2_lane_bits<DeviceInput<K>>(w[c / 2], c % 2 != 0);
  }
};

template <InputKind K, Fp8Format F, bool kVec>
__global__ void __launch_bounds__(kColsThreads, kColsMinBlocks) quantize_cols_kernel(ColsArgs a, int cluster, int cache_rows) {
  using In = DeviceInput<K>;
  using T = typename In::storage;
  using G = ColsGeometry<K>;
  constexpr int kTileCols = G::kTileCols;
  constexpr int kC = G::kColsPer;
  extern __shared__ uint4 smem_dyn[];
  uint8_t* tile = reinterpret_cast<uint8_t*>(smem_dyn);  // [cache_rows][kColsTileBytes], swizzled
  __shared__ uint32_t s_amax[kTileCols];
  __shared__ float s_enc[kTileCols];

  // Which operand and column tile (a dual launch puts operand 1's tiles after 0's).
  const int tiles0 = static_cast<int>(ceil_div(a.op[0].cols, kTileCols));
  const bool second = static_cast<int>(blockIdx.x) >= tiles0;
  const ColsOperand& op = a.op[second ? 1 : 0];  // read from parameter space as needed
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) - (second ? tiles0 : 0)) * kTileCols;

  // Which segment, and this block's slice of its q rows (and of the input rows that
  // land there: a padded segment has q rows past its input, which encode to zero).
  const int seg_id = blockIdx.y / cluster;
  const int rank = blockIdx.y % cluster;
  const Segment seg = resolve_segment(a, seg_id);
  // Row counts below are 32-bit (the launcher checks rows < 2^31): 64-bit division is a
  // long software sequence, and this setup runs once per block.
  const int q_len = static_cast<int>(seg.q_len);
  const int chunk = static_cast<int>(round_up_u32(ceil_div_u32(q_len, cluster), kColsFragRows));
  const int my_off = std::min(q_len, rank * chunk);
  const int my_qlen = std::min(q_len, my_off + chunk) - my_off;
  const int64_t my_start = seg.start + my_off;
  const int my_len = std::max(0, std::min(static_cast<int>(seg.end - seg.start) - my_off, my_qlen));
  const int64_t valid_cols = seg.zero_fill ? 0 : op.cols - c0;
  const T* xblk = static_cast<const T*>(op.x) + seg.batch * op.sb + c0 * op.sc;

  const int tid = threadIdx.x;
  const int rb = tid % kColsRowBlocks;
  const int cg = tid / kColsRowBlocks;

  // Pass 1: stage chunk by chunk; each thread reduces its fragments' column amax.
  // Chunk 0 (a full one) goes last and stays in the tile for pass 2, so a slice longer
  // than the cache re-reads only the rows past it.
  ColsAmax<K> amax;
  const int nchunks = static_cast<int>(ceil_div_u32(my_len, cache_rows));
  for (int i = 0; i < nchunks; ++i) {
    const int ch = (i + 1) % nchunks;
    const int n = std::min(cache_rows, my_len - ch * cache_rows);
    if (i > 0) __syncthreads();  // the previous chunk's readers are done
    stage_rows<T, kVec>(xblk, op.sr, op.sc, my_start + ch * cache_rows, n, valid_cols, tile);
    __syncthreads();
    for (int p = 0; p < n; p += kColsPassRows) {
      ColsFragment f;
      load_fragment(tile, p + rb * kColsFragRows, n, cg, f);
      amax.add(f);
    }
  }
  // Columns past the operand hold stale tile bytes: their amax is never used.
  amax.reduce_lanes(kColsRowBlocks);
  if (rb == 0) {
#pragma unroll
    for (int c = 0; c < kC; ++c) s_amax[cg * kC + c] = amax.column_bits(c);
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
  __syncthreads();
  if (tid < kTileCols) {
    const QuantScale sc = scale_from_amax_bits(s_amax[tid], Fp8Spec<F>::kMax, a.pow2);
    s_enc[tid] = seg.zero_fill ? 0.0f : sc.encode;
    if (rank == 0 && !seg.zero_fill && c0 + tid < op.cols) op.scale[seg_id * op.scale_ss + c0 + tid] = sc.decode;
  }
  __syncthreads();

  // Pass 2: encode fragment by fragment into 8-byte runs of each column. Chunk 0 is
  // in the tile already; later chunks are staged again, and rows past the input
  // (padding) encode zero rows with the column's scale.
  float s[kC];
  bool col_ok[kC];
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    s[c] = s_enc[cg * kC + c];
    col_ok[c] = c0 + cg * kC + c < op.cols;
  }
  uint8_t* qblk = op.q + seg.batch * op.q_sb + (c0 + cg * kC) * op.q_sc + seg.q_start + my_off;
  const int qchunks = static_cast<int>(ceil_div_u32(my_qlen, cache_rows));
  for (int ch = 0; ch < qchunks; ++ch) {
    const int base = ch * cache_rows;
    const int nq = std::min(cache_rows, my_qlen - base);
    const int n = std::max(0, std::min(nq, my_len - base));
    if (ch > 0 && n > 0) {
      __syncthreads();
      stage_rows<T, kVec>(xblk, op.sr, op.sc, my_start + base, n, valid_cols, tile);
      __syncthreads();
    }
    for (int p = 0; p < nq; p += kColsPassRows) {
      const int r0 = p + rb * kColsFragRows;  // this thread's first row in the chunk
      if (r0 >= nq) continue;
      ColsFragment f;
      load_fragment(tile, r0, n, cg, f);
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        if (!col_ok[c]) continue;
        uint32_t w[kColsFragRows / 4];
#pragma unroll
        for (int j = 0; j < kColsFragRows / 4; ++j) {
          const uint16_t lo = scaled_fp8x2<F>(fragment_value<K>(f, 4 * j, c), fragment_value<K>(f, 4 * j + 1, c), s[c]);
          const uint16_t hi = scaled_fp8x2<F>(fragment_value<K>(f, 4 * j + 2, c), fragment_value<K>(f, 4 * j + 3, c), s[c]);
          w[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
        }
        uint8_t* dst = qblk + c * op.q_sc + base + r0;
        static_assert(kColsFragRows == 8, "one 8-byte store per run");
        if (r0 + kColsFragRows <= nq && reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
          *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
        } else {  // a partial or unaligned run, byte by byte (w indexed by constants only)
#pragma unroll
          for (int k = 0; k < kColsFragRows; ++k) {
            if (r0 + k < nq) dst[k] = static_cast<uint8_t>(w[k / 4] >> (8 * (k % 4)));
          }
        }
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
// length: the fewest blocks (a power of two, up to kColsMaxCluster) whose slices fit
// the shared-memory budget; the part of a longer slice that does not fit is read
// twice. Measured on H200 (bench/RESULTS.md, bench/sweep_cols.py): long slices in few
// blocks beat short ones in many (a 2048-row segment: 4 x 512 rows 82% of a copy,
// 8 x 256 rows 75%), as long as three blocks fit an SM (the same 4 x 512 rows with a
// 768-row cache, two blocks an SM: 73%); 72 KB is the largest budget that keeps three.
constexpr int64_t kColsSmemBudget = 72 * 1024;

inline ColsLaunchPlan plan_cols_launch(int64_t expected_rows, int num_segments, int max_smem_bytes,
                                       bool clusters) {
  const int64_t budget = std::min<int64_t>(max_smem_bytes - 8192, kColsSmemBudget);
  const int64_t max_rows = std::max<int64_t>(budget / kColsTileBytes / kColsFragRows * kColsFragRows, kColsFragRows);
  int cluster = 1;
  if (clusters) {
    while (cluster < kColsMaxCluster && ceil_div(expected_rows, cluster) > max_rows) cluster *= 2;
    while (cluster > 1 && static_cast<int64_t>(num_segments) * cluster > 65535) cluster /= 2;
  }
  const int64_t rows = std::min<int64_t>(round_up(std::max<int64_t>(ceil_div(expected_rows, cluster), 1), kColsFragRows), max_rows);
  return {cluster, static_cast<int>(rows)};
}

template <InputKind K, Fp8Format F>
int launch_quantize_cols(const ColsArgs& a, ColsLaunchPlan plan, gpuStream_t stream) {
  using T = typename DeviceInput<K>::storage;
  constexpr int kTileCols = kColsTileBytes / sizeof(T);
  int64_t tiles = ceil_div(a.op[0].cols, kTileCols);
  if (a.num_ops == 2) tiles += ceil_div(a.op[1].cols, kTileCols);
  if (tiles == 0) return 0;
  bool vec = cols_vector_ok<T>(a.op[0]);
  if (a.num_ops == 2) vec = vec && cols_vector_ok<T>(a.op[1]);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(segments_with_tail(a) * plan.cluster));
  const size_t smem = static_cast<size_t>(plan.cache_rows) * kColsTileBytes;
  auto kernel = vec ? quantize_cols_kernel<K, F, true> : quantize_cols_kernel<K, F, false>;
  return launch_kernel(kernel, grid, dim3(kColsThreads), smem, stream, plan.cluster, a, plan.cluster, plan.cache_rows);
}

}  // namespace moe_fp8
