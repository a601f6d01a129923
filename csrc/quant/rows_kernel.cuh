// The engine's "rows" shape on the GPU (reduce along the contiguous dimension; q stays
// row-major), templated over the policies of policies.h, and its launcher. Raw pointers,
// sizes and a stream only (no torch headers): compile-checked for any target, hipified as is.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "../core/device_runtime.h"
#include "../core/numerics.h"
#include "../core/portability.h"
#include "../core/reduce.cuh"
#include "../core/scan.cuh"
#include "../core/tuning_constants.h"
#include "../core/tuning.h"
#include "../core/vec.cuh"
#include "engine.h"


namespace moe_fp8 {

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

MOE_FP8_DEVICE uint8_t* q_row_at(const RowsArgs& a, RowPos p) { return a.q + rows_q_offset(a, p.outer, p.inner); }

// Whole-set scale of a row (thread 0 writes it).
template <class Rule, class Layout>
MOE_FP8_DEVICE void store_row_scale(const RowsArgs& a, RowPos p, typename Rule::stored_t v) {
  const int64_t si = rows_scale_index<Layout>(a, p.outer, p.inner, 0);
  if (si >= 0) store_scale<Rule>(a.scale, si, v);
}

// ---- Whole-set rows: a thread block per reduction row at a time. Each thread's first
// kRowsRegVecs vectors stay in registers from the amax pass to the encode pass, so a row of up
// to kRowsRegVecs * 1024 vectors (32K bf16) is read once; longer rows re-read the rest (L2).
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
    encode_row<K, F, Rule, Layout, kVec>(row_ptr_at(x, a, pos), q_row_at(a, pos), a, pos, nvec, buf0, s_red);
    if (next >= a.rows) break;
    r = next;
    pos = next_pos;
    next = r + gridDim.x;
    const RowPos after = row_pos(a, next < a.rows ? next : r);
    if (next < a.rows) load_row<K, kVec>(row_ptr_at(x, a, after), nvec, a.stride_col, buf0);
    encode_row<K, F, Rule, Layout, kVec>(row_ptr_at(x, a, pos), q_row_at(a, pos), a, pos, nvec, buf1, s_red);
    if (next >= a.rows) break;
    r = next;
    pos = after;
  }
}

// ---- Block rows (32 or 128 elements a scale): kLanes lanes a block, kChunk elements a lane, the
// block amax a butterfly over its lanes; a partial last block reads missing elements as zero and
// writes none. Kernels: octet-tile (blocked scales), ring (linear, vector path), by-row, flat.
constexpr int kBlockUnroll = 4;  // chunks a thread keeps in flight before the first use
constexpr int kBlockThreads = 256;  // threads of the flat walk's blocks
constexpr int64_t kBlockRowMinChunks = 128;  // rows of at least this many chunks: ring or by-row walk

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

// By-row walk: a persistent block a row, so the row's position and scale placement (an M-group
// lookup) are paid once a row, not per chunk as in the flat walk (instruction bound; record 030).
template <InputKind K, Fp8Format F, class Rule, int kBlock, class Layout, bool kVecPath>
__global__ void __launch_bounds__(1024) quantize_rows_blocks_by_row_kernel(RowsArgs a, int64_t chunks_per_row) {
  using G = RowsBlockGeometry<K, kBlock, kVecPath>;
  using T = typename G::T;
  const T* x = static_cast<const T*>(a.x);
  const int64_t step = static_cast<int64_t>(blockDim.x) * kBlockUnroll;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const RowPos pos = row_pos(a, r);
    const T* xr = row_ptr_at(x, a, pos);
    uint8_t* qr = q_row_at(a, pos);
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

// The ring kernel with blocks of kBlock: a lane takes kRingVecsPerLane consecutive 16-byte
// vectors of one block (most blocks need no shuffle; q goes out in wide stores). ring_slot(v)
// permutes each aligned group of four so lane reads and async copies are free of bank conflicts.
constexpr int kRingVecsPerLane = 4;

MOE_FP8_DEVICE int64_t ring_slot(int64_t v) { return (v & ~int64_t{3}) | ((v ^ (v >> 3)) & 3); }

template <InputKind K, int kBlock>
struct RingBlockGeometry {
  using T = typename DeviceInput<K>::storage;
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  static constexpr int kVecsPerBlock = kBlock / kVec;
  static constexpr int kLanes = kVecsPerBlock / kRingVecsPerLane;  // lanes sharing a block
  static constexpr int kElems = kRingVecsPerLane * kVec;            // elements of a lane
  static_assert(kBlock % (kVec * kRingVecsPerLane) == 0 && kLanes <= kWarpSize && (kLanes & (kLanes - 1)) == 0,
                "a lane holds whole vectors of one block; a block's lanes are a power of two within a warp");
};

// One lane's unit of kRingVecsPerLane vectors (zeros past the data), every lane of the warp at
// once (the block butterfly): returns the block's scale code and, when `store`, writes the unit's
// q bytes at qr + k0, the vectors before `cols` only (cols % kVec == 0).
template <InputKind K, Fp8Format F, class Rule, int kBlock>
MOE_FP8_DEVICE ScaleCode<typename Rule::stored_t> encode_ring_unit(const uint4 (&w)[kRingVecsPerLane], uint8_t* qr,
                                                                  int64_t k0, int64_t cols, bool store) {
  using G = RingBlockGeometry<K, kBlock>;
  using In = DeviceInput<K>;
  using T = typename G::T;
  uint32_t amax = 0;
#pragma unroll
  for (int j = 0; j < kRingVecsPerLane; ++j) {
    if constexpr (sizeof(T) == 2) {
      amax = amax16x2_add(amax16x2_add(amax16x2_add(amax16x2_add(amax, w[j].x), w[j].y), w[j].z), w[j].w);
    } else {
      amax = amax_bits_of<In>(*reinterpret_cast<const Array<T, G::kVec>*>(&w[j]), amax);
    }
  }
  if constexpr (sizeof(T) == 2) amax = umax(amax16x2_lane_bits<In>(amax, false), amax16x2_lane_bits<In>(amax, true));
#pragma unroll
  for (int m = 1; m < G::kLanes; m <<= 1) amax = umax(amax, warp_shfl_xor(amax, m));
  const auto sc = Rule::template from_amax_bits<F>(amax);
  if constexpr (G::kElems == 32) {
    // 16-bit inputs: 32 code bytes a lane in h[0], h[1]. Lanes 2i, 2i + 1 (adjacent units of a row,
    // `store` alike) swap one half, so each 16-byte store writes whole sectors, not half of each
    // (record 002). Every lane shuffles: the callers keep the warp converged.
    uint4 h[2];
#pragma unroll
    for (int j = 0; j < kRingVecsPerLane; ++j) {
      const Array<T, G::kVec>& e = *reinterpret_cast<const Array<T, G::kVec>*>(&w[j]);
      uint32_t word[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint32_t lo = scaled_fp8x2<F>(In::to_float(e.v[4 * i]), In::to_float(e.v[4 * i + 1]), sc.encode);
        const uint32_t hi = scaled_fp8x2<F>(In::to_float(e.v[4 * i + 2]), In::to_float(e.v[4 * i + 3]), sc.encode);
        word[i] = lo | (hi << 16);
      }
      uint32_t* hw = reinterpret_cast<uint32_t*>(&h[j / 2]);
      hw[2 * (j % 2)] = word[0];
      hw[2 * (j % 2) + 1] = word[1];
    }
    const bool odd = (threadIdx.x & 1u) != 0;
    const uint4 send = odd ? h[0] : h[1];
    const uint4 recv = make_uint4(warp_shfl_xor(send.x, 1), warp_shfl_xor(send.y, 1), warp_shfl_xor(send.z, 1),
                                  warp_shfl_xor(send.w, 1));
    const int64_t p0 = k0 - (odd ? 32 : 0);  // the pair's first element
    if (store && cols % 16 == 0 && p0 + 64 <= cols) {
      *reinterpret_cast<uint4*>(qr + (odd ? k0 - 16 : k0)) = odd ? recv : h[0];
      *reinterpret_cast<uint4*>(qr + (odd ? k0 + 16 : k0 + 32)) = odd ? h[1] : recv;
      return sc;
    }
    // a pair reaching past the row (or rows not 16-byte aligned): each lane its own
    if (!store || k0 >= cols) return sc;
    if (k0 + 32 <= cols && cols % 16 == 0) {  // 16-byte aligned in every row
      *reinterpret_cast<uint4*>(qr + k0) = h[0];
      *reinterpret_cast<uint4*>(qr + k0 + 16) = h[1];
    } else {  // the row's last unit, partly past the row, or rows not 16-byte aligned
#pragma unroll
      for (int j = 0; j < kRingVecsPerLane; ++j) {
        if (k0 + j * G::kVec < cols) {
          const uint32_t* hw = reinterpret_cast<const uint32_t*>(&h[j / 2]);
          *reinterpret_cast<uint2*>(qr + k0 + j * G::kVec) = make_uint2(hw[2 * (j % 2)], hw[2 * (j % 2) + 1]);
        }
      }
    }
    return sc;
  }
  if (!store || k0 >= cols) return sc;
  Array<uint8_t, G::kElems> out;
#pragma unroll
  for (int j = 0; j < kRingVecsPerLane; ++j) {
    const Array<uint8_t, G::kVec> q = quantize_elems<F, In>(*reinterpret_cast<const Array<T, G::kVec>*>(&w[j]), sc.encode);
#pragma unroll
    for (int i = 0; i < G::kVec; ++i) out.v[j * G::kVec + i] = q.v[i];
  }
  if (k0 + G::kElems <= cols && (G::kElems < 16 || cols % 16 == 0)) {  // 16-byte aligned in every row
    constexpr int kStore = G::kElems < 16 ? G::kElems : 16;
#pragma unroll
    for (int i = 0; i < G::kElems; i += kStore) {
      store_elems<uint8_t, kStore>(qr + k0 + i, *reinterpret_cast<const Array<uint8_t, kStore>*>(out.v + i));
    }
  } else {
    // the row's last unit, partly past the row, or rows not 16-byte aligned: one store
    // a vector
#pragma unroll
    for (int j = 0; j < kRingVecsPerLane; ++j) {
      if (k0 + j * G::kVec < cols) {
        store_elems<uint8_t, G::kVec>(qr + k0 + j * G::kVec,
                                      *reinterpret_cast<const Array<uint8_t, G::kVec>*>(out.v + j * G::kVec));
      }
    }
  }
  return sc;
}

// One row in shared memory (nvec vectors at their ring slots), in at most kRingRounds rounds of
// the thread block (the launcher sizes the block so); lanes past the row carry zeros and write
// nothing. sink(block index, stored scale) places the scales.
constexpr int kRingRounds = 2;

template <InputKind K, Fp8Format F, class Rule, int kBlock, class Sink>
MOE_FP8_DEVICE void rows_block_step(const uint4* ring_row, int64_t nvec, uint8_t* qr, const RowsArgs& a,
                                    const Sink& sink) {
  using G = RingBlockGeometry<K, kBlock>;
  const int64_t units = ceil_div(nvec, kRingVecsPerLane);
#pragma unroll
  for (int round = 0; round < kRingRounds; ++round) {
    const int64_t u0 = static_cast<int64_t>(round) * blockDim.x;
    if (u0 >= units) break;  // uniform over the block: lanes shuffle
    const int64_t u = u0 + threadIdx.x;
    uint4 w[kRingVecsPerLane];
#pragma unroll
    for (int j = 0; j < kRingVecsPerLane; ++j) {
      const int64_t v = u * kRingVecsPerLane + j;
      w[j] = v < nvec ? ring_row[ring_slot(v)] : make_uint4(0, 0, 0, 0);
    }
    const int64_t k0 = u * G::kElems;
    const auto sc = encode_ring_unit<K, F, Rule, kBlock>(w, qr, k0, a.cols, true);
    if (k0 < a.cols && threadIdx.x % G::kLanes == 0) sink(k0 / kBlock, sc.stored);
  }
}

// Vector path for rows that fit in shared memory: persistent blocks stream rows through a ring of
// kRowsStages row buffers by async copy (no registers hold data), the next rows in flight while one
// is encoded. Whole-set rows reduce over the block, blocks of kBlock in rows_block_step (030).
constexpr int64_t kRowsMaxStageBytes = 32 * 1024;
static_assert(kRowsMaxStageBytes / 16 <= 256 * kRingVecsPerLane * kRingRounds,
              "a ring row of blocks takes at most kRingRounds rounds of 256 threads");

// Vectors of one ring stage: the row, rounded up to whole groups of ring_slot in
// block mode.
template <int kBlock>
MOE_FP8_HD int64_t ring_stage_vecs(int64_t nvec) {
  return kBlock == kWholeSet ? nvec : round_up(nvec, int64_t{kRingVecsPerLane});
}

// Cluster gather (kGather > 1; sm90+, fp32 column-major linear scales, e.g. blockwise act_lhs):
// row by row, each scale costs an L2 write of its own. Block b % kGather of the cluster collects
// column b's kGather rows, stored as one 32-byte run a step later (split barrier, two buffers).
constexpr int kGatherRows = kRocm ? 1 : 8;
// Runs without a cluster (kGather > 1, !kCluster; rows of up to kRunMaxCols blocks, too short for
// lockstep): a block takes kGather consecutive rows in kGather steps, keeps their scales in its
// shared memory and stores each block column's run after the last of them.
constexpr int kRunMaxCols = 16;  // block columns of a row, at most (2048 elements in blocks of 128)
template <int kBlock, int kGather, bool kCluster>
constexpr int gather_max_cols() {  // block columns a block stores runs of, at most (16-bit rows)
  if constexpr (kGather > 1 && kBlock > 0) {
    return kCluster ? static_cast<int>((kRowsMaxStageBytes / 2 / kBlock + kGather - 1) / kGather) : kRunMaxCols;
  } else {
    return 1;
  }
}

template <InputKind K, Fp8Format F, class Rule, int kBlock, class Layout, int kGather, bool kCluster>
__global__ void __launch_bounds__(1024) quantize_rows_pipelined_kernel(RowsArgs a) {
  using In = DeviceInput<K>;
  using T = typename In::storage;
  using S = typename Rule::stored_t;
  constexpr int kVec = 16 / sizeof(T);
  constexpr bool kGathered = kGather > 1;                // scales stored as runs of kGather rows
  constexpr bool kClustered = kGathered && kCluster;     // ... gathered over a cluster
  constexpr bool kRuns = kGathered && !kCluster;         // ... of a block's own consecutive rows
  static_assert(kRowsStages == 2, "the loop below keeps one row ahead");
  static_assert(!Layout::kBlocked, "blocked scales take the octet-tile kernel");
  static_assert(!kGathered || (kBlock != kWholeSet && kGather * sizeof(S) == 32), "a gathered run is one sector");
  extern __shared__ uint4 ring[];  // [kRowsStages][ring_vecs]
  // kGathered: [run parity][owned column][row of the run] (a column's run: 32 bytes,
  // 16-byte aligned)
  constexpr int kGatherCols = gather_max_cols<kBlock, kGather, kCluster>();
  __shared__ uint4 s_gather_words[(kGathered ? 2 : 1) * kGatherCols * ((kGather * sizeof(S) + 15) / 16)];
  auto s_gather = reinterpret_cast<S(*)[kGatherCols][kGather]>(s_gather_words);
  const T* x = static_cast<const T*>(a.x);
  const int64_t nvec = a.cols / kVec;
  const int64_t ring_vecs = ring_stage_vecs<kBlock>(nvec);
  auto issue = [&](int64_t r, int stage) {
    if (r < a.rows) {
      const T* xr = row_ptr_at(x, a, row_pos(a, r));
      for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
        async_copy_16(ring + stage * ring_vecs + (kBlock == kWholeSet ? v : ring_slot(v)), xr + v * kVec);
      }
    }
    async_copy_commit();  // every thread commits every time, so group counts agree
  };
  // kGathered: this block's rank in its cluster (0 for kRuns: it owns every column), and the store
  // of its columns for the run from row `base` (buffer `parity`): a 32-byte run where the kGather
  // rows are consecutive scales of one segment, else one scale a row (none past a.rows).
  const int rank = kClustered ? static_cast<int>(blockIdx.x % kGather) : 0;
  constexpr int64_t kOwnerStride = kClustered ? kGather : 1;
  auto store_gathered = [&](int64_t base, int parity) {
    const int64_t blocks = ceil_div(a.cols, int64_t{kBlock});
    const int64_t owned = blocks > rank ? ceil_div(blocks - rank, kOwnerStride) : 0;
    const RowPos p0 = row_pos(a, base);
    const bool rows_whole = base + kGather <= a.rows && p0.inner + kGather <= a.rows_inner;  // one segment
    for (int64_t c = threadIdx.x; c < owned; c += blockDim.x) {
      const int64_t blk = rank + c * kOwnerStride;
      const S* run = s_gather[parity][c];
      const int64_t i0 = Layout::index(a.scale, p0.outer, p0.inner, blk, 0, 0);
      S* dst = static_cast<S*>(a.scale.ptr) + i0;
      if (rows_whole && i0 >= 0 && i0 + kGather <= a.scale.numel && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
        reinterpret_cast<uint4*>(dst)[0] = reinterpret_cast<const uint4*>(run)[0];
        reinterpret_cast<uint4*>(dst)[1] = reinterpret_cast<const uint4*>(run)[1];
      } else {
        for (int t = 0; t < kGather && base + t < a.rows; ++t) {
          const RowPos p = row_pos(a, base + t);
          store_scale<Rule>(a.scale, Layout::index(a.scale, p.outer, p.inner, blk, 0, 0), run[t]);
        }
      }
    }
  };
  // The row of step i: kRuns, row i % kGather of the block's run i / kGather (runs
  // gridDim.x apart); otherwise rows gridDim.x apart.
  auto row_at = [&](int64_t i) -> int64_t {
    if constexpr (kRuns) return kGather * (static_cast<int64_t>(blockIdx.x) + i / kGather * gridDim.x) + i % kGather;
    else return static_cast<int64_t>(blockIdx.x) + i * gridDim.x;
  };
  int64_t r = row_at(0);
  issue(r, 0);
  // kClustered: a block writes the others' shared memory only after the first wait (all run); the
  // cluster's blocks run the same steps (gridDim.x % kGather == 0): while r - rank is a row.
  // kRuns: while the run's first row is a row (so the loop ends between runs).
  if constexpr (kClustered) cluster_arrive();
  int64_t i = 0;
  for (; r - (kClustered ? rank : (kRuns ? i % kGather : 0)) < a.rows; ++i, r = row_at(i)) {
    issue(row_at(i + 1), static_cast<int>((i + 1) % kRowsStages));
    async_copy_wait<kRowsStages - 1>();
    __syncthreads();
    if constexpr (kClustered) {
      cluster_wait();  // the last step's scales are in; no block still reads this step's buffer
      if (i > 0) store_gathered(r - rank - gridDim.x, static_cast<int>((i - 1) & 1));
    } else if constexpr (kRuns) {
      // the last run's scales are in (every step ends on a barrier); its buffer is next
      // written by the run after this one
      if (i > 0 && i % kGather == 0) store_gathered(row_at(i - kGather), static_cast<int>((i / kGather - 1) & 1));
    }
    if (!kGathered || r < a.rows) {  // uniform over the block
      const uint4* words = ring + (i % kRowsStages) * ring_vecs;
      const RowPos pos = row_pos(a, r);
      uint8_t* qr = q_row_at(a, pos);
      if constexpr (kClustered) {
        rows_block_step<K, F, Rule, kBlock>(words, nvec, qr, a, [&](int64_t blk, S v) {
          *cluster_map_shared(&s_gather[i & 1][blk / kGather][rank], static_cast<unsigned>(blk % kGather)) = v;
        });
      } else if constexpr (kRuns) {
        rows_block_step<K, F, Rule, kBlock>(words, nvec, qr, a, [&](int64_t blk, S v) {
          s_gather[(i / kGather) & 1][blk][i % kGather] = v;
        });
      } else if constexpr (kBlock != kWholeSet) {
        rows_block_step<K, F, Rule, kBlock>(words, nvec, qr, a, [&](int64_t blk, S v) {
          store_scale<Rule>(a.scale, Layout::index(a.scale, pos.outer, pos.inner, blk, 0, 0), v);
        });
      } else {
        __shared__ uint32_t s_red[kMaxWarpsPerBlock + 1];
        const Array<T, kVec>* row = reinterpret_cast<const Array<T, kVec>*>(words);
        uint32_t amax = 0;
        if constexpr (sizeof(T) == 2) {
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
        if (threadIdx.x == 0) store_row_scale<Rule, Layout>(a, pos, sc.stored);
        for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
          store_elems<uint8_t, kVec>(qr + v * kVec, quantize_elems<F, In>(row[v], sc.encode));
        }
      }
    }
    if constexpr (kClustered) cluster_arrive();  // this step's scales are written
    __syncthreads();  // this stage is refilled next iteration
  }
  if constexpr (kClustered) {
    cluster_wait();  // also: no block of the cluster writes here any more
    if (i > 0) store_gathered(r - rank - gridDim.x, static_cast<int>((i - 1) & 1));
  } else if constexpr (kRuns) {
    if (i > 0) store_gathered(row_at(i - kGather), static_cast<int>((i / kGather - 1) & 1));  // i % kGather == 0 here
  }
  async_copy_wait_all();
}

// ---- Blocked scales, octet tiles. A unit: one octet (rows {2i, 2i+1} + {0, 32, 64, 96} of a 128x4
// tile, one 32-byte scale sector) over a kTileSliceBytes slice; each sector is written once, whole,
// padding included (no byte stores, no memset; record 030). Consecutive units: one octet's slices.
constexpr int kTileStages = 2;
// Threads of the tile kernel: kRingVecsPerLane vectors a lane, eight octet rows (a
// namespace constant: a template argument list inside __launch_bounds__ does not
// survive hipify's macro).
constexpr int kTileThreads = 8 * (kTileSliceBytes / 16 / kRingVecsPerLane);

template <InputKind K, int kBlock>
struct TileGeometry {
  using G = RingBlockGeometry<K, kBlock>;
  static constexpr int kSliceVecs = kTileSliceBytes / 16;               // vectors of a row's slice
  static constexpr int kRowLanes = kSliceVecs / kRingVecsPerLane;       // lanes of a row's slice
  static constexpr int kThreads = 8 * kRowLanes;                        // one octet row per kRowLanes lanes
  static_assert(kThreads == kTileThreads, "the kernel's launch bounds");
  static constexpr int kSliceBlocks = kSliceVecs * G::kVec / kBlock;    // scale columns of a slice
  static constexpr int kSliceSectors = kSliceBlocks / 4;
  static_assert(kSliceBlocks % 4 == 0 && (kRowLanes % kWarpSize == 0 || kWarpSize % kRowLanes == 0),
                "a slice holds whole sectors; a row's lanes are whole warps or divide one");
};

struct TilePlan {
  uint32_t slices = 0;      // slices of a row (covering the padded scale columns)
  uint32_t seg_octets = 0;  // octets of a segment's blocked matrix
  uint32_t segments = 1;
  uint32_t units = 0;       // octet units: octets x slices
  int64_t seg_valid = 0;    // rows of a segment that hold scales (no groups): the rest is padding
  uint32_t* work = nullptr;  // a work counter (work_counter), or null: units by the grid's stride
};

// Row j (0..7) of octet o of a blocked matrix: rows {2i, 2i+1} + {0, 32, 64, 96} of
// tile o / 16, i = o % 16; j = 2 * (offset / 32) + parity.
MOE_FP8_HD uint32_t octet_row(uint32_t o, uint32_t j) { return (o / 16) * 128 + (j / 2) * 32 + (o % 16) * 2 + (j % 2); }

// M groups: each token group's first blocked row (starts[g]), from group_starts or
// from the block's own table in shared memory; one int32 of state a lane (the group
// of its last unit), so that the M-group instance fits 64 registers (8 blocks an SM).
struct GroupStarts {
  const int32_t* global;  // a.group_starts, or null: `local` (shared memory)
  const int32_t* local;
  MOE_FP8_DEVICE int32_t operator[](int g) const { return global != nullptr ? global[g] : local[g]; }
};

// The token group whose blocked rows hold blocked row br (the last group starting at or
// before it; 0 if none). A lane's blocked rows only grow from unit to unit, so after a
// binary search for the first one (g < 0) the group is found by walking forward from g.
MOE_FP8_DEVICE int place_group(const RowsArgs& a, const GroupStarts& starts, int64_t br, int g) {
  if (g < 0) {
    int lo = 0, hi = a.groups - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (starts[mid] <= br) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  }
  while (g + 1 < a.groups && starts[g + 1] <= br) ++g;
  return g;
}

// The segment-local reduction row whose scales are blocked row br, or -1 (padding);
// *g: the lane's group cursor (M groups).
template <bool kMGroups>
MOE_FP8_DEVICE int64_t blocked_row_source(const RowsArgs& a, const TilePlan& p, const GroupStarts& starts, int64_t br,
                                          int* g) {
  if constexpr (!kMGroups) return br < p.seg_valid ? br : -1;
  if (a.groups <= 0) return -1;
  *g = place_group(a, starts, br, *g);
  int64_t lo, hi;
  group_range(a.offs, *g, a.rows_inner, &lo, &hi);  // L1 hits: every lane of the block reads these
  const int64_t i = br - starts[*g];
  return i >= 0 && i < hi - lo ? lo + i : -1;
}

// kMGroups: the M-group layout in its own instance (the plain one carries none of its state; a third
// stage takes its guessed first unit). Without group_starts, the groups' first blocked rows live in
// dynamic shared memory (a.groups int32, at most kRowsLocalGroups).
template <InputKind K, Fp8Format F, class Rule, int kBlock, bool kMGroups, int kMinBlocks>
__global__ void __launch_bounds__(kTileThreads, kMinBlocks) quantize_rows_blocked_kernel(RowsArgs a, TilePlan p) {
  using TG = TileGeometry<K, kBlock>;
  using G = typename TG::G;
  using T = typename G::T;
  static_assert(sizeof(typename Rule::stored_t) == 1, "blocked scales are E8M0 bytes");
  __shared__ uint4 stage[kTileStages + (kMGroups ? 1 : 0)][8 * TG::kSliceVecs];
  __shared__ uint4 sectors[TG::kSliceSectors * 2];
  __shared__ uint32_t s_red[kMaxWarpsPerBlock + 1];
  __shared__ int64_t s_scan[kMaxWarpsPerBlock];
  extern __shared__ int32_t s_group_starts[];
  const T* x = static_cast<const T*>(a.x);
  const int j = static_cast<int>(threadIdx.x) / TG::kRowLanes;   // this lane's octet row
  const int lane = static_cast<int>(threadIdx.x) % TG::kRowLanes;
  const int64_t slice_cols = static_cast<int64_t>(TG::kSliceVecs) * G::kVec;
  auto issue = [&](int64_t r, uint32_t slice, int st) {
    {
      const int64_t c0 = slice * slice_cols;
      if (r >= 0) {
        const T* xr = row_ptr_at(x, a, row_pos(a, r));
#pragma unroll
        for (int i = 0; i < kRingVecsPerLane; ++i) {
          const int v = lane + i * TG::kRowLanes;
          if (c0 + static_cast<int64_t>(v) * G::kVec < a.cols) {
            async_copy_16(&stage[st][j * TG::kSliceVecs + ring_slot(v)], xr + c0 + static_cast<int64_t>(v) * G::kVec);
          }
        }
      }
    }
    async_copy_commit();  // every thread commits every time, so group counts agree
  };
  // M groups: the first unit loads before the prologue into its own stage, guessing group 0
  // (blocked row = reduction row); a wrong guess reloads into stage 0 after it, never waiting on
  // the guessed copies (records 003, 025). offs is read first to overlap the guessed copies.
  constexpr bool mgroups = kMGroups;
  const bool has_group = mgroups && static_cast<int>(threadIdx.x) < a.groups;
  const int32_t own_off = has_group ? a.offs[threadIdx.x] : 0;
  int32_t guess = -1;  // rows <= INT32_MAX (run_rows)
  if constexpr (mgroups) {
    const uint32_t oct = blockIdx.x / p.slices;
    const int64_t br = oct < p.seg_octets ? int64_t{octet_row(oct, static_cast<uint32_t>(j))} : a.rows;
    guess = br < a.rows ? static_cast<int32_t>(br) : -1;
    issue(guess, blockIdx.x - oct * p.slices, kTileStages);
  }
  // M groups: rows past every group follow the octets as units of 8 rows. Without group_starts the
  // first blocked rows are summed here (as blocked_group_start). Blocked rows from `used` to M + 128 G
  // hold no scales: zeroed by 16-byte stores, not walked. Counts and rows fit int32 (the launcher).
  int32_t tail_start = static_cast<int32_t>(a.rows);
  const GroupStarts starts{a.group_starts, s_group_starts};
  uint32_t units = p.units;  // octet units walked (M groups: those of the groups' rows)
  if constexpr (mgroups) {
    uint32_t end = has_group ? static_cast<uint32_t>(clamp_offset(own_off, a.rows_inner)) : 0u;
    for (int64_t g = threadIdx.x + blockDim.x; g < a.groups; g += blockDim.x) {
      end = umax(end, static_cast<uint32_t>(clamp_offset(a.offs[g], a.rows_inner)));
    }
    tail_start = static_cast<int32_t>(block_max(end, s_red));
    int64_t used = 0;
    if (a.group_starts == nullptr) {  // at most kRowsLocalGroups groups (the launcher)
      used = block_exclusive_scan(
          [&](int g) {
            int64_t lo, hi;
            group_range(a.offs, g, a.rows_inner, &lo, &hi);
            return blocked_group_extent(a.scale, lo, hi);
          },
          a.groups, s_group_starts, s_scan);
    } else if (a.groups > 0) {
      int64_t lo, hi;
      group_range(a.offs, a.groups - 1, a.rows_inner, &lo, &hi);
      used = a.group_starts[a.groups - 1] + blocked_group_extent(a.scale, lo, hi);
    }
    const int64_t seg_rows = static_cast<int64_t>(p.seg_octets) * 8;
    used = used < 0 ? 0 : (used < seg_rows ? used : seg_rows);  // bad offs: stay in the buffer
    units = static_cast<uint32_t>(used / 8) * p.slices;
    uint8_t* sp = static_cast<uint8_t*>(a.scale.ptr);
    const int64_t step = 16 * static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = used * a.scale.padded_cols + 16 * (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
         i < a.scale.numel; i += step) {
      if (i + 16 <= a.scale.numel) {
        *reinterpret_cast<uint4*>(sp + i) = make_uint4(0, 0, 0, 0);
      } else {  // the buffer ends inside a 16-byte run (its size is a multiple of 4)
        for (int64_t k = i; k + 4 <= a.scale.numel; k += 4) *reinterpret_cast<uint32_t*>(sp + k) = 0;
      }
    }
  }
  // units, rows and the walk fit 32 bits (the launcher's bound, run_rows' row check)
  // M groups: the walk's bounds live in shared memory, read where used (registers: the
  // instance fits 8 blocks an SM)
  __shared__ uint32_t s_walk[3];  // units, total, first tail row
  if constexpr (mgroups) {
    if (threadIdx.x == 0) {
      s_walk[0] = units;
      s_walk[1] = units + static_cast<uint32_t>(ceil_div(a.rows - tail_start, int64_t{8})) * p.slices;
      s_walk[2] = static_cast<uint32_t>(tail_start);
    }
    __syncthreads();
  }
  auto walk = [&](int k) -> uint32_t {
    if constexpr (mgroups) return static_cast<const volatile uint32_t*>(s_walk)[k];
    return k == 0 ? p.units : (k == 1 ? p.units : static_cast<uint32_t>(a.rows));
  };
  // Unit u: this lane's reduction row (-1: none) and the slice; called for the CTA's
  // units in order.
  int cursor = -1;  // M groups: the group of this lane's last unit
  auto unit_row = [&](uint32_t u, uint32_t* slice) -> int32_t {
    const uint32_t oct = u / p.slices;
    *slice = u - oct * p.slices;
    const uint32_t units = walk(0);
    if (u < units) {
      const uint32_t seg = p.segments == 1 ? 0u : oct / p.seg_octets;
      const int64_t src =
          blocked_row_source<kMGroups>(a, p, starts, octet_row(oct - seg * p.seg_octets, static_cast<uint32_t>(j)), &cursor);
      return src < 0 ? -1 : static_cast<int32_t>(seg * a.rows_inner + src);
    }
    // tail rows: units is a multiple of the slices
    const int64_t r = walk(2) + 8 * static_cast<int64_t>(oct - units / p.slices) + j;
    return r < a.rows ? static_cast<int32_t>(r) : -1;
  };
  static_assert(kTileStages == 2, "the loop below keeps one unit ahead");
  // A block's units: blockIdx.x, blockIdx.x + gridDim.x, then 2 gridDim.x + a work-counter ticket
  // (thread 0 takes it a unit ahead, hands it over in s_next) or, without one, every gridDim.x-th.
  // Either way a block's units only grow (the group cursor's walk relies on it).
  __shared__ uint32_t s_next;
  uint32_t u = blockIdx.x;
  uint32_t slice = 0;
  int32_t r = u < walk(1) ? unit_row(u, &slice) : -1;
  // The first unit's data: the guessed copies when the guess holds (per octet row: a row
  // of padding reads nothing, so its guess never matters; the slice is the guessed one,
  // blockIdx.x's, whenever blockIdx.x < units).
  const bool guessed = mgroups && r >= 0 && r == guess && u < walk(0);
  if (guessed) {
    async_copy_commit();
  } else {
    issue(r, slice, 0);
  }
  for (uint32_t i = 0; u < walk(1); ++i) {
    uint32_t next_u = u + gridDim.x;
    uint32_t ticket = 0;
    if (p.work != nullptr) {
      if (i > 0) next_u = static_cast<const volatile uint32_t*>(&s_next)[0];
      if (threadIdx.x == 0) ticket = atomicAdd(p.work, 1u);  // back by the end of this unit
    }
    uint32_t next_slice = 0;
    const int32_t next_r = next_u < walk(1) ? unit_row(next_u, &next_slice) : -1;
    issue(next_r, next_slice, static_cast<int>((i + 1) % kTileStages));
    async_copy_wait<kTileStages - 1>();
    __syncthreads();
    const int64_t c0 = slice * slice_cols;
    const int64_t k0 = c0 + static_cast<int64_t>(lane) * G::kElems;  // this lane's first element
    uint4 w[kRingVecsPerLane];
#pragma unroll
    for (int v = 0; v < kRingVecsPerLane; ++v) {
      const bool valid = r >= 0 && k0 + v * G::kVec < a.cols;
      const int st = guessed && i == 0 ? kTileStages : static_cast<int>(i % kTileStages);
      w[v] = valid ? stage[st][j * TG::kSliceVecs + ring_slot(lane * kRingVecsPerLane + v)]
                   : make_uint4(0, 0, 0, 0);
    }
    const auto sc = encode_ring_unit<K, F, Rule, kBlock>(w, r >= 0 ? q_row_at(a, row_pos(a, r)) : a.q, k0, a.cols, r >= 0);
    const bool octet = u < walk(0);
    // every thread read s_next before the barrier above; the next read is after the one below
    if (p.work != nullptr && threadIdx.x == 0) s_next = 2 * gridDim.x + ticket;
    if (octet && lane % G::kLanes == 0) {
      // the block's byte in its sector: row j's word at 16 * (j % 2) + 4 * (j / 2)
      const int b = lane / G::kLanes;
      const uint8_t code = r >= 0 && k0 < a.cols ? sc.stored : uint8_t{0};
      reinterpret_cast<uint8_t*>(sectors)[(b / 4) * 32 + (j % 2) * 16 + (j / 2) * 4 + b % 4] = code;
    }
    __syncthreads();
    if (octet && threadIdx.x < TG::kSliceSectors * 2) {
      const uint32_t oct = static_cast<uint32_t>(u) / p.slices;
      const uint32_t seg = p.segments == 1 ? 0u : oct / p.seg_octets, in = oct - seg * p.seg_octets;
      const int64_t col_group = static_cast<int64_t>(slice) * TG::kSliceSectors + threadIdx.x / 2;
      if (col_group < a.scale.padded_cols / 4) {
        const int64_t off = seg * a.scale.seg_stride + 512 * ((in / 16) * (a.scale.padded_cols / 4) + col_group) +
                            32 * (in % 16) + 16 * (threadIdx.x % 2);
        uint8_t* dst = static_cast<uint8_t*>(a.scale.ptr) + off;
        const uint4 v = sectors[threadIdx.x];
        if (off + 16 <= a.scale.numel) {
          *reinterpret_cast<uint4*>(dst) = v;
        } else {  // the static tail of an M-group matrix ends inside a tile row
          const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (off + 4 * k + 4 <= a.scale.numel) reinterpret_cast<uint32_t*>(dst)[k] = words[k];
          }
        }
      }
    }
    // the next iteration refills this stage only after its own barrier; the sectors
    // are rewritten after that barrier too
    r = next_r;
    slice = next_slice;
    u = next_u;
  }
  async_copy_wait_all();
  if (p.work != nullptr && threadIdx.x == 0) release_work_counter(p.work);
}

// Flat walk (short rows): one stream of (row, block, lane), so short rows still fill whole warps.
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
                                                               q_row_at(a, pos[u]), a, pos[u],
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

// The octet-tile kernel for blocked scales (vector path, rows > 0, cols > 0).
template <InputKind K, Fp8Format F, class Rule, int kBlock>
int launch_quantize_rows_blocked(const RowsArgs& a, gpuStream_t stream) {
  using TG = TileGeometry<K, kBlock>;
  const int64_t cp = a.scale.padded_cols;
  if (cp <= 0 || cp % 4 != 0) return -1;
  const bool mgroups = a.scale.groups == BlockedGroups::kMGroups;
  if (mgroups && a.group_starts == nullptr && a.groups > kRowsLocalGroups) return -1;
  int64_t seg_rows = mgroups ? round_up(a.scale.numel / cp, 128) : round_up(a.rows_inner, 128);
  int64_t segments = mgroups ? 1 : a.rows / a.rows_inner;
  TilePlan p;
  p.seg_valid = a.rows_inner;
  // Per-expert matrices of whole tile rows, back to back, are one blocked matrix of all
  // the rows (the same bytes in the same places): one segment, so no unit divides by
  // the segment size.
  if (segments > 1 && a.rows == segments * a.rows_inner && a.rows_inner % 128 == 0 &&
      a.scale.seg_stride == seg_rows * cp) {
    seg_rows = a.rows;
    segments = 1;
    p.seg_valid = a.rows;
  }
  const int64_t slices = ceil_div(cp, int64_t{TG::kSliceBlocks});
  const int64_t units = slices * (seg_rows / 8) * segments;
  const int64_t bound = units + (mgroups ? ceil_div(a.rows, int64_t{8}) * slices : 0);  // with the tail units
  if (bound >= (int64_t{1} << 31)) return -1;
  p.slices = static_cast<uint32_t>(slices);
  p.seg_octets = static_cast<uint32_t>(seg_rows / 8);
  p.segments = static_cast<uint32_t>(segments);
  p.units = static_cast<uint32_t>(units);
  // Units from a work counter where a block can take more than two (record 028; ROCm
  // keeps the stride); tuning rows_dynamic="0" walks by the stride (tests).
  const bool dynamic = !kRocm && tuning_switch(Knob::kRowsDynamic) != 0;
  // M groups without group_starts: the block's table of group starts (dynamic shared memory)
  const size_t smem = mgroups && a.group_starts == nullptr ? static_cast<size_t>(a.groups) * sizeof(int32_t) : 0;
  // per_sm: blocks an SM at most (0: as many as fit)
  auto launch = [&](auto kernel, int per_sm) {
    const int fit = resident_blocks(kernel, TG::kThreads, smem);
    const int64_t resident = static_cast<int64_t>(per_sm > 0 ? std::min(fit, per_sm) : fit) * multiprocessor_count();
    const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(bound, resident))));
    if (dynamic && bound > 2 * static_cast<int64_t>(grid.x)) p.work = work_counter(stream);
    return launch_kernel(kernel, grid, dim3(TG::kThreads), smem, stream, 1, a, p);
  };
  // Blocks an SM: plain instance 9, M-group instance 8 in 64 registers (record 004; ROCm: no
  // target). The M-group grid: 6 an SM where padding is at most an eighth of the rows, scaled by
  // DRAM bandwidth an SM against kTileRefBytesPerNsPerSm (records 023, 024).
  if (mgroups) {
    int per_sm = 0;
    if (!kRocm && int64_t{8} * 128 * a.groups <= a.rows) {
      const double bw = dram_bytes_per_ns_per_sm(current_device());
      per_sm = bw > 0 ? std::max(kTileMGroupBlocksPerSm,
                                 static_cast<int>(std::ceil(kTileMGroupBlocksPerSm * bw / kTileRefBytesPerNsPerSm - 0.05)))
                      : 0;
    }
    return launch(quantize_rows_blocked_kernel<K, F, Rule, kBlock, true, kRocm ? 1 : 8>, per_sm);
  }
  return launch(quantize_rows_blocked_kernel<K, F, Rule, kBlock, false, kRocm ? 1 : 9>, 0);
}

template <InputKind K, Fp8Format F, class Rule, int kBlock, class Layout>
int launch_quantize_rows(const RowsArgs& a, gpuStream_t stream) {
  using T = typename DeviceInput<K>::storage;
  constexpr int kVecN = 16 / sizeof(T);
  // Blocked scales: the launch writes the whole buffer, padding zeros included (the
  // octet-tile kernel on the vector path; the other kernels write the blocks only,
  // after a memset).
  const bool vec = rows_vector_ok<T>(a);
  const bool qvec = vec && reinterpret_cast<uintptr_t>(a.q) % 16 == 0 && a.q_stride_outer % 16 == 0;
  const bool ring_ok = vec && a.cols * static_cast<int64_t>(sizeof(T)) <= kRowsMaxStageBytes &&
                       (kBlock == kWholeSet ||
                        (qvec && ceil_div(a.cols, RowsBlockGeometry<K, kBlock, true>::kChunk) >= kBlockRowMinChunks));
  if constexpr (Layout::kBlocked) {
    if (qvec && a.rows > 0 && a.cols > 0) return launch_quantize_rows_blocked<K, F, Rule, kBlock>(a, stream);
    if (a.scale.numel > 0) {
      const int err = memset_async(a.scale.ptr, 0, static_cast<size_t>(a.scale.numel), stream);
      if (err != 0) return err;
    }
  }
  if (a.rows == 0 || (kBlock != kWholeSet && a.cols == 0)) return 0;
  // The ring kernel (vector path, rows that fit a stage): about kRowsVecsPerThread vectors a thread,
  // 64 to 256 threads. Linear scales only (blocked ones take the octet-tile kernel), so the lambda
  // is generic over the layout and instantiated only where it is called.
  auto launch_ring = [&](auto layout) {
    using L = decltype(layout);
    const int64_t nvec = a.cols / kVecN;
    const int64_t pthreads = std::min<int64_t>(
        std::max<int64_t>(round_up(ceil_div(nvec, kRowsVecsPerThread), kWarpSize), 2 * kWarpSize), 256);
    const size_t smem = static_cast<size_t>(kRowsStages * ring_stage_vecs<kBlock>(nvec) * 16);
    // fp32 scales in a column-major layout (a row's scale one element after the previous
    // row's): gathered over clusters where the device has them, for rows of at least 8 KB
    // of 16-bit elements and at least kGatherMinSteps steps a cluster (record 030).
    constexpr int kGather =
        kBlock != kWholeSet && sizeof(T) == 2 && sizeof(typename Rule::stored_t) * kGatherRows == 32 ? kGatherRows : 1;
    if constexpr (kGather > 1) {
      // tuning rows_gather: 0 = never, 1 = wherever the layout and device allow (tests).
      const int mode = tuning_switch(Knob::kRowsGather);
      if (mode != 0 && a.scale.set_stride == 1 && a.rows >= kGather && supports_clusters(current_device())) {
        auto kernel = quantize_rows_pipelined_kernel<K, F, Rule, kBlock, L, kGather, true>;
        const int64_t clusters = resident_clusters_x(kernel, static_cast<int>(pthreads), smem, kGather);
        const int64_t steps = ceil_div(a.rows, int64_t{kGather});
        const bool pays = a.cols * static_cast<int64_t>(sizeof(T)) >= kGatherMinRowBytes &&
                          steps >= kGatherMinSteps * clusters;
        if (clusters > 0 && (mode == 1 || pays)) {
          const dim3 grid(static_cast<unsigned>(kGather * std::min(clusters, steps)));
          return launch_kernel_in_clusters(kernel, grid, dim3(static_cast<unsigned>(pthreads)), smem, stream,
                                           dim3(kGather, 1, 1), a);
        }
      }
      // Elsewhere, rows of at most kRunMaxCols blocks: runs of a block's own rows, for rows of at
      // least kRunMinRowBytes and kRunMinRuns runs a resident block (record 030).
      // tuning rows_runs: 0 = never, 1 = wherever the layout allows (tests).
      const int runs = tuning_switch(Knob::kRowsRuns);
      if (runs != 0 && a.scale.set_stride == 1 && ceil_div(a.cols, int64_t{kBlock}) <= kRunMaxCols) {
        auto kernel = quantize_rows_pipelined_kernel<K, F, Rule, kBlock, L, kGather, false>;
        const int64_t resident =
            static_cast<int64_t>(resident_blocks(kernel, static_cast<int>(pthreads), smem)) * multiprocessor_count();
        const int64_t run_count = ceil_div(a.rows, int64_t{kGather});
        const bool pays =
            a.cols * static_cast<int64_t>(sizeof(T)) >= kRunMinRowBytes && run_count >= kRunMinRuns * resident;
        if (runs == 1 || pays) {
          const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(run_count, resident))));
          return launch_kernel(kernel, grid, dim3(static_cast<unsigned>(pthreads)), smem, stream, 1, a);
        }
      }
    }
    auto kernel = quantize_rows_pipelined_kernel<K, F, Rule, kBlock, L, 1, false>;
    const int64_t resident =
        static_cast<int64_t>(resident_blocks(kernel, static_cast<int>(pthreads), smem)) * multiprocessor_count();
    const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(a.rows, resident))));
    return launch_kernel(kernel, grid, dim3(static_cast<unsigned>(pthreads)), smem, stream, 1, a);
  };
  if constexpr (kBlock != kWholeSet) {
    // The vector path writes each lane's chunk of q with one store: q is [rows, cols]
    // contiguous, so with cols a multiple of the chunk an aligned base keeps every
    // chunk aligned.
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
    if constexpr (!Layout::kBlocked) {
      if (ring_ok) return launch_ring(Layout{});
    }
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
    if constexpr (!Layout::kBlocked) {
      if (ring_ok) return launch_ring(Layout{});
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
