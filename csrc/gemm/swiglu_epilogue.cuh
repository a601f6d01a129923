// The W13 GEMM's SwiGLU epilogue (DESIGN §6): a 128x256 tile of [W1; W3] interleaved by 128 holds h1 and h3 of 128
// hidden columns. The store warp writes h13 as [h1 | h3]; the consumers write h's 1x128 and padded 128x1 fp8 operands,
// bit for bit the SwiGLU op and quantize_blockwise_act_dual.
#pragma once

#include <cstdint>

#include "../core/groups.h"
#include "../core/vec.cuh"
#include "../quant/policies.h"
#include "../swiglu/swiglu.h"
#include "store_warp_epilogue.cuh"

namespace moe_fp8 {

// What the SwiGLU epilogue writes besides h13. Rows are tokens (M of them); groups by offs, padded starts of the
// 128-aligned gap-free layout of q_rows_total rows.
struct SwigluQuantOut {
  const int32_t* offs = nullptr;
  const int32_t* padded_starts = nullptr;
  const uint16_t* silu_table = nullptr;  // silu_table_entry, kSiluTableEntries
  uint8_t* q_rows = nullptr;             // (M, hidden) row-major
  float* s_rows = nullptr;               // (M, hidden / 128) column-major
  uint8_t* q_cols = nullptr;             // (q_rows_total, hidden) column-major
  float* s_cols = nullptr;               // (q_rows_total / 128, hidden) row-major
  int64_t rows = 0;
  int64_t q_rows_total = 0;
  int hidden = 0;
};

template <class Base>
struct SwigluEpilogue : StoreWarpEpilogue<Base, true> {
  using Parent = StoreWarpEpilogue<Base, true>;
  using Parent::kConsumerThreads;
  using Parent::kTileM;
  using Parent::kTileN;
  static constexpr int kHalf = kTileN / 2;  // hidden columns a tile
  static constexpr int kWarps = kConsumerThreads / cutlass::NumThreadsPerWarp;
  static_assert(kTileM == 128 && kTileN == 256, "SwigluEpilogue: 128x256 tiles (one 128-row token block, h1 | h3)");

  // Per warp, its 16 rows' column amaxes, then each column's encode factor; by tile parity, so that no tile's writes
  // meet the previous tile's reads whatever the barriers between them.
  struct TensorStorage {
    typename Parent::TensorStorage parent;
    alignas(16) uint32_t col_amax[2][kWarps][kHalf];
    float col_encode[2][kHalf];  // each column's encode factor, computed once
  };
  using Types = FusedEpilogueTypes<Parent, SwigluQuantOut, TensorStorage>;
  using Arguments = typename Types::Arguments;
  using Params = typename Types::Params;
  using SharedStorage = typename Types::SharedStorage;
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void* workspace) {
    return Types::to_underlying_arguments(shape, args, workspace);
  }

  CUTLASS_DEVICE SwigluEpilogue(Params const& params, TensorStorage& shared)
      : Parent(params, shared.parent), out_(params.fused) {
    this->split_tiles_ = params.fused.hidden / kHalf;
  }

  template <class... Args>
  CUTLASS_DEVICE auto load(Args&&... args) {
    return forward_load(static_cast<Args&&>(args)...);
  }

  template <class LoadPipeline, class LoadPipelineState, class StorePipeline, class StorePipelineState,
            class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma, class TensorMapD>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipe, LoadPipelineState load_state, StorePipeline store_pipe,
                            StorePipelineState store_state, ProblemShapeMNKL problem_shape_mnkl,
                            TileShapeMNK tile_shape_MNK, TileCoordMNKL tile_coord_mnkl,
                            cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma tiled_mma, int thread_idx,
                            TensorStorage& shared, TensorMapD const& tensormap, int = -1) {
    auto states = Parent::store(load_pipe, load_state, store_pipe, store_state, problem_shape_mnkl, tile_shape_MNK,
                                tile_coord_mnkl, accumulators, tiled_mma, thread_idx, shared.parent, tensormap);
    swiglu_quant(problem_shape_mnkl, tile_coord_mnkl, accumulators, tiled_mma, thread_idx, shared);
    return states;
  }

 private:
  template <class LoadPipeline, class LoadPipelineState, class ProblemShapeMNKL, class TileShapeMNK,
            class TileCoordMNKL, class TiledMma, class TensorMapD>
  CUTLASS_DEVICE auto forward_load(LoadPipeline pipe, LoadPipelineState state, ProblemShapeMNKL problem_shape_mnkl,
                                   TileShapeMNK tile_shape, TileCoordMNKL tile_coord_mnkl, TiledMma tiled_mma,
                                   int thread_idx, TensorStorage& shared, TensorMapD const& tensormap, int i = -1) {
    return Parent::load(pipe, state, problem_shape_mnkl, tile_shape, tile_coord_mnkl, tiled_mma, thread_idx,
                        shared.parent, tensormap, i);
  }

  // A thread holds rows m_t + {0, 8} and columns n_t + 8j + {0, 1} of each half (GMMA's 64xN layout, two 64x128
  // atoms along N: value v of h1, v + kValues of h3). Row amax over a quad, column amax over the warp's 8 row lanes
  // and then the 8 warps through shared memory.
  template <class ProblemShapeMNKL, class TileCoordMNKL, class AccEngine, class AccLayout, class TiledMma>
  CUTLASS_DEVICE void swiglu_quant(ProblemShapeMNKL problem_shape_mnkl, TileCoordMNKL tile_coord_mnkl,
                                   cute::Tensor<AccEngine, AccLayout> const& acc, TiledMma tiled_mma, int thread_idx,
                                   TensorStorage& shared) {
    using namespace cute;
    constexpr Fp8Format F = Fp8Format::kE4M3FN;
    constexpr int kValues = decltype(size(acc))::value / 2;  // a thread's values of one half
    constexpr int kCols = kValues / 2;                       // its columns (two rows each)
    static_assert(kValues == 64, "SwigluEpilogue: 64 values a thread a half (128x256 tile, 256 threads)");
    const int rows_g = static_cast<int>(get<0>(problem_shape_mnkl));
    const int m_coord = static_cast<int>(get<0>(tile_coord_mnkl)), n_coord = static_cast<int>(get<1>(tile_coord_mnkl));
    const int g = static_cast<int>(get<3>(tile_coord_mnkl));
    int64_t start, end;
    group_range(out_.offs, g, out_.rows, &start, &end);
    const int64_t pstart = clamp_offset(out_.padded_starts[g], out_.q_rows_total);
    const int hidden = out_.hidden;
    const int row0 = m_coord * kTileM, col0 = n_coord * kHalf;  // the tile's first row (in its group), h column
    // No tile past the group's rows or h's columns (the clusters do not make one; kept so that none could write), and
    // no token block of bad padded_starts: unaligned or past the layout (a GPU never faults). Uniform over consumers.
    if (row0 >= rows_g || col0 >= hidden || pstart % kTileM != 0 || pstart + row0 + kTileM > out_.q_rows_total) return;

    Tensor coords = tiled_mma.get_slice(thread_idx).partition_C(
        make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
    const int m_t = get<0>(coords(0)), n_t = get<1>(coords(0));
    const int lane = thread_idx % cutlass::NumThreadsPerWarp, warp = thread_idx / cutlass::NumThreadsPerWarp;

    float h[kValues];
    uint32_t rmax[2] = {0u, 0u}, cmax[kCols];
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kCols; ++c) cmax[c] = 0u;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kValues; ++v) {
      const int dm = get<0>(coords(v)) - m_t, dn = get<1>(coords(v)) - n_t;  // constants
      const int rr = dm / 8, c = (dn / 8) * 2 + dn % 8;
      const bool valid = row0 + m_t + dm < rows_g;  // rows past the group: zero (h1, h3 of no token)
      // h13's bf16 as the store above rounds it; h rounded by the hardware too (a NaN's payload aside, which no
      // fp8 code or scale keeps, E::from_float's bits).
      const __nv_bfloat162 b13 = __floats2bfloat162_rn(acc(v), acc(v + kValues));
      const uint16_t b1 = __bfloat16_as_ushort(b13.x);
      const float x = __bfloat162float(__float2bfloat16_rn(
          f_mul(silu_round_bf16(b1, out_.silu_table), __bfloat162float(b13.y))));
      h[v] = valid ? x : 0.0f;
      rmax[rr] = max(rmax[rr], abs_bits(h[v]));
      cmax[c] = max(cmax[c], abs_bits(h[v]));
    }

    // 1x128 rows: a row's 128 columns are the quad's.
    ScaleCode<float> rs[2];
    CUTLASS_PRAGMA_UNROLL
    for (int rr = 0; rr < 2; ++rr) {
      rmax[rr] = max(rmax[rr], warp_shfl_xor(rmax[rr], 1));
      rmax[rr] = max(rmax[rr], warp_shfl_xor(rmax[rr], 2));
      rs[rr] = Fp32Exact::from_amax_bits<F>(rmax[rr]);
      const int row = row0 + m_t + 8 * rr;
      if (lane % 4 == 0 && row < rows_g) out_.s_rows[int64_t(n_coord) * out_.rows + start + row] = rs[rr].stored;
    }
    // 128x1 columns of the tile's token block: the warp's 16 rows (lanes of one lane % 4), then the 8 warps.
    uint32_t(*part)[kHalf] = shared.col_amax[parity_];
    float* col_encode = shared.col_encode[parity_];
    parity_ ^= 1;
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kCols; ++c) {
      cmax[c] = max(cmax[c], warp_shfl_xor(cmax[c], 4));
      cmax[c] = max(cmax[c], warp_shfl_xor(cmax[c], 8));
      cmax[c] = max(cmax[c], warp_shfl_xor(cmax[c], 16));
      if (lane < 4) part[warp][n_t + (c / 2) * 8 + c % 2] = cmax[c];
    }
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, kBarrier);
    if (thread_idx < kHalf) {  // one thread a column
      uint32_t m = 0u;
      CUTLASS_PRAGMA_UNROLL
      for (int w = 0; w < kWarps; ++w) m = max(m, part[w][thread_idx]);
      const ScaleCode<float> cs = Fp32Exact::from_amax_bits<F>(m);
      col_encode[thread_idx] = cs.encode;
      out_.s_cols[(pstart / kTileM + m_coord) * hidden + col0 + thread_idx] = cs.stored;
    }
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, kBarrier);
    float enc[kCols];
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kCols; c += 2) {
      const float2 e = *reinterpret_cast<const float2*>(col_encode + n_t + (c / 2) * 8);
      enc[c] = e.x;
      enc[c + 1] = e.y;
    }

    // Both fp8 tiles through the D stages (once the store warp has read h13 from them): rows as (row, column),
    // columns as (column, row), each 128 bytes and 16 of padding a line; then 16-byte stores, whole lines.
    this->wait_tile_read(shared.parent);
    uint8_t* st_rows = reinterpret_cast<uint8_t*>(Parent::smem_d(shared.parent));
    uint8_t* st_cols = st_rows + kTileM * kLine;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kValues; v += 2) {
      const int dm = get<0>(coords(v)) - m_t, dn = get<1>(coords(v)) - n_t;
      const int r = m_t + dm, c = n_t + dn, ci = (dn / 8) * 2;
      const uint16_t two_r = scaled_fp8x2<F>(h[v], h[v + 1], rs[dm / 8].encode);
      const uint16_t two_c = scaled_fp8x2<F>(h[v], h[v + 1], enc[ci], enc[ci + 1]);
      *reinterpret_cast<uint16_t*>(st_rows + r * kLine + c) = two_r;
      st_cols[c * kLine + r] = static_cast<uint8_t>(two_c & 0xFFu);
      st_cols[(c + 1) * kLine + r] = static_cast<uint8_t>(two_c >> 8);
    }
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, kBarrier);
    constexpr int kChunks = kTileM * kHalf / 16;  // 16-byte pieces of a tile
    CUTLASS_PRAGMA_UNROLL
    for (int i = thread_idx; i < kChunks; i += kConsumerThreads) {
      const int line = i / (kHalf / 16), piece = (i % (kHalf / 16)) * 16;
      if (row0 + line < rows_g) {
        *reinterpret_cast<uint4*>(out_.q_rows + (start + row0 + line) * hidden + col0 + piece) =
            *reinterpret_cast<const uint4*>(st_rows + line * kLine + piece);
      }
      *reinterpret_cast<uint4*>(out_.q_cols + int64_t(col0 + line) * out_.q_rows_total + pstart + row0 + piece) =
          *reinterpret_cast<const uint4*>(st_cols + line * kLine + piece);
    }
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, kBarrier);  // the D stages are free for the next tile
  }

  static constexpr int kLine = kHalf + 16;  // bytes a staged line: 16-byte aligned, rows 4 banks apart
  static_assert(kTileM == kHalf, "SwigluEpilogue: square staged tiles (one copy loop)");
  static_assert(2 * kTileM * kLine <= sizeof(typename Base::TensorStorage::CollectiveStorage),
                "SwigluEpilogue: both fp8 tiles fit in the D stages");
  // The consumers' named barrier: after the mainloop's two (PipelinedPromotion::scales_read).
  static constexpr uint32_t kBarrier = 2;
  SwigluQuantOut const& out_;
  int parity_ = 0;
};

}  // namespace moe_fp8
