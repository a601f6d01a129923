// The engine's "rows" shape on the GPU (reduce along the contiguous dimension; q keeps
// the row-major layout), templated over the policies of policies.h, and its launcher.
// Raw pointers, sizes and a stream only (no torch headers), so the file can be
// compile-checked for any target and hipified as is.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../core/numerics.h"
#include "../core/portability.h"
#include "../core/reduce.cuh"
#include "../core/vec.cuh"
#include "engine.h"

namespace moe_fp8 {

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

template <class Rule>
MOE_FP8_DEVICE void store_scale(const ScaleOut& s, int64_t index, typename Rule::stored_t v) {
  if (index >= 0 && index < s.numel) static_cast<typename Rule::stored_t*>(s.ptr)[index] = v;
}

// Segment and row of reduction row r (RowsArgs addressing). 32-bit division: the
// launcher checks rows < 2^31, and a 64-bit division is a long software sequence,
// paid once per row.
struct RowPos {
  uint32_t outer;
  uint32_t inner;
};

MOE_FP8_DEVICE RowPos row_pos(const RowsArgs& a, int64_t r) {
  const uint32_t ri = static_cast<uint32_t>(r);
  const uint32_t inner = static_cast<uint32_t>(a.rows_inner);
  const uint32_t outer = ri / inner;
  return {outer, ri - outer * inner};
}

template <typename T>
MOE_FP8_DEVICE const T* row_ptr_at(const T* x, const RowsArgs& a, RowPos p) {
  return x + static_cast<int64_t>(p.outer) * a.stride_outer + static_cast<int64_t>(p.inner) * a.stride_inner;
}

// Whole-set scale of a row (thread 0 writes it).
template <class Rule, class Layout>
MOE_FP8_DEVICE void store_row_scale(const RowsArgs& a, RowPos p, typename Rule::stored_t v) {
  const int64_t si = rows_scale_index<Layout>(a, p.outer, p.inner, 0);
  if (si >= 0) store_scale<Rule>(a.scale, si, v);
}

// ---------------------------------------------------------------------------------
// Whole-set rows: a thread block per reduction row at a time. The first kRowsRegVecs
// vectors of each thread stay in registers between the amax pass and the encode pass,
// so a row of up to kRowsRegVecs * 1024 vectors (32K bf16) is read from memory exactly
// once; longer rows re-read the remainder (an L2 hit in practice).
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
template <InputKind K, Fp8Format F, class Rule, class Layout, int kVec>
MOE_FP8_DEVICE void encode_row(const typename DeviceInput<K>::storage* xr, uint8_t* qr, const RowsArgs& a, RowPos pos,
                               int64_t nvec, const Array<typename DeviceInput<K>::storage, kVec> (&buf)[kRowsRegVecs],
                               uint32_t* s_red) {
  using In = DeviceInput<K>;
  using T = typename In::storage;
  const int64_t stride_col = a.stride_col;
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
  const auto sc = Rule::template from_amax_bits<F>(amax);
  if (threadIdx.x == 0) store_row_scale<Rule, Layout>(a, pos, sc.stored);
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
template <InputKind K, Fp8Format F, class Rule, class Layout, int kVec>
__global__ void __launch_bounds__(1024) quantize_rows_kernel(RowsArgs a) {
  using T = typename DeviceInput<K>::storage;
  static_assert(kVec == 1 || kVec * sizeof(T) == 16, "vector path moves 16 bytes per access");
  __shared__ uint32_t s_red[kMaxWarpsPerBlock + 1];
  const T* x = static_cast<const T*>(a.x);
  const int64_t nvec = a.cols / kVec;
  Array<T, kVec> buf0[kRowsRegVecs], buf1[kRowsRegVecs];
  int64_t r = blockIdx.x;
  if (r >= a.rows) return;
  RowPos pos = row_pos(a, r);
  load_row<K, kVec>(row_ptr_at(x, a, pos), nvec, a.stride_col, buf0);
  while (true) {
    int64_t next = r + gridDim.x;
    const RowPos next_pos = row_pos(a, next < a.rows ? next : r);
    if (next < a.rows) load_row<K, kVec>(row_ptr_at(x, a, next_pos), nvec, a.stride_col, buf1);
    encode_row<K, F, Rule, Layout, kVec>(row_ptr_at(x, a, pos), a.q + r * a.cols, a, pos, nvec, buf0, s_red);
    if (next >= a.rows) break;
    r = next;
    pos = next_pos;
    next = r + gridDim.x;
    const RowPos after = row_pos(a, next < a.rows ? next : r);
    if (next < a.rows) load_row<K, kVec>(row_ptr_at(x, a, after), nvec, a.stride_col, buf0);
    encode_row<K, F, Rule, Layout, kVec>(row_ptr_at(x, a, pos), a.q + r * a.cols, a, pos, nvec, buf1, s_red);
    if (next >= a.rows) break;
    r = next;
    pos = after;
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

template <InputKind K, Fp8Format F, class Rule, class Layout>
__global__ void __launch_bounds__(1024) quantize_rows_pipelined_kernel(RowsArgs a) {
  using In = DeviceInput<K>;
  using T = typename In::storage;
  constexpr int kVec = 16 / sizeof(T);
  extern __shared__ uint4 ring[];  // [kRowsStages][nvec]
  __shared__ uint32_t s_red[kMaxWarpsPerBlock + 1];
  const T* x = static_cast<const T*>(a.x);
  const int64_t nvec = a.cols / kVec;
  auto issue = [&](int64_t r, int stage) {
    if (r < a.rows) {
      const T* xr = row_ptr_at(x, a, row_pos(a, r));
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
    const auto sc = Rule::template from_amax_bits<F>(amax);
    if (threadIdx.x == 0) store_row_scale<Rule, Layout>(a, row_pos(a, r), sc.stored);
    uint8_t* qr = a.q + r * a.cols;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      store_elems<uint8_t, kVec>(qr + v * kVec, quantize_elems<F, In>(row[v], sc.encode));
    }
    __syncthreads();  // this stage is refilled next iteration
  }
  async_copy_wait_all();
}

// ---------------------------------------------------------------------------------
// Block rows (32 or 128 elements per scale): no reduction across the row. Lanes are
// grouped kLanes to a block, each lane holding a chunk of kChunk elements (one 16-byte
// vector on the vector path), and every thread keeps kBlockUnroll chunks in flight
// before the first use. A block's amax is a butterfly over its lanes. The last block
// of a row is partial when the row length is not a multiple of the block (its missing
// elements count as zero and are not written). Two walks over the chunks:
//  * by row (rows of at least kBlockRowMinChunks chunks): a persistent thread block
//    per row at a time, its threads across the row, so the row's position and its
//    scale placement (an M-group lookup) are paid once per row: the flat walk spends
//    two divisions (and, for M groups, a group search) per chunk, and the kernel is
//    close to instruction bound (bench/RESULTS.md has the two walks' numbers).
//  * flat (short rows): one stream of (row, block, lane), so short rows still fill
//    whole warps.
// ---------------------------------------------------------------------------------
constexpr int kBlockUnroll = 4;
constexpr int kBlockThreads = 256;
constexpr int64_t kBlockRowMinChunks = 128;

template <InputKind K, int kBlock, bool kVecPath>
struct RowsBlockGeometry {
  using T = typename DeviceInput<K>::storage;
  static constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));
  // Vector path: one 16-byte vector a lane. Scalar path: the block over a warp.
  static constexpr int kChunk = kVecPath ? kVecElems : (kBlock > kWarpSize ? kBlock / kWarpSize : 1);
  static constexpr int kLanes = kBlock / kChunk;
  static_assert(kBlock % kChunk == 0 && kLanes <= kWarpSize && (kLanes & (kLanes - 1)) == 0,
                "a block's lanes are a power-of-two group within one warp");
};

// Chunk of the row at elements [k0, k0 + kChunk), zeros past the row (or when !valid).
template <class G, bool kVecPath>
MOE_FP8_DEVICE Array<typename G::T, G::kChunk> load_block_chunk(const typename G::T* xr, int64_t k0, bool valid,
                                                               const RowsArgs& a) {
  using T = typename G::T;
  Array<T, G::kChunk> v;
#pragma unroll
  for (int e = 0; e < G::kChunk; ++e) v.v[e] = T(0);
  if (!valid) return v;
  if constexpr (kVecPath) {
    if (k0 < a.cols) v = load_elems<T, G::kChunk>(xr + k0, 1);
  } else {
#pragma unroll
    for (int e = 0; e < G::kChunk; ++e) {
      if (k0 + e < a.cols) v.v[e] = xr[(k0 + e) * a.stride_col];
    }
  }
  return v;
}

// Every lane of the warp calls it (the butterfly): the block amax, the scale (stored by
// the block's first lane at row shift `row_base`, none when negative) and the chunk's
// fp8 codes (valid lanes only).
template <InputKind K, Fp8Format F, class Rule, int kBlock, class Layout, bool kVecPath>
MOE_FP8_DEVICE void encode_block_chunk(const Array<typename DeviceInput<K>::storage,
                                                   RowsBlockGeometry<K, kBlock, kVecPath>::kChunk>& v,
                                       int64_t k0, bool valid, bool leader, uint8_t* qr, const RowsArgs& a,
                                       RowPos pos, int64_t row_base) {
  using In = DeviceInput<K>;
  using G = RowsBlockGeometry<K, kBlock, kVecPath>;
  uint32_t amax = amax_bits_of<In>(v, 0u);
#pragma unroll
  for (int m = 1; m < G::kLanes; m <<= 1) amax = umax(amax, warp_shfl_xor(amax, m));
  if (!valid) return;
  const auto sc = Rule::template from_amax_bits<F>(amax);
  if (leader && row_base >= 0) {
    store_scale<Rule>(a.scale, Layout::index(a.scale, pos.outer, pos.inner, k0 / kBlock, row_base, 0), sc.stored);
  }
  const Array<uint8_t, G::kChunk> q = quantize_elems<F, In>(v, sc.encode);
  if constexpr (kVecPath) {
    if (k0 < a.cols) store_elems<uint8_t, G::kChunk>(qr + k0, q);
  } else {
#pragma unroll
    for (int e = 0; e < G::kChunk; ++e) {
      if (k0 + e < a.cols) qr[k0 + e] = q.v[e];
    }
  }
}

template <InputKind K, Fp8Format F, class Rule, int kBlock, class Layout, bool kVecPath>
__global__ void __launch_bounds__(1024) quantize_rows_blocks_by_row_kernel(RowsArgs a, int64_t chunks_per_row) {
  using G = RowsBlockGeometry<K, kBlock, kVecPath>;
  using T = typename G::T;
  const T* x = static_cast<const T*>(a.x);
  const int64_t step = static_cast<int64_t>(blockDim.x) * kBlockUnroll;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const RowPos pos = row_pos(a, r);
    const T* xr = row_ptr_at(x, a, pos);
    uint8_t* qr = a.q + r * a.cols;
    const int64_t row_base = rows_scale_row_base<Layout>(a, pos.inner);
    for (int64_t c0 = 0; c0 < chunks_per_row; c0 += step) {  // uniform over the block: lanes shuffle
      Array<T, G::kChunk> v[kBlockUnroll];
#pragma unroll
      for (int u = 0; u < kBlockUnroll; ++u) {
        const int64_t c = c0 + threadIdx.x + static_cast<int64_t>(u) * blockDim.x;
        v[u] = load_block_chunk<G, kVecPath>(xr, c * G::kChunk, c < chunks_per_row, a);
      }
#pragma unroll
      for (int u = 0; u < kBlockUnroll; ++u) {
        const int64_t c = c0 + threadIdx.x + static_cast<int64_t>(u) * blockDim.x;
        encode_block_chunk<K, F, Rule, kBlock, Layout, kVecPath>(v[u], c * G::kChunk, c < chunks_per_row,
                                                                 threadIdx.x % G::kLanes == 0, qr, a, pos, row_base);
      }
    }
  }
}

template <InputKind K, Fp8Format F, class Rule, int kBlock, class Layout, bool kVecPath>
__global__ void __launch_bounds__(kBlockThreads) quantize_rows_blocks_kernel(RowsArgs a, uint32_t blocks_per_row,
                                                                            uint32_t total_lanes) {
  using G = RowsBlockGeometry<K, kBlock, kVecPath>;
  using T = typename G::T;
  constexpr int kLanes = G::kLanes;
  const T* x = static_cast<const T*>(a.x);
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t base = blockIdx.x * blockDim.x + threadIdx.x; base - threadIdx.x < total_lanes;
       base += stride * kBlockUnroll) {
    Array<T, G::kChunk> v[kBlockUnroll];
    int64_t k0[kBlockUnroll];
    int64_t row[kBlockUnroll];
    RowPos pos[kBlockUnroll];
#pragma unroll
    for (int u = 0; u < kBlockUnroll; ++u) {
      const uint32_t lane_id = base + u * stride;  // global lane index: (row, block, lane)
      const uint32_t blk_id = lane_id / kLanes;
      const uint32_t r = blk_id / blocks_per_row;
      const uint32_t j = blk_id - r * blocks_per_row;
      const bool valid = lane_id < total_lanes;
      row[u] = valid ? static_cast<int64_t>(r) : int64_t{-1};
      k0[u] = static_cast<int64_t>(j) * kBlock + static_cast<int64_t>(lane_id % kLanes) * G::kChunk;
      pos[u] = row_pos(a, valid ? r : 0);
      v[u] = load_block_chunk<G, kVecPath>(row_ptr_at(x, a, pos[u]), k0[u], valid, a);
    }
#pragma unroll
    for (int u = 0; u < kBlockUnroll; ++u) {
      const bool leader = (base + u * stride) % kLanes == 0;
      const int64_t row_base = row[u] >= 0 && leader ? rows_scale_row_base<Layout>(a, pos[u].inner) : -1;
      encode_block_chunk<K, F, Rule, kBlock, Layout, kVecPath>(v[u], k0[u], row[u] >= 0, leader,
                                                               a.q + (row[u] >= 0 ? row[u] : 0) * a.cols, a, pos[u],
                                                               row_base);
    }
  }
}

// Whether the 16-byte path applies: unit column stride, every row start and the row
// length a multiple of the vector, and 16-byte aligned bases.
template <typename T>
inline bool rows_vector_ok(const RowsArgs& a) {
  constexpr int64_t n = 16 / sizeof(T);
  return a.stride_col == 1 && a.cols % n == 0 && a.stride_inner % n == 0 && a.stride_outer % n == 0 &&
         reinterpret_cast<uintptr_t>(a.x) % 16 == 0;
}

template <InputKind K, Fp8Format F, class Rule, int kBlock, class Layout>
int launch_quantize_rows(const RowsArgs& a, gpuStream_t stream) {
  using T = typename DeviceInput<K>::storage;
  constexpr int kVecN = 16 / sizeof(T);
  if (a.rows == 0 || (kBlock != kWholeSet && a.cols == 0)) return 0;
  const bool vec = rows_vector_ok<T>(a);
  if constexpr (kBlock != kWholeSet) {
    // The vector path writes each lane's chunk of q with one store: q is [rows, cols]
    // contiguous, so with cols a multiple of the chunk an aligned base keeps every
    // chunk aligned.
    const bool qvec = vec && reinterpret_cast<uintptr_t>(a.q) % 16 == 0;
    const int64_t blocks_per_row = ceil_div(a.cols, kBlock);
    auto launch_by_row = [&](auto kernel, int chunk) {
      const int64_t chunks = ceil_div(a.cols, chunk);
      // Just enough threads that kBlockUnroll chunks each cover the row (up to 1024).
      const int64_t threads = std::min<int64_t>(round_up(ceil_div(chunks, kBlockUnroll), kWarpSize), 1024);
      const int64_t resident =
          static_cast<int64_t>(resident_blocks(kernel, static_cast<int>(threads), 0)) * multiprocessor_count();
      const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(a.rows, resident))));
      return launch_kernel(kernel, grid, dim3(static_cast<unsigned>(threads)), 0, stream, 1, a, chunks);
    };
    if (ceil_div(a.cols, RowsBlockGeometry<K, kBlock, true>::kChunk) >= kBlockRowMinChunks) {
      if (qvec) {
        return launch_by_row(quantize_rows_blocks_by_row_kernel<K, F, Rule, kBlock, Layout, true>,
                             RowsBlockGeometry<K, kBlock, true>::kChunk);
      }
      return launch_by_row(quantize_rows_blocks_by_row_kernel<K, F, Rule, kBlock, Layout, false>,
                           RowsBlockGeometry<K, kBlock, false>::kChunk);
    }
    auto launch = [&](auto kernel, int lanes_per_block) {
      const int64_t total = a.rows * blocks_per_row * lanes_per_block;
      const int64_t resident = static_cast<int64_t>(resident_blocks(kernel, kBlockThreads, 0)) * multiprocessor_count();
      const int64_t needed = ceil_div(total, kBlockThreads);
      const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(needed, resident));
      // 32-bit lane indices: the last stride past the end must not wrap.
      if (total + blocks * kBlockThreads * kBlockUnroll >= (int64_t{1} << 32)) return -1;
      const dim3 grid(static_cast<unsigned>(blocks));
      return launch_kernel(kernel, grid, dim3(kBlockThreads), 0, stream, 1, a, static_cast<uint32_t>(blocks_per_row),
                           static_cast<uint32_t>(total));
    };
    if (qvec) {
      return launch(quantize_rows_blocks_kernel<K, F, Rule, kBlock, Layout, true>,
                    RowsBlockGeometry<K, kBlock, true>::kLanes);
    }
    return launch(quantize_rows_blocks_kernel<K, F, Rule, kBlock, Layout, false>,
                  RowsBlockGeometry<K, kBlock, false>::kLanes);
  } else {
    const int64_t nvec = vec ? a.cols / kVecN : a.cols;
    // Just enough threads that the register cache covers the row: small rows get small
    // blocks (many per SM), long rows up to 1024 threads.
    const int64_t threads =
        std::min<int64_t>(round_up(std::max<int64_t>(ceil_div(nvec, kRowsRegVecs), 1), kWarpSize), 1024);
    const int64_t stage_bytes = a.cols * static_cast<int64_t>(sizeof(T));
    if (vec && stage_bytes <= kRowsMaxStageBytes) {
      const int64_t pthreads = std::min<int64_t>(
          std::max<int64_t>(round_up(ceil_div(nvec, kRowsVecsPerThread), kWarpSize), 2 * kWarpSize), 256);
      const size_t smem = static_cast<size_t>(kRowsStages * stage_bytes);
      auto kernel = quantize_rows_pipelined_kernel<K, F, Rule, Layout>;
      const int64_t resident =
          static_cast<int64_t>(resident_blocks(kernel, static_cast<int>(pthreads), smem)) * multiprocessor_count();
      const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(a.rows, resident))));
      return launch_kernel(kernel, grid, dim3(static_cast<unsigned>(pthreads)), smem, stream, 1, a);
    }
    const dim3 block(static_cast<unsigned>(threads));
    auto kernel = vec ? quantize_rows_kernel<K, F, Rule, Layout, kVecN> : quantize_rows_kernel<K, F, Rule, Layout, 1>;
    // Persistent grid: as many blocks as can be resident, each looping over rows.
    const int64_t resident =
        static_cast<int64_t>(resident_blocks(kernel, static_cast<int>(threads), 0)) * multiprocessor_count();
    const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(a.rows, resident))));
    return launch_kernel(kernel, grid, block, 0, stream, 1, a);
  }
}

}  // namespace moe_fp8
