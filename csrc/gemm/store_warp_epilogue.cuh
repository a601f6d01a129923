// An epilogue for CUTLASS 4.2's Hopper pointer-array cooperative GEMM whose TMA stores are issued by the producer warp
// group's spare warp: the consumers hand their tile over through the base's D stages (one per 128x64 subtile) and two
// mbarriers, and go on to the next tile, where CUTLASS's epilogue keeps them for the store (record 017).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"

namespace moe_fp8 {

// The shared-memory layout atom of the base's D stages (a template argument of the base).
template <class>
struct SmemLayoutAtomDOf;
template <int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore, int WarpGroups,
          class CtaTile, class EpiTile, class ElementC, class StrideC, class ElementD, class StrideD, class Fusion,
          class CopyOpG2S, class AtomC, class CopyOpS2R, class CopyOpS2G, class AtomD, class CopyOpR2S,
          class CopyAtomC, class CopyOpR2R>
struct SmemLayoutAtomDOf<cutlass::epilogue::collective::CollectiveEpilogue<
    cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC, DelayTmaStore,
                                                      WarpGroups>,
    CtaTile, EpiTile, ElementC, StrideC, ElementD, StrideD, Fusion, CopyOpG2S, AtomC, CopyOpS2R, CopyOpS2G, AtomD,
    CopyOpR2S, CopyAtomC, CopyOpR2R>> {
  using type = AtomD;
};

// The base epilogue with `Stages` D stages (CUTLASS's builder gives min(subtiles, 2)): the
// store-warp epilogue needs one stage per subtile of a tile, 4 at 256x128.
template <class, int>
struct WithStagesD;
template <int Stages, int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore, int WarpGroups,
          class CtaTile, class EpiTile, class ElementC, class StrideC, class ElementD, class StrideD, class Fusion,
          class CopyOpG2S, class AtomC, class CopyOpS2R, class CopyOpS2G, class AtomD, class CopyOpR2S,
          class CopyAtomC, class CopyOpR2R>
struct WithStagesD<cutlass::epilogue::collective::CollectiveEpilogue<
                       cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC,
                                                                         DelayTmaStore, WarpGroups>,
                       CtaTile, EpiTile, ElementC, StrideC, ElementD, StrideD, Fusion, CopyOpG2S, AtomC, CopyOpS2R,
                       CopyOpS2G, AtomD, CopyOpR2S, CopyAtomC, CopyOpR2R>,
                   Stages> {
  using type = cutlass::epilogue::collective::CollectiveEpilogue<
      cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<StagesC, Stages, FragmentSize, ReuseSmemC, DelayTmaStore,
                                                        WarpGroups>,
      CtaTile, EpiTile, ElementC, StrideC, ElementD, StrideD, Fusion, CopyOpG2S, AtomC, CopyOpS2R, CopyOpS2G, AtomD,
      CopyOpR2S, CopyAtomC, CopyOpR2R>;
};

// Whether a TiledMma's accumulators are GMMA's 64xN layout, unpermuted (the consumers'
// hand-computed addresses assume it).
template <class>
struct IsPlainGmmaC : std::false_type {};
template <class Atom, class AtomLayout>
struct IsPlainGmmaC<cute::TiledMMA<Atom, AtomLayout, cute::Tile<cute::Underscore, cute::Underscore, cute::Underscore>>>
    : std::bool_constant<cute::is_same_v<
          typename Atom::LayoutC_TV,
          cute::GMMA::CLayout_64xN<decltype(cute::size<1>(typename Atom::Shape_MNK{}))::value>>> {};

// kSplitHalves: a 256-column tile's two 128-column halves go to tiles n and split_tiles_ + n of D's 128-column tiling
// (the SwiGLU epilogue's [W1; W3] interleaved by 128 rows, written back as [h1 | h3]).
template <class Base, bool kSplitHalves = false>
struct StoreWarpEpilogue : Base {
  using typename Base::Arguments;
  using typename Base::Params;
  using typename Base::PipelineStorage;
  using typename Base::TensorMapStorage;
  using ElementD = typename Base::ElementD;
  using CtaTile = typename Base::CtaTileMNK;
  using EpiTile = typename Base::EpilogueTile;

  static constexpr int kTileM = cute::size<0>(CtaTile{});
  static constexpr int kTileN = cute::size<1>(CtaTile{});
  static constexpr int kEpiM = cute::size<0>(EpiTile{});
  static constexpr int kEpiN = cute::size<1>(EpiTile{});
  static constexpr int kSubM = kTileM / kEpiM;
  static constexpr int kSubtiles = kSubM * (kTileN / kEpiN);  // one D stage each, M-fastest
  static constexpr int kRowBytes = kEpiN * static_cast<int>(sizeof(ElementD));  // a subtile row: 128 bytes
  static constexpr int kSubtileBytes = kEpiM * kRowBytes;
  static constexpr int kConsumerThreads = Base::NumEpilogueWarpGroups * cutlass::NumThreadsPerWarpGroup;
  // The base's D stages, as many as the tile has subtiles: (EPI_M, EPI_N, subtile).
  using SmemLayoutD = decltype(cute::tile_to_shape(
      typename SmemLayoutAtomDOf<Base>::type{},
      cute::make_shape(cute::size<0>(EpiTile{}), cute::size<1>(EpiTile{}), cute::Int<kSubtiles>{}),
      cute::Step<cute::_1, cute::_2, cute::_3>{}));
  static_assert(cute::is_same_v<ElementD, cutlass::bfloat16_t>, "StoreWarpEpilogue: bf16 output");
  static_assert(cute::is_void_v<typename Base::ElementC>, "StoreWarpEpilogue: an epilogue without C");
  static_assert(cute::is_same_v<typename Base::ThreadEpilogueOp,
                                cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>,
                "StoreWarpEpilogue: D = alpha * acc only (the stores apply no other fusion)");
  static_assert(Base::IsGroupedGemmKernel, "StoreWarpEpilogue: a grouped GEMM (per-group D descriptors)");
  // Subtiles of whole 64-row GMMA atoms, M-fastest: the consumers' row offset (dm / kEpiM)
  // subtiles + (dm % kEpiM) rows is dm rows from the base; along N a thread's columns of
  // one 8-column group lie in one subtile (kEpiN a multiple of 8).
  static_assert(kTileM % kEpiM == 0 && kEpiM % 64 == 0 && kTileN % kEpiN == 0,
                "StoreWarpEpilogue: subtiles of 64-row multiples that divide the tile");
  static_assert(kRowBytes == 128 && cute::is_same_v<typename SmemLayoutAtomDOf<Base>::type,
                                                    cute::GMMA::Layout_K_SW128_Atom<ElementD>>,
                "StoreWarpEpilogue: 128-byte subtile rows, 128B-swizzled (the consumers' addresses)");
  static_assert(cute::is_same_v<cute::remove_cvref_t<decltype(cute::get<1>(typename Base::InternalStrideD{}))>,
                                cute::Int<1>>,
                "StoreWarpEpilogue: row-major D");

  // The barriers take 1 KB of shared memory, not 16 bytes: the D stages' 1024-byte alignment pads the struct (5
  // mainloop stages either way at 128x128, 3 at 256x128 and 128x256).
  struct TensorStorage {
    typename Base::TensorStorage base;    // the base's D stages hold the tile
    cutlass::arch::ClusterBarrier full;   // the consumers have written the tile
    cutlass::arch::ClusterBarrier empty;  // the store warp's TMA stores have read it
  };
  static_assert(sizeof(ElementD) * cute::cosize_v<SmemLayoutD> <=
                    sizeof(typename Base::TensorStorage::CollectiveStorage),
                "StoreWarpEpilogue: the base's D stages hold less than one tile");
  static_assert(alignof(typename Base::TensorStorage::CollectiveStorage) % 1024 == 0,
                "StoreWarpEpilogue: D stages on the 128B swizzle's 1024-byte period (the consumers' addresses)");
  // What the kernel takes of shared memory for the epilogue (the mainloop's carveout).
  struct SharedStorage {
    TensorStorage tensors;
    TensorMapStorage tensormaps;
    PipelineStorage pipeline;
  };

  // The kernel constructs the collectives before its block (or cluster) barrier, which
  // orders the barriers' initialization before any use.
  CUTLASS_DEVICE StoreWarpEpilogue(Params const& params, TensorStorage& shared)
      : Base(params, shared.base), params_(params) {
    if (threadIdx.x == 0) {
      shared.full.init(kConsumerThreads);
      shared.empty.init(cutlass::NumThreadsPerWarp);
      cutlass::arch::fence_barrier_init();
    }
  }

  // D = acc: the stores ignore the fusion's alpha and C, so only alpha 1 and beta 0 pass.
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    bool plain = args.thread.alpha == 1.f && args.thread.beta == 0.f && args.thread.alpha_ptr == nullptr &&
                 args.thread.beta_ptr == nullptr;
    if constexpr (requires { args.thread.alpha_ptr_array; }) {
      plain = plain && args.thread.alpha_ptr_array == nullptr && args.thread.beta_ptr_array == nullptr;
    }
    return plain && Base::can_implement(problem_shape, args);
  }

  // The store warp is the kernel's epilogue-load warp; it walks the same tiles as the consumers and has the next tile's
  // mainloop to store this one (one buffer suffices; with a k tile or two a tile the consumers wait for it).
  CUTLASS_DEVICE bool is_producer_load_needed() const { return true; }

  // The store warp's descriptor: the base's D descriptor of slot 0. The kernel gives the
  // load warp's (IsLoad) updates to the store warp; the consumers' do nothing.
  CUTLASS_DEVICE auto load_init(Params const& params, TensorMapStorage& shared_tensormaps, int32_t sm_count,
                                int32_t sm_idx) {
    return Base::template tensormaps_init<false>(params, shared_tensormaps, sm_count, sm_idx, 0);
  }
  CUTLASS_DEVICE auto store_init(Params const&, TensorMapStorage&, int32_t, int32_t, int32_t) {
    return cute::make_tuple(static_cast<cute::TmaDescriptor*>(nullptr));
  }
  template <bool IsLoad, class ProblemShapeMNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage& shared_tensormaps, Params const& params,
                                                cute::TmaDescriptor const* tensormap,
                                                ProblemShapeMNKL problem_shape_mnkl, int32_t next_batch, int32_t) {
    if constexpr (IsLoad) {
      Base::template tensormaps_perform_update<false>(shared_tensormaps, params, tensormap, problem_shape_mnkl,
                                                      next_batch, 0);
    }
  }
  template <bool IsLoad>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage& shared_tensormaps,
                                                  cute::TmaDescriptor const* tensormap, const int32_t = 0) {
    if constexpr (IsLoad) Base::template tensormaps_cp_fence_release<false>(shared_tensormaps, tensormap, 0);
  }
  template <bool IsLoad>
  CUTLASS_DEVICE void tensormaps_fence_acquire(cute::TmaDescriptor const* tensormap) {
    if constexpr (IsLoad) Base::template tensormaps_fence_acquire<false>(tensormap);
  }

  // Store warp, once a tile: wait on `full`, issue the subtiles' TMA stores as the base does (the grouped scheduler
  // never splits a tile), wait until they have read shared memory, arrive on `empty`. Few TMA tensor stores: the warp
  // writing the tile itself, or a bulk copy a row, was slower than CUTLASS's epilogue (record 017).
  template <class LoadPipeline, class LoadPipelineState, class ProblemShapeMNKL, class TileShapeMNK,
            class TileCoordMNKL, class TiledMma, class TensorMapD>
  CUTLASS_DEVICE auto load(LoadPipeline, LoadPipelineState state, ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK,
                           TileCoordMNKL tile_coord_mnkl, TiledMma, int, TensorStorage& shared,
                           TensorMapD const& tensormap, int = -1) {
    using namespace cute;
    shared.full.wait(phase_);
    if (elect_one_sync()) {
      auto [M, N, K, L] = problem_shape_mnkl;
      auto [m_coord, n_coord, k_coord, l_coord] = tile_coord_mnkl;
      Tensor mD = coalesce(params_.tma_store_d.get_tma_tensor(append<3>(make_shape(M, N), Int<1>{})),
                           take<0, 2>(CtaTile{}));                                     // (M, N)
      Tensor sD = as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(smem_d(shared)), SmemLayoutD{}));
      ThrCopy s2g = params_.tma_store_d.get_slice(Int<0>{});
      Tensor bSG_sD = s2g.partition_S(sD);  // (S2G, S2G_M, S2G_N, subtile)
      if constexpr (!kSplitHalves) {
        Tensor gD = local_tile(mD, take<0, 2>(CtaTile{}), make_coord(m_coord, n_coord, Int<0>{}));  // (TILE_M, TILE_N)
        Tensor bSG_gD = s2g.partition_D(flat_divide(gD, EpiTile{}));  // (S2G, S2G_M, S2G_N, SUB_M, SUB_N)
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < kSubtiles; ++t) {
          copy(params_.tma_store_d.with(tensormap), bSG_sD(_, _, _, t), bSG_gD(_, _, _, t % kSubM, t / kSubM));
        }
      } else {
        static_assert(kTileN == 256, "StoreWarpEpilogue: split halves of a 256-column tile");
        using Half = Shape<Int<kTileM>, Int<kTileN / 2>>;
        constexpr int kSubN = kTileN / 2 / kEpiN;  // subtile columns a half
        auto half = [&](int n) {  // (S2G, S2G_M, S2G_N, SUB_M, SUB_N) of D's 128-column tile n
          return s2g.partition_D(flat_divide(local_tile(mD, Half{}, make_coord(m_coord, n, Int<0>{})), EpiTile{}));
        };
        Tensor lo = half(n_coord);
        Tensor hi = half(split_tiles_ + n_coord);
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < kSubtiles && n_coord < split_tiles_; ++t) {  // (a cluster's spare tile past N: none)
          const int sub_m = t % kSubM, sub_n = t / kSubM;
          if (sub_n < kSubN) {
            copy(params_.tma_store_d.with(tensormap), bSG_sD(_, _, _, t), lo(_, _, _, sub_m, sub_n));
          } else {
            copy(params_.tma_store_d.with(tensormap), bSG_sD(_, _, _, t), hi(_, _, _, sub_m, sub_n - kSubN));
          }
        }
      }
      tma_store_arrive();
      tma_store_wait<0>();  // the stores have read the tile
    }
    __syncwarp();
    shared.empty.arrive();
    phase_ ^= 1;
    return state;
  }

  template <class LoadPipeline, class LoadPipelineState>
  CUTLASS_DEVICE auto load_tail(LoadPipeline, LoadPipelineState state) {
    return state;
  }

  // Consumers, once a tile: wait on `empty`, write D = the accumulators rounded to bf16 pairs (nearest even, as the
  // base's converter), fence the async proxy, arrive on `full`. No named barrier, TMA wait or descriptor update.
  template <class LoadPipeline, class LoadPipelineState, class StorePipeline, class StorePipelineState,
            class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma, class TensorMapD>
  CUTLASS_DEVICE auto store(LoadPipeline, LoadPipelineState load_state, StorePipeline, StorePipelineState store_state,
                            ProblemShapeMNKL, TileShapeMNK tile_shape_MNK, TileCoordMNKL,
                            cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma tiled_mma, int thread_idx,
                            TensorStorage& shared, TensorMapD const&, int = -1) {
    using namespace cute;
    // A thread holds rows m_t + dm, columns n_t + dn (n_t < 8; dm, dn multiples of 8; n, n + 1 in one register
    // pair): in the 128B-swizzled subtiles (m, n) is a per-thread base plus a constant, XOR a per-thread constant, so
    // hand-computed (CuTe's swizzled tensor makes ptxas hold addresses and spill). Bit-exact with the base (tests).
    Tensor coords = tiled_mma.get_slice(thread_idx).partition_C(make_identity_tensor(take<0, 2>(tile_shape_MNK)));
    static_assert(decltype(size(accumulators))::value % 2 == 0, "StoreWarpEpilogue: accumulators in pairs");
    static_assert(IsPlainGmmaC<TiledMma>::value, "StoreWarpEpilogue: GMMA's 64xN accumulators, unpermuted");
    const int m_t = get<0>(coords(0)), n_t = get<1>(coords(0));
    uint32_t base = cast_smem_ptr_to_uint(smem_d(shared)) + m_t * kRowBytes + n_t * int(sizeof(ElementD));
    uint32_t swizzle = (m_t % 8) * 16;
    // Opaque from here on, so that the addresses below are formed here, once a tile.
    asm volatile("" : "+r"(base), "+r"(swizzle));
    shared.empty.wait(phase_ ^ 1);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); i += 2) {
      const int dm = get<0>(coords(i)) - m_t, dn = get<1>(coords(i)) - n_t;  // constants
      const int subtile = dm / kEpiM + kSubM * (dn / kEpiN);
      const uint32_t addr = base + subtile * kSubtileBytes + (dm % kEpiM) * kRowBytes +
                            ((((dn % kEpiN) / 8) * 16) ^ swizzle);
      const __nv_bfloat162 pair = __floats2bfloat162_rn(accumulators(i), accumulators(i + 1));
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(reinterpret_cast<const uint32_t&>(pair)));
    }
    cutlass::arch::fence_view_async_shared();  // the writes, visible to the TMA stores
    shared.full.arrive();                      // release: the store warp's acquire sees them
    phase_ ^= 1;
    return cute::make_tuple(load_state, store_state);
  }

  template <class LoadPipeline, class LoadPipelineState, class StorePipeline, class StorePipelineState>
  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                                 StorePipelineState store_state) {
    return cute::make_tuple(load_state, store_state);
  }

 protected:
  static CUTLASS_DEVICE ElementD* smem_d(TensorStorage& shared) {
    return reinterpret_cast<ElementD*>(&shared.base.collective);
  }
  // Consumers, after store(): until the store warp's TMA stores have read the tile handed over. The D stages are then
  // the consumers' until their next store() (which a derived epilogue must not reach before all are done with them).
  CUTLASS_DEVICE void wait_tile_read(TensorStorage& shared) { shared.empty.wait(phase_ ^ 1); }

  int split_tiles_ = 0;  // kSplitHalves: D's 128-column tiles in its first half (the derived epilogue sets it)

 private:
  Params const& params_;
  uint32_t phase_ = 0;  // of `full` for the store warp; `empty` waits on the other parity
};

// The host-facing types of an epilogue built on StoreWarpEpilogue that also writes Fused (SwigluQuantOut, ...): its
// Arguments and Params carry `fused`; its shared memory is Tensors with the parent's tensor maps and pipeline.
template <class Parent, class Fused, class Tensors>
struct FusedEpilogueTypes {
  struct Arguments : Parent::Arguments {
    Fused fused;
  };
  struct Params : Parent::Params {
    Fused fused;
  };
  struct SharedStorage {
    Tensors tensors;
    typename Parent::TensorMapStorage tensormaps;
    typename Parent::PipelineStorage pipeline;
  };
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Parent::Params&>(p) = Parent::to_underlying_arguments(shape, args, workspace);
    p.fused = args.fused;
    return p;
  }
};

}  // namespace moe_fp8
