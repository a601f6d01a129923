// The W2 input-gradient GEMM's dSwiGLU epilogue (DESIGN §6): a 128x128 tile of grad_h = grad_out · W2 meets the
// matching 128 rows of h1 and h3 (saved h13), which the store warp copies in during the tile's mainloop; the
// consumers write grad_h13's 1x128 and padded 128x1 fp8 operands, bit for bit swiglu_backward and the activation dual.
#pragma once

#include <cstdint>

#include "../core/groups.h"
#include "../core/vec.cuh"
#include "../quant/policies.h"
#include "../swiglu/swiglu.h"
#include "store_warp_epilogue.cuh"

namespace moe_fp8 {

// What the dSwiGLU epilogue reads and writes. Rows are tokens (M of them); groups by offs, padded starts of the
// 128-aligned gap-free layout of q_rows_total rows; the outputs are 2 * hidden wide ([grad_h1 | grad_h3]).
struct DswigluQuantOut {
  const int32_t* offs = nullptr;
  const int32_t* padded_starts = nullptr;
  const uint16_t* h13 = nullptr;  // (M, 2 * hidden) bf16 row-major, [h1 | h3]
  uint8_t* q_rows = nullptr;      // (M, 2 * hidden) row-major
  float* s_rows = nullptr;        // (M, 2 * hidden / 128) column-major
  uint8_t* q_cols = nullptr;      // (q_rows_total, 2 * hidden) column-major
  float* s_cols = nullptr;        // (q_rows_total / 128, 2 * hidden) row-major
  int64_t rows = 0;
  int64_t q_rows_total = 0;
  int hidden = 0;
};

template <class Base>
struct DswigluEpilogue : StoreWarpEpilogue<Base> {
  using Parent = StoreWarpEpilogue<Base>;
  using Parent::kConsumerThreads;
  using Parent::kTileM;
  using Parent::kTileN;
  static constexpr int kWarps = kConsumerThreads / cutlass::NumThreadsPerWarp;
  static_assert(kTileM == 128 && kTileN == 128, "DswigluEpilogue: 128x128 tiles (one 128-row token block)");
  // A tile's h13 rows, then grad_h13's: h1 then h3 (256 bytes each), 16 bytes of padding (rows 4 banks apart).
  static constexpr int kH13Line = 2 * kTileN * 2 + 16;
  static constexpr int kAreaBytes = kTileM * kH13Line;
  static_assert(2 * kTileM * kTileN <= sizeof(typename Base::TensorStorage::CollectiveStorage),
                "DswigluEpilogue: grad_h in bf16, then a half's two fp8 tiles, fit in the base's D stages");

  struct TensorStorage {
    typename Parent::TensorStorage parent;
    alignas(128) uint8_t area[kAreaBytes];
    alignas(16) uint32_t col_amax[kWarps][2 * kTileN];  // per warp, its 16 rows' column amaxes of both halves
    float col_encode[2 * kTileN];                       // each column's encode factor, computed once
    cutlass::arch::ClusterBarrier h_full;               // the tile's h13 rows have landed (each lane's copies)
    cutlass::arch::ClusterBarrier h_empty;              // the consumers are done with the area
  };
  using Types = FusedEpilogueTypes<Parent, DswigluQuantOut, TensorStorage>;
  using Arguments = typename Types::Arguments;
  using Params = typename Types::Params;
  using SharedStorage = typename Types::SharedStorage;
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void* workspace) {
    return Types::to_underlying_arguments(shape, args, workspace);
  }

  CUTLASS_DEVICE DswigluEpilogue(Params const& params, TensorStorage& shared)
      : Parent(params, shared.parent), out_(params.fused) {
    if (threadIdx.x == 0) {
      shared.h_full.init(cutlass::NumThreadsPerWarp);
      shared.h_empty.init(kConsumerThreads);
      cutlass::arch::fence_barrier_init();
    }
  }

  // Store warp, once a tile: once the consumers are done with the area, the tile's rows of h1 and h3 (those in its
  // group; none for a tile past the group or h's columns, which the consumers skip) by async copies, 16 bytes a lane
  // and row; each lane arrives on h_full when its copies have landed.
  template <class LoadPipeline, class LoadPipelineState, class ProblemShapeMNKL, class TileShapeMNK,
            class TileCoordMNKL, class TiledMma, class TensorMapD>
  CUTLASS_DEVICE auto load(LoadPipeline, LoadPipelineState state, ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK,
                           TileCoordMNKL tile_coord_mnkl, TiledMma, int, TensorStorage& shared, TensorMapD const&,
                           int = -1) {
    const int lane = threadIdx.x % cutlass::NumThreadsPerWarp;
    int n = 0;
    int64_t src = 0;
    tile_rows(problem_shape_mnkl, tile_coord_mnkl, &n, &src);
    const int half = lane / 16, chunk = lane % 16;  // a row's 2 x 256 bytes, 16 a lane
    const char* from = reinterpret_cast<const char*>(out_.h13 + src + int64_t(half) * out_.hidden) + 16 * chunk;
    const int64_t stride = int64_t(4) * out_.hidden;  // bytes a row of h13
    uint8_t* to = shared.area + half * 2 * kTileN + 16 * chunk;
    shared.h_empty.wait(load_phase_ ^ 1);
    for (int r = 0; r < n; ++r, from += stride, to += kH13Line) async_copy_16(to, from);
    async_copy_arrive(&shared.h_full);
    load_phase_ ^= 1;
    return state;
  }

  // Consumers, once a tile: dSwiGLU of grad_h (the accumulators as the plain GEMM rounds them to bf16) and h13, then
  // each half's 1x128 rows (amax over a quad) and 128x1 columns (over the warp, then the 8 warps in shared memory).
  template <class LoadPipeline, class LoadPipelineState, class StorePipeline, class StorePipelineState,
            class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma, class TensorMapD>
  CUTLASS_DEVICE auto store(LoadPipeline, LoadPipelineState load_state, StorePipeline, StorePipelineState store_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK, TileCoordMNKL tile_coord_mnkl,
                            cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma tiled_mma, int thread_idx,
                            TensorStorage& shared, TensorMapD const&, int = -1) {
    shared.h_full.wait(store_phase_);
    dswiglu_quant(problem_shape_mnkl, tile_coord_mnkl, accumulators, tiled_mma, thread_idx, shared);
    shared.h_empty.arrive();
    store_phase_ ^= 1;
    return cute::make_tuple(load_state, store_state);
  }

 private:
  // The tile's rows to load (0 where the consumers skip it) and where they start in h13.
  template <class ProblemShapeMNKL, class TileCoordMNKL>
  CUTLASS_DEVICE void tile_rows(ProblemShapeMNKL problem_shape_mnkl, TileCoordMNKL tile_coord_mnkl, int* n,
                                int64_t* src) const {
    const int rows_g = static_cast<int>(cute::get<0>(problem_shape_mnkl));
    const int row0 = static_cast<int>(cute::get<0>(tile_coord_mnkl)) * kTileM;
    const int col0 = static_cast<int>(cute::get<1>(tile_coord_mnkl)) * kTileN;
    int64_t start, end;
    group_range(out_.offs, static_cast<int>(cute::get<3>(tile_coord_mnkl)), out_.rows, &start, &end);
    *n = row0 < rows_g && col0 < out_.hidden ? min(kTileM, rows_g - row0) : 0;
    *src = (start + row0) * 2 * out_.hidden + col0;
  }

  // A thread holds rows m_t + 8j and columns n_t + 8k + i (j, i in {0, 1}, k < 16: GMMA's 64xN layout, value
  // 4k + 2j + i). grad_h goes to the D stages as bf16, then rolled loops over k compute grad_h13 in place of h13 in the
  // area and stage its fp8 tiles (unrolled, the epilogue's code missed the instruction cache: record 038).
  template <class ProblemShapeMNKL, class TileCoordMNKL, class AccEngine, class AccLayout, class TiledMma>
  CUTLASS_DEVICE void dswiglu_quant(ProblemShapeMNKL problem_shape_mnkl, TileCoordMNKL tile_coord_mnkl,
                                    cute::Tensor<AccEngine, AccLayout> const& acc, TiledMma tiled_mma, int thread_idx,
                                    TensorStorage& shared) {
    using namespace cute;
    using E = SwigluElem<InputKind::kBF16>;
    constexpr Fp8Format F = Fp8Format::kE4M3FN;
    constexpr int kValues = decltype(size(acc))::value;  // a thread's values of grad_h
    constexpr int kGroups = kValues / 4;                  // its 8-column groups
    static_assert(kValues == 64, "DswigluEpilogue: 64 values a thread (128x128 tile, 256 threads)");
    static_assert(IsPlainGmmaC<TiledMma>::value, "DswigluEpilogue: GMMA's 64xN accumulators, unpermuted");
    const int rows_g = static_cast<int>(get<0>(problem_shape_mnkl));
    const int m_coord = static_cast<int>(get<0>(tile_coord_mnkl)), n_coord = static_cast<int>(get<1>(tile_coord_mnkl));
    const int g = static_cast<int>(get<3>(tile_coord_mnkl));
    int64_t start, end;
    group_range(out_.offs, g, out_.rows, &start, &end);
    const int64_t pstart = clamp_offset(out_.padded_starts[g], out_.q_rows_total);
    const int H = out_.hidden, W = 2 * H;
    const int row0 = m_coord * kTileM, col0 = n_coord * kTileN;
    // As the SwiGLU epilogue: no tile past the group's rows or h's columns, no token block of bad padded_starts.
    if (row0 >= rows_g || col0 >= H || pstart % kTileM != 0 || pstart + row0 + kTileM > out_.q_rows_total) return;

    Tensor coords = tiled_mma.get_slice(thread_idx).partition_C(
        make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
    const int m_t = get<0>(coords(0)), n_t = get<1>(coords(0));
    const int lane = thread_idx % cutlass::NumThreadsPerWarp, warp = thread_idx / cutlass::NumThreadsPerWarp;
    // D stages: grad_h (bf16, 16-byte chunks XOR-swizzled by row), then fp8 tiles: row r's byte c at
    // r*128 + (c ^ (r%8)*16), column c's byte r at 16K + c*128 + (r ^ (c%8)*16). Each thread address is a base, a
    // constant and an XOR with k's bits; the base is opaque, so that ptxas forms it once.
    const uint32_t staged = cast_smem_ptr_to_uint(Parent::smem_d(shared.parent));
    const uint32_t key = (m_t % 8) * 16;
    uint32_t at = cast_smem_ptr_to_uint(shared.area) + m_t * kH13Line + 2 * n_t;
    uint32_t enc_at = cast_smem_ptr_to_uint(shared.col_encode) + 4 * n_t;
    uint32_t g_at = staged + m_t * 2 * kTileN, g_x = (2 * n_t) ^ key;
    uint32_t rows_at = staged + m_t * kTileN, rows_x = n_t ^ key;
    uint32_t cols_at[2];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 2; ++i) cols_at[i] = staged + kTileM * kTileN + (n_t + i) * kTileM + (m_t ^ ((n_t + i) * 16));
    asm volatile("" : "+r"(at), "+r"(enc_at), "+r"(g_at), "+r"(g_x), "+r"(rows_at), "+r"(rows_x), "+r"(cols_at[0]),
                 "+r"(cols_at[1]));

    // grad_h, rounded to bf16 as the plain GEMM stores it.
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kValues; v += 2) {
      const int j = (v / 2) % 2, k = v / 4;
      const __nv_bfloat162 gb = __floats2bfloat162_rn(acc(v), acc(v + 1));
      st_shared_u32(g_at + j * 8 * 2 * kTileN + (g_x ^ (16 * k)), reinterpret_cast<const uint32_t&>(gb));
    }
    // (each thread reads back only what it wrote: no barrier)

    // grad_h13 (rows past the group: zero), each row's amax by half, each column's over the warp's 16 rows.
    uint32_t rmax[2][2] = {{0u, 0u}, {0u, 0u}};
#pragma unroll 1
    for (int k = 0; k < kGroups; ++k) {
      uint32_t cpair[2][2];  // [half][j]: the column pair's bf16 bits
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 2; ++j) {
        const uint32_t gbits = ld_shared_u32(g_at + j * 8 * 2 * kTileN + (g_x ^ (16 * k)));
        const uint32_t a1 = at + j * 8 * kH13Line + 16 * k, a3 = a1 + 2 * kTileN;
        const uint32_t h1 = ld_shared_u32(a1), h3 = ld_shared_u32(a3);
        uint32_t o1 = 0u, o3 = 0u;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < 2; ++i) {
          const uint16_t b1 = static_cast<uint16_t>(h1 >> (16 * i)), b3 = static_cast<uint16_t>(h3 >> (16 * i));
          const uint16_t bg = static_cast<uint16_t>(gbits >> (16 * i));
#if MOE_FP8_HAS_FAST_DIV
          bool ok = true;
          SiluQuot sq = silu_quot_fast<true>(E::to_float(b1), ok);
          if (!ok) sq = silu_quot<true>(E::to_float(b1));  // (NaN, Inf, h1 < -40: the IEEE path, as the SwiGLU op)
#else
          const SiluQuot sq = silu_quot<true>(E::to_float(b1));
#endif
          uint16_t g1, g3;
          swiglu_backward_elem<InputKind::kBF16>(sq, bg, b1, b3, &g1, &g3, nullptr);
          o1 |= uint32_t(g1) << (16 * i);
          o3 |= uint32_t(g3) << (16 * i);
        }
        const bool valid = row0 + m_t + 8 * j < rows_g;
        cpair[0][j] = valid ? o1 : 0u;
        cpair[1][j] = valid ? o3 : 0u;
        st_shared_u32(a1, cpair[0][j]);
        st_shared_u32(a3, cpair[1][j]);
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < 2; ++h) rmax[h][j] = max(rmax[h][j], pair_amax(cpair[h][j]));
      }
      CUTLASS_PRAGMA_UNROLL
      for (int h = 0; h < 2; ++h) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < 2; ++i) {
          uint32_t m = max(bf16_abs_bits(cpair[h][0] >> (16 * i)), bf16_abs_bits(cpair[h][1] >> (16 * i)));
          m = max(m, warp_shfl_xor(m, 4));
          m = max(m, warp_shfl_xor(m, 8));
          m = max(m, warp_shfl_xor(m, 16));
          if (lane < 4) shared.col_amax[warp][h * kTileN + n_t + 8 * k + i] = m;
        }
      }
    }

    // 1x128 rows: a row's 128 columns of a half are the quad's.
    ScaleCode<float> rs[2][2];
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 2; ++j) {
        uint32_t m = rmax[h][j];
        m = max(m, warp_shfl_xor(m, 1));
        m = max(m, warp_shfl_xor(m, 2));
        rs[h][j] = Fp32Exact::from_amax_bits<F>(m);
        const int row = row0 + m_t + 8 * j;
        if (lane % 4 == 0 && row < rows_g) {
          out_.s_rows[int64_t(h * (H / kTileN) + n_coord) * out_.rows + start + row] = rs[h][j].stored;
        }
      }
    }
    // 128x1 columns of the tile's token block: the 8 warps' amaxes, one thread a column (256 of both halves). The
    // barrier also ends every read of grad_h in the D stages, which hold the staged tiles from here on.
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, kBarrier);
    {
      static_assert(2 * kTileN == kConsumerThreads, "DswigluEpilogue: a thread a column");
      uint32_t m = 0u;
      CUTLASS_PRAGMA_UNROLL
      for (int w = 0; w < kWarps; ++w) m = max(m, shared.col_amax[w][thread_idx]);
      const ScaleCode<float> cs = Fp32Exact::from_amax_bits<F>(m);
      shared.col_encode[thread_idx] = cs.encode;
      const int h = thread_idx / kTileN, c = thread_idx % kTileN;
      out_.s_cols[(pstart / kTileM + m_coord) * W + h * H + col0 + c] = cs.stored;
    }
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, kBarrier);

    // Each half's two fp8 tiles staged, then 16-byte stores, whole lines.
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
#pragma unroll 1
      for (int k = 0; k < kGroups; ++k) {
        const float2 e = ld_shared_f32x2(enc_at + 4 * (h * kTileN + 8 * k));
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 2; ++j) {
          const uint32_t two = ld_shared_u32(at + j * 8 * kH13Line + 16 * k + h * 2 * kTileN);
          const float x0 = E::to_float(static_cast<uint16_t>(two));
          const float x1 = E::to_float(static_cast<uint16_t>(two >> 16));
          const uint16_t two_r = scaled_fp8x2<F>(x0, x1, rs[h][j].encode);
          const uint16_t two_c = scaled_fp8x2<F>(x0, x1, e.x, e.y);
          st_shared_u16(rows_at + j * 8 * kTileN + (rows_x ^ (8 * k)), two_r);
          st_shared_u8(cols_at[0] + 8 * k * kTileM + 8 * j, two_c & 0xFFu);
          st_shared_u8(cols_at[1] + 8 * k * kTileM + 8 * j, two_c >> 8);
        }
      }
      cutlass::arch::NamedBarrier::sync(kConsumerThreads, kBarrier);
      const uint8_t* st = reinterpret_cast<const uint8_t*>(Parent::smem_d(shared.parent));
      constexpr int kChunks = kTileM * kTileN / 16;  // 16-byte pieces of a tile
      const int hc = h * H + col0;                   // the half's first column of grad_h13
      CUTLASS_PRAGMA_UNROLL
      for (int i = thread_idx; i < kChunks; i += kConsumerThreads) {
        const int line = i / (kTileN / 16), piece = (i % (kTileN / 16)) * 16;
        const int at_line = line * kTileN + swizzled(piece, line);
        if (row0 + line < rows_g) {
          *reinterpret_cast<uint4*>(out_.q_rows + (start + row0 + line) * W + hc + piece) =
              *reinterpret_cast<const uint4*>(st + at_line);
        }
        *reinterpret_cast<uint4*>(out_.q_cols + int64_t(hc + line) * out_.q_rows_total + pstart + row0 + piece) =
            *reinterpret_cast<const uint4*>(st + kTileM * kTileN + at_line);
      }
      cutlass::arch::NamedBarrier::sync(kConsumerThreads, kBarrier);  // the staged tiles are read
    }
  }

  // Byte b of staged line l (16-byte chunks XOR-swizzled by the line: a warp's 8 rows, or columns, on other banks).
  static CUTLASS_DEVICE int swizzled(int b, int l) { return b ^ ((l % 8) * 16); }
  // The larger |x| of a bf16 pair, as a float's bits.
  static CUTLASS_DEVICE uint32_t pair_amax(uint32_t two) { return max(bf16_abs_bits(two), bf16_abs_bits(two >> 16)); }
  static CUTLASS_DEVICE void st_shared_u32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v));
  }
  static CUTLASS_DEVICE void st_shared_u16(uint32_t addr, uint16_t v) {
    asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v));
  }
  static CUTLASS_DEVICE void st_shared_u8(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u8 [%0], %1;" ::"r"(addr), "r"(v));
  }
  static CUTLASS_DEVICE uint32_t ld_shared_u32(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
  }
  static CUTLASS_DEVICE float2 ld_shared_f32x2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
  }
  // |x| of a bf16 (low 16 bits) as a float's bits: the amaxes compare these.
  static CUTLASS_DEVICE uint32_t bf16_abs_bits(uint32_t b) { return (b & 0x7FFFu) << 16; }

  // The consumers' named barrier: after the mainloop's two (PipelinedPromotion::scales_read).
  static constexpr uint32_t kBarrier = 2;
  DswigluQuantOut const& out_;
  uint32_t load_phase_ = 0, store_phase_ = 0;
};

}  // namespace moe_fp8
