// The engine's "cols" shape on the GPU (reduce along a strided dimension segment by segment, q
// written transposed so every reduction set is contiguous), over the policies of policies.h, and its
// launch plan. Raw pointers, sizes and a stream only (no torch headers): any target, hipified as is.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../core/device_runtime.h"
#include "../core/numerics.h"
#include "../core/portability.h"
#include "../core/reduce.cuh"
#include "../core/tuning_constants.h"
#include "../core/vec.cuh"
#include "engine.h"
#include "rows_kernel.cuh"

namespace moe_fp8 {

// ---- "cols": a block owns a 128-byte tile of each input row and one slice of one segment, staged
// in shared memory `cache_rows` rows at a time (async copies on the vector path); each thread reduces
// its fragment's column amax, then writes one 8-byte q run a column. Rows past the cache: read twice.
constexpr int kColsThreads = 256;
constexpr int kColsTileBytes = 128;  // of each input row per block
constexpr int kColsGroupBytes = 8;   // of each tile row per thread fragment
constexpr int kColsFragRows = 8;     // rows per fragment: one 8-byte q run per column
constexpr int kColsColGroups = kColsTileBytes / kColsGroupBytes;  // thread t's column group: t / kColsRowBlocks
constexpr int kColsRowBlocks = kColsThreads / kColsColGroups;  // rows [8 rb, 8 rb + 8) a pass, rb = t % this
constexpr int kColsPassRows = kColsRowBlocks * kColsFragRows;  // rows one pass of the block covers
constexpr int kColsUnroll = 4;  // loads in flight per thread on the scalar (strided) path
constexpr int kColsMaxCluster = 8;  // long segments: blocks of a cluster split one, sharing amax in DSMEM
// Four blocks an SM: 64 registers a thread (a few strided blocked and fp32 FLOOR paths spill).
constexpr int kColsMinBlocks = 4;
static_assert(kColsThreads % kColsColGroups == 0 && kColsRowBlocks <= 16, "row blocks are lanes of one warp");

template <InputKind K>
struct ColsGeometry {
  using T = typename DeviceInput<K>::storage;
  static constexpr int kTileCols = kColsTileBytes / static_cast<int>(sizeof(T));
  static constexpr int kColsPer = kColsGroupBytes / static_cast<int>(sizeof(T));  // columns per fragment
};

// Byte offset of (row r, byte b of the row) in the tile: 16-byte chunk j of row r sits at chunk
// j ^ ((r / 8) % 8), so fragment reads and row-wise staging writes run at full shared-memory width.
MOE_FP8_DEVICE int tile_offset(int r, int b) {
  return r * kColsTileBytes + ((((b >> 4) ^ ((r / kColsFragRows) & 7)) << 4) | (b & 15));
}

MOE_FP8_DEVICE uint32_t ceil_div_u32(uint32_t a, uint32_t b) { return (a + b - 1) / b; }
MOE_FP8_DEVICE uint32_t round_up_u32(uint32_t a, uint32_t b) { return ceil_div_u32(a, b) * b; }

// The block's input rows: row r at lo + r * sr, or, from `split` on, at
// hi + (r - split) * sr (ColsOperand::x_hi; split = INT64_MAX without one).
template <typename T>
struct ColsRows {
  const T* lo;
  const T* hi;
  int64_t split;
  MOE_FP8_DEVICE const T* row(int64_t r, int64_t sr) const { return r < split ? lo + r * sr : hi + (r - split) * sr; }
};

// Copies rows [lo, lo + n) of the block's slice (columns from the block's first) into
// tile rows [0, n) and waits. The vector path moves 16 bytes per thread and row
// (8 threads a row); the scalar path one element of any stride.
template <typename T, bool kVec>
MOE_FP8_DEVICE void stage_rows(const ColsRows<T>& xblk, int64_t sr, int64_t sc, int64_t lo, int n,
                               int64_t valid_cols, uint8_t* tile) {
  constexpr int kTileCols = kColsTileBytes / static_cast<int>(sizeof(T));
  if constexpr (kVec) {
    constexpr int kPerRow = kColsTileBytes / 16;
    constexpr int kElems = 16 / static_cast<int>(sizeof(T));
    const int tx = threadIdx.x % kPerRow;
    if (tx * kElems >= valid_cols) return;  // the block's columns past the operand (vector path: whole chunks)
    (void)sc;
    for (int i = threadIdx.x / kPerRow; i < n; i += kColsThreads / kPerRow) {
      async_copy_16(tile + tile_offset(i, tx * 16), xblk.row(lo + i, sr) + tx * kElems);
    }
    async_copy_wait_all();
  } else {
    constexpr int kRowsPerStep = kColsThreads / kTileCols;
    const int tx = threadIdx.x % kTileCols;
    const int ty = threadIdx.x / kTileCols;
    if (tx >= valid_cols) return;
    const int64_t col = tx * sc;
    for (int i0 = 0; i0 < n; i0 += kRowsPerStep * kColsUnroll) {
      T v[kColsUnroll];
#pragma unroll
      for (int u = 0; u < kColsUnroll; ++u) {
        const int i = i0 + ty + u * kRowsPerStep;
        if (i < n) v[u] = xblk.row(lo + i, sr)[col];
      }
#pragma unroll
      for (int u = 0; u < kColsUnroll; ++u) {
        const int i = i0 + ty + u * kRowsPerStep;
        if (i < n) *reinterpret_cast<T*>(tile + tile_offset(i, tx * static_cast<int>(sizeof(T)))) = v[u];
      }
    }
  }
}

// A thread's fragment: kColsFragRows rows x 8 bytes of the tile (two 32-bit words a row); rows at
// or past `n` (padding, or past the slice) read as zero. `first` is a multiple of kColsFragRows, so
// the whole fragment shares one swizzle and each row is one load at a constant offset.
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
    return DeviceInput<K>::to_float(bits_float(w));  // (kFP32AsBF16: rounded to bf16)
  } else if constexpr (K == InputKind::kBF16) {
    return bits_float((c % 2) ? (w & 0xFFFF0000u) : (w << 16));  // the bf16 bits in place
  } else {
    return DeviceInput<K>::to_float(static_cast<uint16_t>((c % 2) ? (w >> 16) : (w & 0xFFFFu)));
  }
}

// Column c of a fragment encoded with encode multiplier s: the 8 bytes of its q run.
template <InputKind K, Fp8Format F>
MOE_FP8_DEVICE uint2 encode_fragment_run(const ColsFragment& f, int c, float s) {
  uint32_t w[kColsFragRows / 4];
#pragma unroll
  for (int j = 0; j < kColsFragRows / 4; ++j) {
    const uint16_t lo = scaled_fp8x2<F>(fragment_value<K>(f, 4 * j, c), fragment_value<K>(f, 4 * j + 1, c), s);
    const uint16_t hi = scaled_fp8x2<F>(fragment_value<K>(f, 4 * j + 2, c), fragment_value<K>(f, 4 * j + 3, c), s);
    w[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  static_assert(kColsFragRows == 8, "one 8-byte run");
  return make_uint2(w[0], w[1]);
}

// Encodes column c of a fragment with encode multiplier s into the q run at dst, of
// which `room` bytes belong to the chunk: one 8-byte store when whole and aligned.
template <InputKind K, Fp8Format F>
MOE_FP8_DEVICE void store_fragment_run(const ColsFragment& f, int c, float s, uint8_t* dst, int room) {
  const uint2 w = encode_fragment_run<K, F>(f, c, s);
  if (room >= kColsFragRows && reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
    *reinterpret_cast<uint2*>(dst) = w;
  } else {  // a partial or unaligned run, byte by byte (w's words indexed by constants only)
#pragma unroll
    for (int k = 0; k < kColsFragRows; ++k) {
      if (k < room) dst[k] = static_cast<uint8_t>((k < 4 ? w.x : w.y) >> (8 * (k % 4)));
    }
  }
}

// Bytes [lo, hi) of the 8-byte word v (byte k at bits 8k) to word[lo, hi), word
// 8-byte aligned: one 8-byte store when whole, else at most five naturally aligned
// 1-, 2- and 4-byte stores.
MOE_FP8_DEVICE void store_word_bytes(uint8_t* word, uint64_t v, int lo, int hi) {
  if (lo >= hi) return;
  if (lo == 0 && hi == 8) {
    *reinterpret_cast<uint64_t*>(word) = v;
    return;
  }
  int k = lo;
  if ((k & 1) && k < hi) {
    word[k] = static_cast<uint8_t>(v >> (8 * k));
    k += 1;
  }
  if ((k & 2) && k + 2 <= hi) {
    *reinterpret_cast<uint16_t*>(word + k) = static_cast<uint16_t>(v >> (8 * k));
    k += 2;
  }
  if (k + 4 <= hi) {  // then k is 0 or 4 (a k of 2 or 6 left here has hi < k + 2)
    *reinterpret_cast<uint32_t*>(word + k) = static_cast<uint32_t>(v >> (8 * k));
    k += 4;
  }
  if (k + 2 <= hi) {
    *reinterpret_cast<uint16_t*>(word + k) = static_cast<uint16_t>(v >> (8 * k));
    k += 2;
  }
  if (k < hi) word[k] = static_cast<uint8_t>(v >> (8 * k));
}

// One 128-row pass (`len` q rows) of runs off the 8-byte grid, as aligned words: column c's run at
// col0 + c * q_sc, d its address % 8; lane rb writes rows [8 rb - d, 8 rb - d + 8) from lane rb - 1's
// run (a shuffle) and its own, lane 15 also its last d. Every lane calls it, with the same `len`.
template <InputKind K, Fp8Format F, int kC>
MOE_FP8_DEVICE void store_fragment_runs_shifted(const ColsFragment& f, const float (&s)[kC], const bool (&col_ok)[kC],
                                                uint8_t* col0, int64_t q_sc, int len, int rb) {
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  const int prev_lane = (lane & ~(kColsRowBlocks - 1)) | ((lane - 1) & (kColsRowBlocks - 1));
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const uint2 w = encode_fragment_run<K, F>(f, c, s[c]);
    const uint64_t own = (static_cast<uint64_t>(w.y) << 32) | w.x;
    const uint64_t prev = (static_cast<uint64_t>(warp_shfl(w.y, prev_lane)) << 32) | warp_shfl(w.x, prev_lane);
    if (!col_ok[c]) continue;
    uint8_t* col = col0 + c * q_sc;
    const int d = static_cast<int>(reinterpret_cast<uintptr_t>(col) % 8);
    uint8_t* word = col - d + kColsFragRows * rb;  // aligned
    const int at = kColsFragRows * rb - d;            // the word's first row in the pass
    const uint64_t v = d == 0 ? own : (prev >> (8 * (8 - d))) | (own << (8 * d));
    store_word_bytes(word, v, std::max(0, -at), std::min(8, len - at));
    if (rb == kColsRowBlocks - 1 && d > 0) {  // the pass's last d rows
      store_word_bytes(word + 8, own >> (8 * (8 - d)), 0, std::min(d, len - at - 8));
    }
  }
}

// Running column amax of fragments, kept packed: per 32-bit word, the max of the
// sign-cleared elements (two 16-bit lanes, see amax16x2_add, or one float's abs_bits,
// converted at the end: kFP32AsBF16's rounding keeps the order, so it may come last).
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
  // The amax of column c as float abs bits (c may be a run-time value: selects, not an
  // indexed register array).
  MOE_FP8_DEVICE uint32_t column_bits(int c) const {
    if constexpr (!kPacked) return float_bits(DeviceInput<K>::to_float(bits_float(c == 0 ? w[0] : w[1])));
    else return amax16x2_lane_bits<DeviceInput<K>>(c < 2 ? w[0] : w[1], c % 2 != 0);
  }
};

// cols_scale_col_base on the GPU. K-group blocked scales without group_starts (unpadded groups):
// each warp sums the blocked widths of the groups before seg_id (blocked_group_start's sum), so no
// table launch precedes the kernel. Every thread of the block calls it, with the same segment.
template <class Layout>
MOE_FP8_DEVICE int64_t cols_col_base_gpu(const ColsArgs& a, const ScaleOut& s, int seg_id, const Segment& seg,
                                         int block) {
  if (!Layout::kBlocked || s.groups != BlockedGroups::kKGroups || a.group_starts != nullptr) {
    return cols_scale_col_base<Layout>(a, s, seg_id, seg, block);
  }
  int64_t sum = 0;
  for (int j = static_cast<int>(threadIdx.x % kWarpSize); j < seg_id; j += kWarpSize) {
    int64_t lo, hi;
    group_range(a.offs, j, a.rows, &lo, &hi);
    sum += blocked_group_extent(s, lo, hi);
  }
  for (int m = kWarpSize / 2; m >= 1; m >>= 1) sum += warp_shfl_xor_i64(sum, m);
  return sum;
}

// Whole-set pass 2 over the block's slice: chunk 0 is in the tile already, later chunks are staged
// again; padding rows encode as zero. kShifted: q runs off the 8-byte grid (every lane in each pass).
// `my_*` as in the kernel; qblk: the thread's first column's q at the slice's first row.
template <InputKind K, Fp8Format F, bool kVec, int kC, bool kShifted>
MOE_FP8_DEVICE void cols_pass2(const ColsOperand& op, const ColsRows<typename DeviceInput<K>::storage>& xblk,
                               int64_t my_start, int my_len, int my_qlen, int cache_rows, int64_t valid_cols,
                               uint8_t* qblk, uint8_t* tile, int rb, int cg, const float (&s)[kC],
                               const bool (&col_ok)[kC]) {
  using T = typename DeviceInput<K>::storage;
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
      if constexpr (kShifted) {
        ColsFragment f;
        load_fragment(tile, r0, n, cg, f);
        store_fragment_runs_shifted<K, F, kC>(f, s, col_ok, qblk + base + p, op.q_sc,
                                              nq - p < kColsPassRows ? nq - p : kColsPassRows, rb);
      } else {
        if (r0 >= nq) continue;
        ColsFragment f;
        load_fragment(tile, r0, n, cg, f);
#pragma unroll
        for (int c = 0; c < kC; ++c) {
          if (col_ok[c]) store_fragment_run<K, F>(f, c, s[c], qblk + c * op.q_sc + base + r0, nq - r0);
        }
      }
    }
  }
}

// kShift: pass 2 checks whether the slice's q runs are off the 8-byte grid and stores them as
// aligned words (else byte by byte: correct, slow); cols_runs_may_shift decides. Two instances:
// the check and its loop cost the aligned launches (record 030).
template <InputKind K, Fp8Format F, class Rule, int kBlock, class Layout, bool kVec, bool kShift>
__global__ void __launch_bounds__(kColsThreads, kColsMinBlocks)
    quantize_cols_kernel(ColsArgs a, int cluster, int cache_rows, int slice_rows) {
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
  // Row counts below are 32-bit (the launcher checks rows < 2^31 - 2^16, room for a
  // chunk rounded up and its offset): 64-bit division is a
  // long software sequence, and this setup runs once per block.
  const int q_len = static_cast<int>(seg.q_len);
  // A slice is whole fragments; in block mode whole blocks (blocks restart at the
  // segment's first q row), so the slices of a segment are independent.
  constexpr int kSliceUnit = kBlock == kWholeSet ? kColsFragRows : kBlock;
  // Block mode over token groups (slice_rows > 0): each segment takes as many of its
  // `cluster` blocks as slices of about slice_rows rows need, at most all of them (the
  // rest get no rows), so a large group is spread over more blocks than a small one.
  const int slices = slice_rows > 0 ? std::max(1, std::min(cluster, static_cast<int>(ceil_div_u32(q_len, slice_rows))))
                                    : cluster;
  const int chunk = static_cast<int>(round_up_u32(ceil_div_u32(q_len, slices), kSliceUnit));
  const int my_off = std::min(q_len, rank * chunk);
  const int my_qlen = std::min(q_len, my_off + chunk) - my_off;
  const int64_t my_start = seg.start + my_off;
  const int my_len = std::max(0, std::min(static_cast<int>(seg.end - seg.start) - my_off, my_qlen));
  const int64_t valid_cols = seg.zero_fill ? 0 : op.cols - c0;
  const int64_t blk_off = seg.batch * op.sb + c0 * op.sc;
  const ColsRows<T> xblk{static_cast<const T*>(op.x) + blk_off,
                         op.x_hi == nullptr ? nullptr : static_cast<const T*>(op.x_hi) + blk_off,
                         op.x_hi == nullptr ? INT64_MAX : op.row_split};

  const int tid = threadIdx.x;
  const int rb = tid % kColsRowBlocks;
  const int cg = tid / kColsRowBlocks;

  if constexpr (kBlock != kWholeSet) {
    // Blocks of kBlock rows (dividing a pass) from the segment's first q row; a column's block amax
    // is a butterfly over its kBlock / kColsFragRows lanes, lane j computes column j's scale once and
    // shuffles its multiplier. `cluster` blocks: independent slices of whole blocks.
    static_assert(kColsPassRows % kBlock == 0 && kBlock % kColsFragRows == 0, "blocks tile a pass");
    constexpr int kLanes = kBlock / kColsFragRows;
    // FLOOR's scale is a few integer operations: each lane computes its own (record 026).
    constexpr bool kShareScales = !std::is_same_v<Rule, E8m0Floor>;
    static_assert(kLanes >= kC && (kLanes & (kLanes - 1)) == 0, "a lane of the block per column");
    const int lane = static_cast<int>(threadIdx.x % kWarpSize);
    const int block_lane0 = lane & ~(kLanes - 1);  // the block's first lane
    const int in_block = lane - block_lane0;       // this lane's place among the block's (rb % kLanes)
    const int own_c = in_block % kC;               // the column whose scale this lane computes
    const bool own_store = in_block < kC;
    bool col_ok[kC];
#pragma unroll
    for (int c = 0; c < kC; ++c) col_ok[c] = c0 + cg * kC + c < op.cols;
    // The tail segment (past the groups) has no scales (and no entry in group_starts)
    // unless the op asks for zero linear ones (ColsArgs::tail_scales).
    const bool scales = !seg.zero_fill || (!Layout::kBlocked && a.tail_scales);
    const int64_t col_base = scales ? cols_col_base_gpu<Layout>(a, op.scale, seg_id, seg, kBlock) : 0;
    const int64_t group_cols = round_up(ceil_div(seg.q_len, kBlock), 4);  // a K group's own blocked width
    // This thread's kC columns S + c (kC divides 32) share a 32-row group of a blocked matrix: the
    // scale of (S + c, block blk) is at index(S, 0) + 16 c + 512 (blk / 4) + blk % 4, the 64-bit
    // per-column part of BlockedScales::index resolved once (per scale it spilled registers).
    static_assert(32 % kC == 0, "a thread's columns share a 32-row group");
    const int64_t scale_base =
        Layout::kBlocked ? Layout::index(op.scale, seg_id, c0 + cg * kC, 0, 0, col_base, group_cols) : 0;
    uint8_t* qblk = op.q + seg.batch * op.q_sb + (c0 + cg * kC) * op.q_sc + seg.q_start + my_off;
    const int qchunks = static_cast<int>(ceil_div_u32(my_qlen, cache_rows));
    for (int ch = 0; ch < qchunks; ++ch) {
      const int base = ch * cache_rows;
      const int nq = std::min(cache_rows, my_qlen - base);
      const int n = std::max(0, std::min(nq, my_len - base));
      if (ch > 0) __syncthreads();  // the previous chunk's readers are done
      if (n > 0) stage_rows<T, kVec>(xblk, op.sr, op.sc, my_start + base, n, valid_cols, tile);
      __syncthreads();
      for (int p = 0; p < nq; p += kColsPassRows) {  // uniform over the block: lanes shuffle
        const int r0 = p + rb * kColsFragRows;
        ColsFragment f;
        load_fragment(tile, r0, n, cg, f);
        ColsAmax<K> amax;
        amax.add(f);
        amax.reduce_lanes(kLanes);
        const int64_t blk = (my_off + base + r0) / kBlock;
        // Blocked: the offset past scale_base in unsigned 32 bits, under 2^32 while blk < 2^25 (run_cols
        // allows at most 2^30 q rows with blocked scales); 64 bits spills more registers, and a signed
        // 32-bit product overflows from 2^29 rows.
        const uint32_t blk32 = static_cast<uint32_t>(blk);
        // The scale of (block, column c) at its place.
        auto scale_at = [&](int c) -> int64_t {
          return Layout::kBlocked ? scale_base + (512u * (blk32 / 4) + 16u * static_cast<uint32_t>(c) + blk32 % 4)
                                  : Layout::index(op.scale, seg_id, c0 + cg * kC + c, blk, 0, col_base, group_cols);
        };
        if constexpr (kShareScales) {
          const auto own = Rule::template from_amax_bits<F>(amax.column_bits(own_c));
          const float own_enc = seg.zero_fill ? 0.0f : own.encode;
          // the block's scales go with its first rows (a last block may end inside the chunk)
          if (r0 - in_block * kColsFragRows < nq && own_store && scales && c0 + cg * kC + own_c < op.cols) {
            store_scale<Rule>(op.scale, scale_at(own_c), seg.zero_fill ? typename Rule::stored_t{} : own.stored);
          }
          // every lane takes part in the shuffles: rows past the chunk store nothing
#pragma unroll
          for (int c = 0; c < kC; ++c) {
            const float enc = bits_float(warp_shfl(float_bits(own_enc), block_lane0 + c));
            if (r0 < nq && col_ok[c]) store_fragment_run<K, F>(f, c, enc, qblk + c * op.q_sc + base + r0, nq - r0);
          }
        } else {
          if (r0 >= nq) continue;
#pragma unroll
          for (int c = 0; c < kC; ++c) {
            if (!col_ok[c]) continue;
            const auto sc = Rule::template from_amax_bits<F>(amax.column_bits(c));
            if (rb % kLanes == 0 && scales) {
              store_scale<Rule>(op.scale, scale_at(c), seg.zero_fill ? typename Rule::stored_t{} : sc.stored);
            }
            store_fragment_run<K, F>(f, c, seg.zero_fill ? 0.0f : sc.encode, qblk + c * op.q_sc + base + r0, nq - r0);
          }
        }
      }
    }
    return;
  }

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
    const auto sc = Rule::template from_amax_bits<F>(s_amax[tid]);
    s_enc[tid] = seg.zero_fill ? 0.0f : sc.encode;
    if (rank == 0 && !seg.zero_fill && c0 + tid < op.cols) {
      store_scale<Rule>(op.scale, Layout::index(op.scale, seg_id, c0 + tid, 0, 0, 0), sc.stored);
    }
  }
  __syncthreads();

  // Pass 2: encode fragment by fragment into 8-byte runs of each column.
  float s[kC];
  bool col_ok[kC];
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    s[c] = s_enc[cg * kC + c];
    col_ok[c] = c0 + cg * kC + c < op.cols;
  }
  uint8_t* qblk = op.q + seg.batch * op.q_sb + (c0 + cg * kC) * op.q_sc + seg.q_start + my_off;
  // Runs not all 8-byte aligned (a group start or the q stride off the 8-row grid; the
  // chunks and passes keep the alignment, whole fragments from the slice's start):
  // stored as aligned words from neighbouring lanes' runs. Uniform over the block.
  const bool shifted = kShift &&
      ((reinterpret_cast<uintptr_t>(op.q + seg.batch * op.q_sb + c0 * op.q_sc + seg.q_start + my_off) |
        static_cast<uintptr_t>(op.q_sc)) % 8) != 0;
  if (shifted) {
    cols_pass2<K, F, kVec, kC, true>(op, xblk, my_start, my_len, my_qlen, cache_rows, valid_cols, qblk, tile, rb, cg,
                                     s, col_ok);
  } else {
    cols_pass2<K, F, kVec, kC, false>(op, xblk, my_start, my_len, my_qlen, cache_rows, valid_cols, qblk, tile, rb,
                                      cg, s, col_ok);
  }
}

template <typename T>
inline bool cols_vector_ok(const ColsOperand& op) {
  constexpr int64_t n = 16 / sizeof(T);
  return op.sc == 1 && op.cols % n == 0 && op.sr % n == 0 && op.sb % n == 0 &&
         reinterpret_cast<uintptr_t>(op.x) % 16 == 0 && reinterpret_cast<uintptr_t>(op.x_hi) % 16 == 0;
}

struct ColsLaunchPlan {
  int cluster;         // blocks per segment (whole-set: one hardware cluster; block mode: independent slices)
  int cache_rows;      // rows staged in shared memory at a time
  int slice_rows = 0;  // block mode over token groups: slices of about this many rows, up to `cluster`
};

// Cluster size and cached rows a block from the expected segment length: the fewest blocks (a power
// of two, up to kColsMaxCluster) whose slices fit kColsSmemBudget; the rest of a longer slice is read
// twice. Long segments and token groups at a 2-block cluster: below (record 030).

// Block mode (blocks of 32 or 128 rows) needs no cross-block exchange: a segment's slices (about
// kColsBlockSliceRows rows, whole blocks) are independent thread blocks, each staging up to
// kColsBlockCacheRows rows (whole passes) at a time: short slices in many blocks (record 001).
inline ColsLaunchPlan plan_cols_launch(int64_t expected_rows, int num_segments, int max_smem_bytes,
                                       bool clusters, int block = kWholeSet, bool jagged = false) {
  const int64_t budget = std::min<int64_t>(max_smem_bytes - 8192, kColsSmemBudget);
  const int64_t max_rows = std::max<int64_t>(budget / kColsTileBytes / kColsFragRows * kColsFragRows, kColsFragRows);
  if (block != kWholeSet) {
    // Slices of about kColsBlockSliceRows rows (whole blocks): a long segment (one
    // unsplit operand of 65536 rows) is spread over many blocks instead of walked by
    // one block per column tile.
    const int64_t pass_rows = std::max<int64_t>(max_rows / kColsPassRows * kColsPassRows, kColsPassRows);
    int64_t slices = std::max<int64_t>(ceil_div(std::max<int64_t>(expected_rows, 1), kColsBlockSliceRows), 1);
    slices = std::min<int64_t>(slices, std::max<int64_t>(65535 / std::max(num_segments, 1), 1));
    const int64_t slice_rows = round_up(ceil_div(std::max<int64_t>(expected_rows, 1), slices), kColsPassRows);
    const int64_t cache_rows = std::min<int64_t>(slice_rows, std::min<int64_t>(pass_rows, kColsBlockCacheRows));
    return {static_cast<int>(slices), static_cast<int>(cache_rows)};
  }
  int cluster = 1;
  if (clusters) {
    while (cluster < kColsMaxCluster && ceil_div(expected_rows, cluster) > max_rows) cluster *= 2;
    while (cluster > 1 && static_cast<int64_t>(num_segments) * cluster > 65535) cluster /= 2;
  }
  const int64_t slice = round_up(std::max<int64_t>(ceil_div(expected_rows, cluster), 1), kColsFragRows);
  int64_t rows = std::min<int64_t>(slice, max_rows);
  const int64_t whole_sm =
      std::max<int64_t>((max_smem_bytes - 8192) / kColsTileBytes / kColsFragRows * kColsFragRows, max_rows);
  if (clusters && cluster == kColsMaxCluster && slice > kColsLongSliceRows) {
    // Slices over kColsLongSliceRows even in the largest cluster cache that many rows (two blocks an
    // SM), or past twice that all of an SM's shared memory (one block): re-reading most from DRAM loses.
    rows = std::min<int64_t>(slice > 2 * kColsLongSliceRows ? whole_sm : kColsLongSliceRows, whole_sm);
  } else if (jagged && cluster == 2) {
    // Token groups: one block a group slice with all of an SM's shared memory, so a group up to
    // 1.5x the planned one is read once and no cluster barrier is waited on.
    return {1, static_cast<int>(whole_sm)};
  }
  return {cluster, static_cast<int>(rows)};
}

// Block mode over token groups: the plan gives every group the mean group's slices, so a large
// group's blocks walk several times the rows. Instead each group gets up to twice the mean's slices,
// using as many as slices of cache_rows need (the rest get no rows). Narrow operands only (027).

// Column tiles of a launch (grid.x): tile_cols columns of each operand row a block, the
// second operand's tiles after the first's.
inline int64_t cols_launch_tiles(const ColsArgs& a, int64_t tile_cols) {
  return ceil_div(a.op[0].cols, tile_cols) + (a.num_ops == 2 ? ceil_div(a.op[1].cols, tile_cols) : 0);
}

inline void plan_cols_group_slices(int segments, int64_t col_tiles, ColsLaunchPlan* plan) {
  if (col_tiles > kColsGroupSlicesMaxTiles) return;
  const int64_t most = std::min<int64_t>(2 * int64_t{plan->cluster}, 65535 / std::max(segments, 1));
  if (most <= plan->cluster) return;
  plan->cluster = static_cast<int>(most);
  plan->slice_rows = plan->cache_rows;
}

// Whether a whole-set launch's q runs may start off the 8-byte grid: unpadded token
// groups (their starts are device data), a padded layout whose alignment is not a
// multiple of 8 rows, or a q pointer or stride off the grid.
inline bool cols_runs_may_shift(const ColsArgs& a) {
  if (a.jagged && (!a.padded || a.alignment % kColsFragRows != 0)) return true;
  for (int i = 0; i < a.num_ops; ++i) {
    const ColsOperand& op = a.op[i];
    if ((reinterpret_cast<uintptr_t>(op.q) | static_cast<uintptr_t>(op.q_sc) | static_cast<uintptr_t>(op.q_sb)) % 8 != 0) {
      return true;
    }
  }
  return false;
}

template <InputKind K, Fp8Format F, class Rule, int kBlock, class Layout>
int launch_quantize_cols(const ColsArgs& a, ColsLaunchPlan plan, gpuStream_t stream) {
  using T = typename DeviceInput<K>::storage;
  constexpr int kTileCols = kColsTileBytes / sizeof(T);
  const int64_t tiles = cols_launch_tiles(a, kTileCols);
  if (tiles == 0) return 0;
  bool vec = cols_vector_ok<T>(a.op[0]);
  if (a.num_ops == 2) vec = vec && cols_vector_ok<T>(a.op[1]);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(segments_with_tail(a) * plan.cluster));
  const size_t smem = static_cast<size_t>(plan.cache_rows) * kColsTileBytes;
  auto kernel = vec ? quantize_cols_kernel<K, F, Rule, kBlock, Layout, true, false>
                   : quantize_cols_kernel<K, F, Rule, kBlock, Layout, false, false>;
  if constexpr (kBlock == kWholeSet) {
    if (cols_runs_may_shift(a)) {
      kernel = vec ? quantize_cols_kernel<K, F, Rule, kBlock, Layout, true, true>
                   : quantize_cols_kernel<K, F, Rule, kBlock, Layout, false, true>;
    }
  }
  // plan.cluster splits each segment; only the whole-set reduction exchanges amax
  // across them (a hardware cluster), block mode's slices are independent.
  const int hw_cluster = kBlock == kWholeSet ? plan.cluster : 1;
  return launch_kernel(kernel, grid, dim3(kColsThreads), smem, stream, hw_cluster, a, plan.cluster, plan.cache_rows,
                       plan.slice_rows);
}

}  // namespace moe_fp8
