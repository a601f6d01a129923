// The consumer side of CUTLASS 4.2's Hopper grouped FP8 blockwise mainloop, rescheduled so that the tensor cores do
// not wait for the promotion (record 008): PipelinedPromotion double-buffers the partial, SequencedPromotion (256x128,
// 128x256 tiles) promotes atom by atom. Both give bit for bit the base mainloop's result (same math, same order).
#pragma once

#include "../core/portability.h"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"

namespace moe_fp8 {

// What both mainloops below share: the operand and scale views of a consumer thread, and
// the promotion of a partial accumulator.
template <class Base>
struct PromotionParts : Base {
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  using typename Base::TileShape;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using Scale = typename Base::ElementBlockScale;
  static constexpr int kScalesM = Base::ScaleMsPerTile;  // distinct scales of a tile along M
  static constexpr int kScalesN = Base::ScaleNsPerTile;
  // The base promotes at every k tile only when one scale block spans one k tile (the
  // recipe's 128-deep blocks at a 128-deep tile); coarser K blocks would need its counter.
  static_assert(Base::ScalePromotionInterval == cute::size<2>(TileShape{}) / cute::tile_size<2>(TiledMma{}),
                "PromotionParts: one scale block per k tile");
  // The scale views below broadcast one scale over a whole tile or a GMMA atom's columns, or give each row (column)
  // its own: the recipe's granularities (1 or 128 rows; 1 or 128 columns, 128-wide atoms in 256-wide tiles).
  static constexpr int kAtomN = cute::tile_size<1>(TiledMma{});
  static constexpr bool kOneScaleAnAtomN = kScalesN == 1 || (cute::size<1>(TileShape{}) / kScalesN) % kAtomN == 0;
  static_assert((kScalesM == 1 || kScalesM == cute::size<0>(TileShape{})) &&
                    (kOneScaleAnAtomN || kScalesN == cute::size<1>(TileShape{})),
                "PromotionParts: one scale a tile or atom, or one a row / column, along M and N");

  // A consumer thread's views: tiled_mma, tCrA (MMA,MMA_M,MMA_K,PIPE), tCrB (MMA,MMA_N,MMA_K,PIPE), tCsSFA / tCsSFB
  // (MMA,MMA_M,MMA_N,(MMA_K,PIPE)): scales viewed as (BLK_M, BLK_N, (BLK_K, PIPE)) with the other operand's mode
  // broadcast, so that partition_C hands each thread the scales of its accumulators.
  static CUTLASS_DEVICE auto thread_views(TensorStorage& shared_tensors, int thread_idx) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                               make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                    make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    constexpr int kWgThreads = cutlass::NumThreadsPerWarpGroup;
    constexpr int kWarpGroups = size(TiledMma{}) / kWgThreads;
    const Layout warp_groups = make_layout(Int<kWarpGroups>{}, Int<kWgThreads>{});
    const int warp_group = static_cast<int>(warp_shfl(static_cast<uint32_t>(thread_idx / kWgThreads), 0));  // uniform
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_groups(warp_group));
    return make_tuple(tiled_mma, thread_mma.make_fragment_A(thread_mma.partition_A(sA)),
                      thread_mma.make_fragment_B(thread_mma.partition_B(sB)),
                      tiled_mma.get_slice(thread_idx).partition_C(sSFA),
                      tiled_mma.get_slice(thread_idx).partition_C(sSFB));
  }

  // One k tile's GMMAs into `part` (the first one zeroes it), committed as one batch and
  // not waited for. tCrA / tCrB: a stage's operands, (MMA,MMA_M,MMA_K) / (MMA,MMA_N,MMA_K);
  // m and n: a GMMA atom's indices, or `_` for the whole tile.
  template <class Mma, class OperandsA, class OperandsB, class M, class N, class Part>
  static CUTLASS_DEVICE void issue_gmmas(Mma& tiled_mma, OperandsA const& tCrA, OperandsB const& tCrB, M m, N n,
                                         Part& part) {
    using namespace cute;
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(part);
    warpgroup_arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
      cute::gemm(tiled_mma, tCrA(_, m, k_block), tCrB(_, n, k_block), part);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  }

  // Call before a stage goes back (consumer_release, or mma_tail()): it arrives from one thread and our promotion reads
  // the scales after the GMMAs, so a lagging warp could otherwise read a refilled stage. One named barrier a warp
  // group, ids 0 and 1 of the user range (CUTLASS's sm90 collectives use only its reserved ids).
  static CUTLASS_DEVICE void scales_read(int thread_idx) {
    constexpr int kWgThreads = cutlass::NumThreadsPerWarpGroup;
    static_assert(cute::size(TiledMma{}) / kWgThreads <= 2, "scales_read: one barrier id per warp group, two ids");
    cutlass::arch::NamedBarrier::sync(kWgThreads, thread_idx / kWgThreads);
  }

  // Whether a thread's slice of scales holds one distinct scale (a tile's, or a GMMA atom's columns').
  template <class T>
  static constexpr bool kOne = decltype(cute::size(cute::filter_zeros(cute::declval<T>())))::value == 1;

  // One promotion's factors from one stage's scales (slices of thread_views'), multiplied first as the base does
  // (GmmaFP8Accumulation::scale_core): the product in sfa (its first element where both are one a slice, each
  // distinct one where only A's are per row), or both kept (per row and per column).
  template <class ScalesA, class ScalesB>
  static CUTLASS_DEVICE auto scale_factors(ScalesA const& sSFA, ScalesB const& sSFB) {
    using namespace cute;
    Tensor sfa = make_tensor_like<Scale>(sSFA);
    Tensor sfb = make_tensor_like<Scale>(sSFB);
    copy(sSFA, sfa);
    copy(sSFB, sfb);
    constexpr bool one_a = kOne<decltype(sfa)>, one_b = kOne<decltype(sfb)>;
    if constexpr (one_a && one_b) {
      sfa(_0{}) = sfa(_0{}) * sfb(_0{});
    } else if constexpr (one_b) {
      const Scale b = sfb(_0{});
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(filter_zeros(sfa)); ++i) filter_zeros(sfa)(i) = filter_zeros(sfa)(i) * b;
    } else if constexpr (one_a) {
      const Scale a = sfa(_0{});
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(filter_zeros(sfb)); ++i) filter_zeros(sfb)(i) = filter_zeros(sfb)(i) * a;
    }
    return make_tuple(sfa, sfb);
  }

  // total += part x factors, element by element, once part's GMMAs have completed.
  template <class Total, class Part, class Factors>
  static CUTLASS_DEVICE void apply(Total&& total, Part& part, Factors& factors) {
    using namespace cute;
    auto& [sfa, sfb] = factors;
    constexpr bool one_a = kOne<cute::remove_cvref_t<decltype(sfa)>>, one_b = kOne<cute::remove_cvref_t<decltype(sfb)>>;
    warpgroup_fence_operand(part);
    warpgroup_fence_operand(total);
    if constexpr (one_a && one_b) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(total); ++i) total(i) += part(i) * sfa(_0{});
    } else if constexpr (one_b) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(total); ++i) total(i) += part(i) * sfa(i);
    } else if constexpr (one_a) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(total); ++i) total(i) += part(i) * sfb(i);
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(total); ++i) total(i) += part(i) * sfa(i) * sfb(i);
    }
    warpgroup_fence_operand(total);
  }

  // total += part x scale, with the scales read now from the stage (sSFA / sSFB).
  template <class Total, class Part, class ScalesA, class ScalesB>
  static CUTLASS_DEVICE void promote(Total&& total, Part& part, ScalesA const& sSFA, ScalesB const& sSFB) {
    auto factors = scale_factors(sSFA, sSFB);
    apply(total, part, factors);
  }
};

// Tile t's GMMAs go into part[t % 2]; the warp group waits only for tile t - 1 (warpgroup_wait<1>), promotes it from
// its still-held stage and releases that stage while tile t runs. Cost: one more partial, 64 fp32 registers a thread
// at 128x128 (no spill). Stage accounting matches the base: mma_tail() releases the last stage.
template <class Base>
struct PipelinedPromotion : PromotionParts<Base> {
  using Parts = PromotionParts<Base>;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::Params;

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulator lives in registers");
    auto [tiled_mma, tCrA, tCrB, tCsSFA, tCsSFB] = Parts::thread_views(shared_tensors, thread_idx);
    CUTE_STATIC_ASSERT_V(size<1>(tCrA) == size<1>(accum));
    CUTE_STATIC_ASSERT_V(size<1>(tCrB) == size<2>(accum));

    // Two partial accumulators. A tile's scales are read from its stage when it is
    // promoted (the stage is still held then), so that no scale is held in registers
    // across a GMMA: the wgrad tiles have 2 x 32 distinct scales a thread.
    Tensor part0 = make_fragment_like(accum);
    Tensor part1 = make_fragment_like(accum);

    clear(accum);
    if (k_tile_count <= 0) return;

    PipelineState smem_pipe_release = smem_pipe_read;
    auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    int issued = 0;

    // Tile `issued`'s GMMAs into `part`, committed, not waited for.
    auto issue = [&](auto& part) {
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      const int stage = smem_pipe_read.index();
      Parts::issue_gmmas(tiled_mma, tCrA(_, _, _, stage), tCrB(_, _, _, stage), _, _, part);
      warpgroup_fence_operand(part);
      ++smem_pipe_read;
      if (++issued < k_tile_count) barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    };
    // total += part x scale for the oldest tile not yet promoted (the stage of
    // smem_pipe_release), once its GMMAs have completed.
    auto promote = [&](auto& part) {
      const int stage = smem_pipe_release.index();
      Parts::promote(accum, part, tCsSFA(_, _, _, make_coord(_0{}, stage)), tCsSFB(_, _, _, make_coord(_0{}, stage)));
    };
    // After the next tile is issued: wait for the one before it, promote it and hand its
    // stage back to the producer.
    auto retire = [&](auto& part) {
      warpgroup_wait<1>();
      promote(part);
      Parts::scales_read(thread_idx);
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
    };

    // Tiles in pairs, even ones in part0, odd ones in part1 (fixed registers: the body names each). The last tile is
    // waited for and promoted where the loop leaves, so that no path with a GMMA in flight joins one without (ptxas
    // would wait for the GMMA where such paths join: C7517).
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 0;; t += 2) {
      issue(part0);  // tile t
      if (t > 0) retire(part1);  // tile t - 1
      if (t + 1 >= k_tile_count) {
        warpgroup_wait<0>();
        promote(part0);  // the last tile, t
        Parts::scales_read(thread_idx);  // before mma_tail() releases its stage
        break;
      }
      issue(part1);  // tile t + 1
      retire(part0);  // tile t
      if (t + 2 >= k_tile_count) {
        warpgroup_wait<0>();
        promote(part1);  // the last tile, t + 1
        Parts::scales_read(thread_idx);  // before mma_tail() releases its stage
        break;
      }
    }
  }
};

// For 256x128 and 128x256 tiles (a 128-fp32 total a thread): ONE 64x128 atom's partial, issued, waited for and
// promoted atom by atom, while the other warp group's GMMAs keep the tensor cores busy. The same GMMAs in the same
// order as the 128x128 tiles: bit for bit the result of PipelinedPromotion.
template <class Base>
struct SequencedPromotion : PromotionParts<Base> {
  using Parts = PromotionParts<Base>;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::Params;

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulator lives in registers");
    auto [tiled_mma, tCrA, tCrB, tCsSFA, tCsSFB] = Parts::thread_views(shared_tensors, thread_idx);
    CUTE_STATIC_ASSERT_V(size<1>(tCrA) == size<1>(accum));
    CUTE_STATIC_ASSERT_V(size<1>(tCrB) == size<2>(accum));
    constexpr int kRepM = decltype(size<1>(accum))::value;
    constexpr int kRepN = decltype(size<2>(accum))::value;
    // One B scale an atom (2d3d): an atom's factors are a few registers, read before its GMMAs, which are collective
    // and waited for by the releasing warp, so no barrier is needed (record 021). Per-column B scales (2d2d, 34
    // registers): read after the GMMAs, with scales_read before each release.
    constexpr bool kEarlyScales = Parts::kOneScaleAnAtomN;

    Tensor part = make_fragment_like(accum(_, _0{}, _0{}));  // (MMA): one GMMA atom's accumulators

    clear(accum);
    if (k_tile_count <= 0) return;

    auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 0; t < k_tile_count; ++t) {
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      const int stage = smem_pipe_read.index();
      CUTLASS_PRAGMA_UNROLL
      for (int mn = 0; mn < kRepM * kRepN; ++mn) {
        const int m = mn % kRepM, n = mn / kRepM;
        auto issue_and_wait = [&] {
          Parts::issue_gmmas(tiled_mma, tCrA(_, _, _, stage), tCrB(_, _, _, stage), m, n, part);
          warpgroup_wait<0>();
        };
        if constexpr (kEarlyScales) {
          auto factors = Parts::scale_factors(tCsSFA(_, m, n, make_coord(_0{}, stage)),
                                              tCsSFB(_, m, n, make_coord(_0{}, stage)));
          // The factors (computed from the loaded scales) exist before the GMMAs issue.
          warpgroup_fence_operand(get<0>(factors));
          warpgroup_fence_operand(get<1>(factors));
          issue_and_wait();
          Parts::apply(accum(_, m, n), part, factors);
        } else {
          issue_and_wait();
          Parts::promote(accum(_, m, n), part, tCsSFA(_, m, n, make_coord(_0{}, stage)),
                         tCsSFB(_, m, n, make_coord(_0{}, stage)));
        }
      }
      // Every stage but the last goes back here; the kernel's mma_tail() releases the last.
      if constexpr (!kEarlyScales) Parts::scales_read(thread_idx);
      if (t + 1 < k_tile_count) {
        pipeline.consumer_release(smem_pipe_read);
        ++smem_pipe_read;
        barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
      }
    }
  }
};

}  // namespace moe_fp8
