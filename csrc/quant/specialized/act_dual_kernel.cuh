// Specialized (FP8 blockwise activations; engine.h ActDualArgs): a token-grouped activation's 1x128 row blocks and padded
// 128x1 column blocks from one read, where the engine's rows and cols shapes read it twice. One block a 128x128 tile with
// the tiles kernel's fragments and stores; act_dual_block maps padded blocks to input rows. Torch-free, hipified as is.
#pragma once

#include <cstdint>

#include "../../core/device_runtime.h"
#include "../../core/numerics.h"
#include "../../core/portability.h"
#include "../../core/vec.cuh"
#include "../engine.h"
#include "tiles_kernel.cuh"

namespace moe_fp8 {

// Blocks an SM on CUDA (the fragment's inputs live through both encodings): three (80 registers) for the hardware e4m3fn
// conversion, two (128) for the software encoders (e4m3fnuz, e5m2), which spill at three; no persistent form: record 014.
template <Fp8Format F>
constexpr int act_dual_min_blocks() {
  return MOE_FP8_CUDA_MIN_BLOCKS(F == Fp8Format::kE4M3FN ? 3 : 2);
}

template <InputKind K, Fp8Format F, class Rule>
__global__ void __launch_bounds__(kTilesThreads, act_dual_min_blocks<F>())
    quantize_act_dual_kernel(ActDualArgs a, int64_t col_blocks) {
  using In = DeviceInput<K>;
  using T = typename In::storage;
  using S = typename Rule::stored_t;
  static_assert(sizeof(T) == 2, "the activation dual kernel reads 2-byte inputs");
  __shared__ uint32_t s_rmax[4][kTile / 2];  // packed 16-bit row maxima, one set per 32-column quarter
  __shared__ uint32_t s_cmax[2][kTile / 2];  // packed 16-bit column maxima, one set per 64-row half
  __shared__ float s_enc[2 * kTile];         // encode factors: rows 0..127, then columns
  const int64_t qb = blockIdx.x / col_blocks;
  const int64_t c0 = (blockIdx.x % col_blocks) * kTile;
  const ActDualBlock blk = act_dual_block(a, qb);
  const int nc = static_cast<int>(a.cols - c0 < kTile ? a.cols - c0 : kTile);
  if (blk.cols != ActDualCols::kEncode) {  // no group rows: zero 128x1 scales (s_cols may be uninitialized)
    if (static_cast<int>(threadIdx.x) < nc) static_cast<S*>(a.s_cols)[qb * a.cols + c0 + threadIdx.x] = S{};
    if (blk.cols == ActDualCols::kNone) return;  // a gap of the padded layout: no codes (uniform in the block)
  }
  const int l32 = threadIdx.x % 32, g32 = threadIdx.x / 32;
  const int rg = l32 % 8 + 8 * (g32 / 4), ch = l32 / 8 + 4 * (g32 % 4);
  const int fr = rg * kTileFragRows, fc = ch * kTileFragCols;
  const bool odd = (ch & 1) != 0;
  uint8_t* q_cols = a.q_cols + c0 * a.q_rows_total + blk.q0;  // column-major, column stride q_rows_total
  uint2 q8[kTileFragRows];
  if (blk.cols == ActDualCols::kZero) {  // past the last group: zero codes (their scales are written above)
#pragma unroll
    for (int r = 0; r < kTileFragRows; ++r) q8[r] = make_uint2(0u, 0u);
    store_fragment_col_runs(q8, q_cols, a.q_rows_total, fr, fc, blk.q_len, nc);
    if (blk.in_rows == 0) return;  // (else the rows past the groups, along the rows)
  }
  const T* xf = static_cast<const T*>(a.x) + (blk.in0 + fr) * a.sr + c0 + fc;
  uint4 v[kTileFragRows];
#pragma unroll
  for (int r = 0; r < kTileFragRows; ++r) {  // rows past the group: zero, never a maximum
    v[r] = (fr + r < blk.in_rows && fc < nc) ? *reinterpret_cast<const uint4*>(xf + r * a.sr)
                                             : make_uint4(0u, 0u, 0u, 0u);
  }
  // Packed 16-bit maxima (sign cleared): rows in pairs (row 2k in the low lane of
  // rmax[k]), columns in pairs (columns 2k, 2k + 1 of the fragment in cmax[k]).
  uint32_t rmax[kTileFragRows / 2], cmax[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int k = 0; k < kTileFragRows / 2; ++k) {
    uint32_t m[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4& w = v[2 * k + h];
      m[h] = amax16x2_add(amax16x2_add(amax16x2_add(amax16x2_add(0u, w.x), w.y), w.z), w.w);
    }
    rmax[k] = umax_u16x2(byte_perm(m[0], m[1], 0x5410u), byte_perm(m[0], m[1], 0x7632u));
  }
#pragma unroll
  for (int r = 0; r < kTileFragRows; ++r) {
    cmax[0] = amax16x2_add(cmax[0], v[r].x);
    cmax[1] = amax16x2_add(cmax[1], v[r].y);
    cmax[2] = amax16x2_add(cmax[2], v[r].z);
    cmax[3] = amax16x2_add(cmax[3], v[r].w);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    rmax[k] = umax_u16x2(rmax[k], warp_shfl_xor(rmax[k], 8));  // the lanes of a row: l32 / 8 differs
    rmax[k] = umax_u16x2(rmax[k], warp_shfl_xor(rmax[k], 16));
    cmax[k] = umax_u16x2(cmax[k], warp_shfl_xor(cmax[k], 1));  // the lanes of a column: l32 % 8 differs
    cmax[k] = umax_u16x2(cmax[k], warp_shfl_xor(cmax[k], 2));
    cmax[k] = umax_u16x2(cmax[k], warp_shfl_xor(cmax[k], 4));
    if (l32 < 8) s_rmax[g32 % 4][fr / 2 + k] = rmax[k];
    if (l32 % 8 == 0) s_cmax[g32 / 4][fc / 2 + k] = cmax[k];
  }
  __syncthreads();
  {  // one scale a thread: rows 0..127, then columns 0..127
    const int t = threadIdx.x, w = (t % kTile) / 2;
    const bool hi = (t & 1) != 0;
    const uint32_t m = t < kTile ? umax_u16x2(umax_u16x2(s_rmax[0][w], s_rmax[1][w]),
                                              umax_u16x2(s_rmax[2][w], s_rmax[3][w]))
                                 : umax_u16x2(s_cmax[0][w], s_cmax[1][w]);
    const auto sc = Rule::template from_amax_bits<F>(amax16x2_lane_bits<In>(m, hi));
    s_enc[t] = sc.encode;
    if (t < kTile) {
      if (t < blk.in_rows) static_cast<S*>(a.s_rows)[(c0 / kTile) * a.rows + blk.in0 + t] = sc.stored;
    } else if (blk.cols == ActDualCols::kEncode && t - kTile < nc) {
      static_cast<S*>(a.s_cols)[qb * a.cols + c0 + (t - kTile)] = sc.stored;
    }
  }
  __syncthreads();
  // 1x128 codes: each row with its own factor.
#pragma unroll
  for (int r = 0; r < kTileFragRows; ++r) {
    const float s = s_enc[fr + r];
    uint32_t w[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint16_t lo = scaled_fp8x2<F>(uint4_elem<K>(v[r], 4 * h), uint4_elem<K>(v[r], 4 * h + 1), s);
      const uint16_t hi = scaled_fp8x2<F>(uint4_elem<K>(v[r], 4 * h + 2), uint4_elem<K>(v[r], 4 * h + 3), s);
      w[h] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    q8[r] = make_uint2(w[0], w[1]);
  }
  store_fragment_row_runs(q8, a.q_rows + blk.in0 * a.cols + c0, a.cols, 1, fr, fc, blk.in_rows, nc, odd);
  if (blk.cols != ActDualCols::kEncode) return;
  // 128x1 codes: each column with its own factor; rows past the group's input rows are
  // zeros encoded with the column's factor (the padded layout's rows).
  float e[kTileFragCols];
#pragma unroll
  for (int c = 0; c < kTileFragCols; ++c) e[c] = s_enc[kTile + fc + c];
#pragma unroll
  for (int r = 0; r < kTileFragRows; ++r) {
    uint32_t w[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = 4 * h;
      const uint16_t lo = scaled_fp8x2<F>(uint4_elem<K>(v[r], c), uint4_elem<K>(v[r], c + 1), e[c], e[c + 1]);
      const uint16_t hi = scaled_fp8x2<F>(uint4_elem<K>(v[r], c + 2), uint4_elem<K>(v[r], c + 3), e[c + 2], e[c + 3]);
      w[h] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    q8[r] = make_uint2(w[0], w[1]);
  }
  store_fragment_col_runs(q8, q_cols, a.q_rows_total, fr, fc, blk.q_len, nc);
}

// A block a tile, the padded blocks' column tiles adjacent (the tiles of one row
// band read one after another).
template <InputKind K, Fp8Format F, class Rule>
int launch_quantize_act_dual(const ActDualArgs& a, gpuStream_t stream) {
  const int64_t col_blocks = ceil_div(a.cols, int64_t{kTile});
  const int64_t n = a.q_rows_total / kTile * col_blocks;
  if (n == 0) return 0;
  if (n >= (int64_t{1} << 31)) return -1;
  if constexpr (sizeof(typename DeviceInput<K>::storage) == 2) {
    return launch_kernel(quantize_act_dual_kernel<K, F, Rule>, dim3(static_cast<unsigned>(n)), dim3(kTilesThreads), 0,
                         stream, 1, a, col_blocks);
  } else {
    return -1;  // act_dual_vector_ok: 2-byte inputs only
  }
}

}  // namespace moe_fp8
