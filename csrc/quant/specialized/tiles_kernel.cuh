// Specialized (FP8 blockwise weights; engine.h TilesArgs): a scale per 128x128 tile, read once, every output from it; a
// column-major input runs as its row-major transpose. Vector kernel (2-byte or fp32-as-bf16 inputs, 16-byte aligned
// rows): register fragments, no shared memory; scalar kernel: a swizzled shared tile.
#pragma once

#include <cstdint>
#include <utility>

#include "../../core/device_runtime.h"
#include "../../core/numerics.h"
#include "../../core/portability.h"
#include "../../core/reduce.cuh"
#include "../../core/vec.cuh"
#include "../engine.h"

namespace moe_fp8 {

constexpr int kTilesThreads = 256;

MOE_FP8_DEVICE int tile_slot(int r, int c) { return r * kTile + (c ^ (r % 32)); }

template <InputKind K, Fp8Format F, class Rule>
__global__ void __launch_bounds__(kTilesThreads) quantize_tiles_kernel(TilesArgs a, int64_t tiles_i, int64_t tiles_j) {
  using In = DeviceInput<K>;
  using T = typename In::storage;
  constexpr float kMax = Fp8Spec<F>::kMax;
  extern __shared__ uint4 smem_tiles[];
  T* tile = reinterpret_cast<T*>(smem_tiles);  // [kTile][kTile], swizzled (tile_slot)
  __shared__ uint32_t s_red[kMaxWarpsPerBlock + 1];
  const int64_t t = blockIdx.x;
  const int64_t b = t / (tiles_i * tiles_j), i = (t / tiles_j) % tiles_i, j = t % tiles_j;
  const int64_t r0 = i * kTile, c0 = j * kTile;
  const int nr = static_cast<int>(a.rows - r0 < kTile ? a.rows - r0 : kTile);
  const int nc = static_cast<int>(a.cols - c0 < kTile ? a.cols - c0 : kTile);
  const T* xt = static_cast<const T*>(a.x) + b * a.sb + r0 * a.sr + c0 * a.sc;
  uint32_t amax = 0;
  for (int idx = threadIdx.x; idx < kTile * kTile; idx += kTilesThreads) {
    const int r = idx / kTile, c = idx % kTile;
    T v = T(0);
    if (r < nr && c < nc) v = xt[r * a.sr + c * a.sc];  // past the weight: zero, never the amax
    tile[tile_slot(r, c)] = v;
    const uint32_t bits = abs_bits(In::to_float(v));
    amax = bits > amax ? bits : amax;
  }
  amax = block_max(amax, s_red);
  __syncthreads();  // the staged tile is complete
  const auto sc = Rule::template from_amax_bits<F>(amax);
  for (int k = 0; k < a.num_out; ++k) {
    const TileOut& o = a.out[k];
    if (threadIdx.x == 0) static_cast<typename Rule::stored_t*>(o.s)[b * o.s_sb + i * o.s_si + j * o.s_sj] = sc.stored;
    uint8_t* qt = o.q + b * o.q_sb + i * o.q_si + j * o.q_sj;
    const bool rows_fast = o.q_sr == 1 && o.q_sc != 1;  // a column-major output: walk down the columns
    for (int idx = threadIdx.x; idx < kTile * kTile; idx += kTilesThreads) {
      const int r = rows_fast ? idx % kTile : idx / kTile;
      const int c = rows_fast ? idx / kTile : idx % kTile;
      if (r < nr && c < nc) {
        qt[r * o.q_sr + c * o.q_sc] = encode_fp8<F>(scale_clamp(In::to_float(tile[tile_slot(r, c)]), sc.encode, kMax));
      }
    }
  }
}

constexpr int kTileFragRows = 8;  // rows of a vector-kernel fragment
constexpr int kTileFragCols = 8;  // 2-byte columns of a fragment: one 16-byte load a row

// Stores of an encoded 8 x 8 fragment (q8[r]: row r's bytes, columns fc .. fc + 7 of a tile at qt; nr x nc valid), from
// registers, not staged in shared memory (record 030); shared with the activation dual. Column runs (rows contiguous in
// q): the bytes transposed in registers, one 8-byte run a fragment column (a warp store: 64 bytes of each of 4 columns).
MOE_FP8_DEVICE void store_fragment_col_runs(const uint2 (&q8)[kTileFragRows], uint8_t* qt, int64_t q_sc, int fr,
                                            int fc, int nr, int nc) {
  const bool rows_whole = fr + kTileFragRows <= nr;
  const bool vec = q_sc % 8 == 0 && reinterpret_cast<uintptr_t>(qt) % 8 == 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // columns 4h .. 4h + 3 of the fragment
    uint32_t top[4], bottom[4];   // rows 0-3 and 4-7 of each of those columns
    const auto word = [&](int r) { return h == 0 ? q8[r].x : q8[r].y; };
    transpose_bytes_4x4(word(0), word(1), word(2), word(3), top);
    transpose_bytes_4x4(word(4), word(5), word(6), word(7), bottom);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int c = 4 * h + k;
      if (fc + c >= nc) continue;
      uint8_t* dst = qt + (fc + c) * q_sc + fr;
      if (vec && rows_whole) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(top[k], bottom[k]);
      } else {
#pragma unroll
        for (int r = 0; r < kTileFragRows; ++r) {
          if (fr + r < nr) dst[r] = static_cast<uint8_t>((r < 4 ? top[k] : bottom[k]) >> (8 * (r % 4)));
        }
      }
    }
  }
}

// Row runs (row stride q_sr, column stride q_sc): the pair of lanes 8 apart holding 16 adjacent columns (`odd`: the second,
// columns fc - 8 .. fc + 7) swap half their rows, so each stores 16 bytes of 4 rows (first lane rows 0-3, second 4-7) and
// a warp store writes 16 whole 32-byte sectors. Every lane of the warp must call it (shuffles).
MOE_FP8_DEVICE void store_fragment_row_runs(const uint2 (&q8)[kTileFragRows], uint8_t* qt, int64_t q_sr,
                                            int64_t q_sc, int fr, int fc, int nr, int nc, bool odd) {
  const int pc = fc - (odd ? kTileFragCols : 0);  // the pair's first column
  const uintptr_t align = reinterpret_cast<uintptr_t>(qt + pc) | static_cast<uintptr_t>(q_sr);
  const int width = q_sc != 1 ? 1 : (align % 16 == 0 ? 16 : (align % 8 == 0 ? 8 : 1));
#pragma unroll
  for (int k = 0; k < kTileFragRows / 2; ++k) {
    const int keep = odd ? k + kTileFragRows / 2 : k;
    const uint2 mine = odd ? q8[k + kTileFragRows / 2] : q8[k];
    const uint2 give = odd ? q8[k] : q8[k + kTileFragRows / 2];
    const uint2 got = make_uint2(warp_shfl_xor(give.x, 8), warp_shfl_xor(give.y, 8));
    const uint2 lo = odd ? got : mine, hi = odd ? mine : got;  // columns pc .. pc + 7, pc + 8 .. pc + 15
    if (fr + keep >= nr || pc >= nc) continue;
    uint8_t* dst = qt + (fr + keep) * q_sr + pc * q_sc;
    const bool whole = pc + 2 * kTileFragCols <= nc;  // else the last 8 columns are past the tile
    if (width == 16 && whole) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(lo.x, lo.y, hi.x, hi.y);
    } else if (width >= 8) {
      *reinterpret_cast<uint2*>(dst) = lo;
      if (whole) *reinterpret_cast<uint2*>(dst + 8) = hi;
    } else {
      const uint32_t w[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
      for (int c = 0; c < 2 * kTileFragCols; ++c) {
        if (pc + c < nc) dst[c * q_sc] = static_cast<uint8_t>(w[c / 4] >> (8 * (c % 4)));
      }
    }
  }
}

// One fragment row: 8 elements as 8 16-bit values (kFP32AsBF16: two fp32 loads, each value
// rounded to bf16 bits, so the rest of the kernel is the bf16 one).
template <InputKind K, typename T>
MOE_FP8_DEVICE uint4 load_fragment_row(const T* p) {
  if constexpr (K == InputKind::kFP32AsBF16) {
    const Array<float, 4> lo = load_elems<float, 4>(p, 1), hi = load_elems<float, 4>(p + 4, 1);
    const auto two = [](float a, float b) {
      return static_cast<uint32_t>(float_to_bf16_bits(a)) | (static_cast<uint32_t>(float_to_bf16_bits(b)) << 16);
    };
    return make_uint4(two(lo.v[0], lo.v[1]), two(lo.v[2], lo.v[3]), two(hi.v[0], hi.v[1]), two(hi.v[2], hi.v[3]));
  } else {
    return *reinterpret_cast<const uint4*>(p);
  }
}

constexpr int kTileRowGroups = kTile / kTileFragRows;
static_assert(kTileRowGroups * (kTile / kTileFragCols) == kTilesThreads, "one fragment a thread");
// Four blocks an SM on CUDA (64 registers): a block's loads, amax and stores run one after another, so the SM overlaps
// them only across blocks; uncapped, ptxas fits only one or two blocks an SM.
constexpr int kTilesVecMinBlocks = MOE_FP8_CUDA_MIN_BLOCKS(4);

template <InputKind K, Fp8Format F, class Rule>
__global__ void __launch_bounds__(kTilesThreads, kTilesVecMinBlocks)
    quantize_tiles_vec_kernel(TilesArgs a, int64_t tiles_i, int64_t tiles_j) {
  using T = typename DeviceInput<K>::storage;
  constexpr InputKind KE = K == InputKind::kFP32AsBF16 ? InputKind::kBF16 : K;  // the elements once loaded
  using In = DeviceInput<KE>;
  static_assert(sizeof(typename In::storage) == 2, "the vector kernel reads 2-byte inputs (or fp32 as bf16)");
  __shared__ uint32_t s_red[kMaxWarpsPerBlock + 1];
  // Each 32 threads (a warp on CUDA, half a wave on ROCm) hold a 64-row x 32-column strip: lane l has rows 8 * (l % 8)
  // .. +7 and columns 8 * (l / 8) .. +7, so two lanes 8 apart (a pair) hold 16 adjacent columns of the same rows.
  const int l32 = threadIdx.x % 32, g32 = threadIdx.x / 32;
  const int rg = l32 % 8 + 8 * (g32 / 4), ch = l32 / 8 + 4 * (g32 % 4);
  const int fr = rg * kTileFragRows, fc = ch * kTileFragCols;  // the fragment's first row and column
  const bool odd = (ch & 1) != 0;  // the pair's second lane: columns fc - 8 .. fc + 7 of its 16
  // A grid-stride loop over the tiles, launched with a block a tile (so one pass): the
  // form ptxas fits in 64 registers without spilling.
  const int64_t tiles = a.batches * tiles_i * tiles_j;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t b = t / (tiles_i * tiles_j), i = (t / tiles_j) % tiles_i, j = t % tiles_j;
    const int64_t r0 = i * kTile, c0 = j * kTile;
    const int nr = static_cast<int>(a.rows - r0 < kTile ? a.rows - r0 : kTile);
    const int nc = static_cast<int>(a.cols - c0 < kTile ? a.cols - c0 : kTile);
    const T* xf = static_cast<const T*>(a.x) + b * a.sb + (r0 + fr) * a.sr + c0 + fc;
    uint4 v[kTileFragRows];
#pragma unroll
    for (int r = 0; r < kTileFragRows; ++r) {  // past the weight: zero, never the amax
      v[r] = (fr + r < nr && fc < nc) ? load_fragment_row<K>(xf + r * a.sr) : make_uint4(0u, 0u, 0u, 0u);
    }
    // The packed 16-bit amax: no element is converted to float before the block's max,
    // so no converted value is held across it.
    uint32_t m = 0;
#pragma unroll
    for (int r = 0; r < kTileFragRows; ++r) {
      m = amax16x2_add(amax16x2_add(amax16x2_add(amax16x2_add(m, v[r].x), v[r].y), v[r].z), v[r].w);
    }
    const uint32_t amax = block_max(umax(amax16x2_lane_bits<In>(m, false), amax16x2_lane_bits<In>(m, true)), s_red);
    const auto sc = Rule::template from_amax_bits<F>(amax);
    // The fragment encoded once for both outputs (they share the scale): q8[r] holds
    // row r's 8 fp8 bytes, columns fc .. fc + 7. The inputs are dead from here.
    uint2 q8[kTileFragRows];
#pragma unroll
    for (int r = 0; r < kTileFragRows; ++r) {
      uint32_t w[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint16_t lo = scaled_fp8x2<F>(uint4_elem<KE>(v[r], 4 * h), uint4_elem<KE>(v[r], 4 * h + 1),
                                            sc.encode);
        const uint16_t hi = scaled_fp8x2<F>(uint4_elem<KE>(v[r], 4 * h + 2), uint4_elem<KE>(v[r], 4 * h + 3),
                                            sc.encode);
        w[h] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
      }
      q8[r] = make_uint2(w[0], w[1]);
    }
    // Each output written by its own copy of the code, so its fields are read from
    // constant indices of the parameters.
    const auto write = [&](const TileOut& o) {
      if (threadIdx.x == 0) static_cast<typename Rule::stored_t*>(o.s)[b * o.s_sb + i * o.s_si + j * o.s_sj] = sc.stored;
      uint8_t* qt = o.q + b * o.q_sb + i * o.q_si + j * o.q_sj;
      if (o.q_sr == 1) {
        store_fragment_col_runs(q8, qt, o.q_sc, fr, fc, nr, nc);
      } else {
        store_fragment_row_runs(q8, qt, o.q_sr, o.q_sc, fr, fc, nr, nc, odd);
      }
    };
    write(a.out[0]);
    if (a.num_out > 1) write(a.out[1]);
  }
}

// The input as a row-major matrix where it has a contiguous dimension: a column-major
// input (sc != 1, sr == 1) becomes its transpose, with every output's row and column
// strides and scale tile indices swapped to match.
inline TilesArgs tiles_row_major(TilesArgs a) {
  if (a.sc == 1 || a.sr != 1) return a;
  std::swap(a.rows, a.cols);
  std::swap(a.sr, a.sc);
  for (int k = 0; k < a.num_out; ++k) {
    std::swap(a.out[k].q_si, a.out[k].q_sj);
    std::swap(a.out[k].q_sr, a.out[k].q_sc);
    std::swap(a.out[k].s_si, a.out[k].s_sj);
  }
  return a;
}

// Rows of whole 8-column fragments, each row's fragments at 16-byte aligned addresses.
template <InputKind K>
inline bool tiles_vector_ok(const TilesArgs& a) {
  using T = typename DeviceInput<K>::storage;
  constexpr int64_t n = 16 / sizeof(T);
  return (sizeof(T) == 2 || K == InputKind::kFP32AsBF16) && a.sc == 1 && a.cols % kTileFragCols == 0 &&
         a.sr % n == 0 && a.sb % n == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0;
}

template <InputKind K, Fp8Format F, class Rule>
int launch_quantize_tiles(const TilesArgs& args, gpuStream_t stream) {
  using T = typename DeviceInput<K>::storage;
  const TilesArgs a = tiles_row_major(args);
  const int64_t ti = ceil_div(a.rows, int64_t{kTile}), tj = ceil_div(a.cols, int64_t{kTile});
  const int64_t n = a.batches * ti * tj;
  if (n == 0) return 0;
  if (n >= (int64_t{1} << 31)) return -1;
  if constexpr (sizeof(T) == 2 || K == InputKind::kFP32AsBF16) {
    if (tiles_vector_ok<K>(a)) {
      return launch_kernel(quantize_tiles_vec_kernel<K, F, Rule>, dim3(static_cast<unsigned>(n)), dim3(kTilesThreads),
                           0, stream, 1, a, ti, tj);
    }
  }
  const size_t smem = static_cast<size_t>(kTile) * kTile * sizeof(T);
  return launch_kernel(quantize_tiles_kernel<K, F, Rule>, dim3(static_cast<unsigned>(n)), dim3(kTilesThreads), smem,
                       stream, 1, a, ti, tj);
}

}  // namespace moe_fp8
