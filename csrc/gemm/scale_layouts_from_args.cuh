// A thin layer over CUTLASS 4.2's Hopper grouped FP8 blockwise mainloop that makes it read the per-group scale
// layouts it is given: the base rebuilds them with the packed stride ceil(M_g / granularity), but our activation
// scales are ONE (M, K/128) column-major tensor (column stride M, all tokens). Loads and math stay CUTLASS's.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace moe_fp8 {

template <class Base>
struct ScaleLayoutsFromArgs : Base {
  using Params = typename Base::Params;
  using ScaleLayoutA = typename Base::InternalLayoutSFA;  // one group's (scale_m, scale_k, l) layout
  using ScaleLayoutB = typename Base::InternalLayoutSFB;
  using ScaleElement = typename Base::ElementBlockScale;
  static_assert(Base::IsGroupedGemmKernel, "ScaleLayoutsFromArgs: per-group layouts are for grouped GEMMs");

  // The kernel calls this once for its first tile, with no group: the scale views are placeholders, replaced before
  // any load because the first tile always counts as a group change (tensors_perform_update).
  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto load_init(ProblemShapeMNKL const& shape, Params const& params) const {
    return with_scales(shape, params, nullptr, ScaleLayoutA{}, nullptr, ScaleLayoutB{});
  }

  // The scale loads of the auxiliary warp, replacing the base's. Each distinct scale of a k tile is copied by exactly
  // one lane: the base lets lanes 0..ScaleNsPerTile-1 each copy every B scale of a 256-wide tile (racecheck's
  // write-write hazard), and its bound check reads the wrong coordinate for a tile's second B scale.
  template <class TensorA, class TensorB, class TensorSFA, class TensorSFB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const&, typename Base::MainloopPipeline pipeline,
                                     typename Base::PipelineState smem_pipe_write,
                                     cute::tuple<TensorA, TensorB, TensorSFA, TensorSFB> const& load_inputs,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int lane,
                                     uint32_t, typename Base::TensorStorage& shared_tensors) {
    using namespace cute;
    using TileShape = typename Base::TileShape;
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor sSFA = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()), typename Base::SmemLayoutSFA{});
    Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()), typename Base::SmemLayoutSFB{});
    Tensor mSFA = get<2>(load_inputs);
    Tensor mSFB = get<3>(load_inputs);
    // (BLK_M|N, BLK_K, k) tiles of the scales and of their coordinates.
    Tensor gSFA = local_tile(mSFA, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{})(_, _, m_coord, _, l_coord);
    Tensor gSFB = local_tile(mSFB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{})(_, _, n_coord, _, l_coord);
    Tensor cSFA = local_tile(make_identity_tensor(shape(mSFA)), TileShape{}, make_coord(_, _, _),
                             Step<_1, X, _1>{})(_, _, m_coord, _, l_coord);
    Tensor cSFB = local_tile(make_identity_tensor(shape(mSFB)), TileShape{}, make_coord(_, _, _),
                             Step<X, _1, _1>{})(_, _, n_coord, _, l_coord);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count, ++k_tile_iter, ++smem_pipe_write) {
      pipeline.producer_acquire(smem_pipe_write);
      int const stage = smem_pipe_write.index();
      copy_distinct(gSFA(_, _, *k_tile_iter), cSFA(_, _, *k_tile_iter), sSFA(_, _, stage), shape(mSFA), lane);
      copy_distinct(gSFB(_, _, *k_tile_iter), cSFB(_, _, *k_tile_iter), sSFB(_, _, stage), shape(mSFB), lane);
      pipeline.producer_commit(smem_pipe_write, cutlass::arch::cpasync_barrier_arrive_noinc);
    }
  }

  template <class InputTensors, class ProblemShapeMNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const&, Params const& params,
                                                     ProblemShapeMNKL shape, int32_t group) {
    return with_scales(shape, params, params.ptr_SFA[group], params.layout_SFA[group], params.ptr_SFB[group],
                       params.layout_SFB[group]);
  }

 private:
  // One tile's scales: the stride-0 (broadcast) modes dropped, so that each element is one scale, copied by one lane.
  template <class TensorG, class TensorC, class TensorS, class Bound>
  CUTLASS_DEVICE static void copy_distinct(TensorG const& g, TensorC const& c, TensorS&& s, Bound const& bound,
                                           int lane) {
    auto g1 = cute::filter_zeros(g);
    auto c1 = cute::filter_zeros(c, g.stride());
    auto s1 = cute::filter_zeros(s);
    static_assert(decltype(cute::size(g1))::value == decltype(cute::size(s1))::value, "scale tile and stage differ");
    for (int i = lane; i < int(cute::size(s1)); i += 32) {
      if (cute::elem_less(c1(i), bound)) {
        cute::SM80_CP_ASYNC_CACHEALWAYS<ScaleElement>::copy(g1(i), s1(i));
      }
    }
  }

  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto with_scales(ProblemShapeMNKL const& shape, Params const& params, ScaleElement const* sfa,
                                  ScaleLayoutA layout_sfa, ScaleElement const* sfb, ScaleLayoutB layout_sfb) const {
    // The base's A and B views (TMA coordinate tensors); its scale views are dropped.
    auto base = Base::load_init(shape, params);
    return cute::make_tuple(cute::get<0>(base), cute::get<1>(base),
                            cute::make_tensor(cute::make_gmem_ptr(sfa), layout_sfa),
                            cute::make_tensor(cute::make_gmem_ptr(sfb), layout_sfb));
  }
};

}  // namespace moe_fp8
