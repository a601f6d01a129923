// The engine's "tiles" shape on the GPU (engine.h: one scale per 128x128 tile; FP8
// blockwise weights), templated over the scale rule, and its launcher. Raw pointers,
// sizes and a stream only (no torch headers), so the file can be compile-checked for
// any target and hipified as is.
//
// One thread block a tile: the tile is read once into shared memory (any input
// strides; coalesced when the columns are contiguous), its amax reduced over the
// block, and every output written from shared memory walking its contiguous dimension
// (rows for a column-major output, columns for a row-major one), so a weight's two
// orientations come from one read. Element (r, c) of the staged tile sits at
// r * 128 + (c ^ (r % 32)): walking a column reads 32 banks, not one.
#pragma once

#include <cstdint>

#include "../core/numerics.h"
#include "../core/portability.h"
#include "../core/reduce.cuh"
#include "../core/vec.cuh"
#include "engine.h"

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
    uint8_t* qt = o.q + b * o.q_sb + r0 * o.q_sr + c0 * o.q_sc;
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

template <InputKind K, Fp8Format F, class Rule>
int launch_quantize_tiles(const TilesArgs& a, gpuStream_t stream) {
  using T = typename DeviceInput<K>::storage;
  const int64_t ti = ceil_div(a.rows, int64_t{kTile}), tj = ceil_div(a.cols, int64_t{kTile});
  const int64_t n = a.batches * ti * tj;
  if (n == 0) return 0;
  if (n >= (int64_t{1} << 31)) return -1;
  const size_t smem = static_cast<size_t>(kTile) * kTile * sizeof(T);
  return launch_kernel(quantize_tiles_kernel<K, F, Rule>, dim3(static_cast<unsigned>(n)), dim3(kTilesThreads), smem,
                       stream, 1, a, ti, tj);
}

}  // namespace moe_fp8
