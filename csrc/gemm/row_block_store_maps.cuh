// A thin layer over CUTLASS's Hopper pointer-array TMA epilogue
// (Sm90EpilogueArrayTmaWarpSpecialized, CUTLASS 4.2) for grouped GEMMs whose groups'
// outputs are blocks of rows of ONE row-major matrix (the 2d3d GEMM's (M, N) output; the
// 2d2d GEMM's (E, N, K) output as (E * N, K)): every whole output tile of a group is
// stored through descriptors of that matrix written once per CTA, so a group change
// costs no descriptor update.
//
// Why: on every group change the base rewrites the descriptor its TMA stores read (the
// group's address and row count: loads of the group's pointer and stride, shared-memory
// writes, a release fence at GPU scope, an acquire before the next store) and, before
// overwriting it, waits until every TMA store issued so far has read its data. The
// consumer warp groups do that between a tile's epilogue and the next tile's first GMMA.
// With many small groups nearly every tile of a CTA starts a new group: at (65536, 2048,
// 1408, 64), 128 tiles a group against 132 CTAs, all of them do. Skipping the update
// (timing only, wrong output) made that shape's GEMMs 5-8% faster on an H100
// (docs/EXPERIMENTS.md).
//
// The matrix descriptors: kResidues of them, descriptor r with its first row at row
// kRowStep * r of the matrix and 2^30 rows (so it clips nothing a tile needs). A group
// whose first row start_g is a multiple of kRowStep has its M tile m at row start_g +
// TILE_M * m = kRowStep * r + TILE_M * (start_g / TILE_M + m) with r = start_g % TILE_M /
// kRowStep: tile start_g / TILE_M + m of descriptor r. So for a group's tile:
// - wholly inside the group: a matrix descriptor, as above;
// - wholly past the group's rows (a cluster's spare tile): matrix descriptor 0 at row
//   2^30, wholly out of bounds, so nothing is written, as the base writes nothing;
// - otherwise (a group's partial last tile, or a start that is not a multiple of
//   kRowStep): the group's own descriptor, as the base has it, written at that tile (its
//   release and acquire back to back) into the one of two slots not read by the latest
//   such tile's stores, so that it waits only for older stores. With many groups a CTA
//   meets few of their last tiles: writing the descriptor at every group change whose
//   group has one instead (the release and acquire then apart) was 1-6% slower on an
//   H100 where group starts are off the 128-row grid (docs/EXPERIMENTS.md).
//
// Preconditions (the caller's tables): every group's output has the row stride dD[0] =
// (ld, 1, 0) and the same N, and where ptr_D[g] - ptr_D[0] is a non-negative multiple of
// kRowStep * ld elements its rows are those rows of the matrix (a group anywhere else
// takes its own descriptor for every tile); no C (ElementC void); fusion callbacks that
// read no memory (alpha * acc: only warp 0, whose elected lane issues the stores, sees
// the moved coordinates).
//
// The kernel keeps the pointer store_init returned and calls tensormaps_perform_update
// on every group change, then tensormaps_cp_fence_release, and tensormaps_fence_acquire
// and store after the mainloop. Here perform_update only notes the group (and starts the
// load of its pointer, consumed after the mainloop), release and acquire do nothing,
// and store picks the descriptor (and writes the group's own where needed). Only warp 0
// of each consumer warp group gets a descriptor from store_init and calls perform_update;
// the others pass through.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace moe_fp8 {

template <class Base>
struct RowBlockStoreMaps : Base {
  using typename Base::Arguments;
  using typename Base::Params;
  using typename Base::TensorMapStorage;
  using ElementD = typename Base::ElementD;

  // The base's descriptors a CTA: one a consumer warp group (no C).
  static constexpr int kMaps = Base::NumEpilogueWarpGroups;
  static constexpr int kTileM = cute::size<0>(typename Base::CtaTileMNK{});
  static constexpr int kRowStep = 16;                   // the matrix descriptors' first rows, apart
  static constexpr int kResidues = kTileM / kRowStep;   // ... how many
  static constexpr int kSlots = 2 + kResidues;          // the group's two, the matrix's
  static constexpr int32_t kRows = 1 << 30;             // the matrix descriptors' row count
  static_assert(kTileM % kRowStep == 0, "RowBlockStoreMaps: the tile's rows in steps of kRowStep");
  static_assert(cute::is_void_v<typename Base::ElementC>, "RowBlockStoreMaps: an epilogue without C");
  static_assert(!cute::is_void_v<ElementD>, "RowBlockStoreMaps: the epilogue stores D");
  static_assert(Base::IsGroupedGemmKernel, "RowBlockStoreMaps: a grouped GEMM");

  CUTLASS_DEVICE RowBlockStoreMaps(Params const& params, typename Base::TensorStorage& shared_tensors)
      : Base(params, shared_tensors), params_(params) {}

  // The base's workspace, then kSlots - 1 more descriptors for every (SM, warp group): the
  // group descriptor's second slot and the matrix descriptors.
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const& problem_shape, Arguments const& args, int sm_count) {
    return Base::get_workspace_size(problem_shape, args, sm_count) +
           size_t(kSlots - 1) * size_t(sm_count) * kMaps * sizeof(cute::TmaDescriptor);
  }

  CUTLASS_DEVICE auto store_init(Params const& params, TensorMapStorage& shared_tensormaps, int32_t sm_count,
                                 int32_t sm_idx, int32_t warp_group_idx) {
    auto maps = Base::store_init(params, shared_tensormaps, sm_count, sm_idx, warp_group_idx);
    slot0_ = cute::get<0>(maps);
    slots_apart_ = sm_count * kMaps;  // past the base's (SMs, kMaps) descriptors
    shared_maps_ = &shared_tensormaps;
    warp_group_ = warp_group_idx;
    return maps;
  }

  template <bool IsLoad, class ProblemShapeMNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage& shared_tensormaps, Params const& params,
                                                cute::TmaDescriptor const* tensormap,
                                                ProblemShapeMNKL problem_shape_mnkl, int32_t next_batch,
                                                int32_t warp_group_idx) {
    if constexpr (IsLoad) {
      Base::template tensormaps_perform_update<IsLoad>(shared_tensormaps, params, tensormap, problem_shape_mnkl,
                                                       next_batch, warp_group_idx);
    } else {
      if (base_ == nullptr) write_matrix_maps(shared_tensormaps, params, problem_shape_mnkl, warp_group_idx);
      group_ = next_batch;
      group_ptr_ = params.ptr_D[next_batch];  // a load: first used after the mainloop
      placed_ = -1;
    }
  }

  template <bool IsLoad>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage& shared_tensormaps,
                                                  cute::TmaDescriptor const* tensormap,
                                                  const int32_t warp_group_idx = 0) {
    if constexpr (IsLoad) {
      Base::template tensormaps_cp_fence_release<IsLoad>(shared_tensormaps, tensormap, warp_group_idx);
    }
  }

  template <bool IsLoad>
  CUTLASS_DEVICE void tensormaps_fence_acquire(cute::TmaDescriptor const* tensormap) {
    if constexpr (IsLoad) {
      Base::template tensormaps_fence_acquire<IsLoad>(tensormap);
    }
  }

  template <class LoadPipeline, class LoadPipelineState, class StorePipeline, class StorePipelineState,
            class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma, class TensorMapD>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadPipelineState load_pipe_consumer_state,
                            StorePipeline store_pipeline, StorePipelineState store_pipe_producer_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, typename Base::TensorStorage& shared_tensors,
                            TensorMapD const& store_tensormap, int subtile_idx = -1) {
    auto shape = problem_shape_mnkl;
    auto coord = tile_coord_mnkl;
    TensorMapD map = store_tensormap;
    if (slot0_ != nullptr) {  // warp 0: the storing warp
      if (placed_ != group_) place_group();
      const int32_t rows = cute::get<0>(problem_shape_mnkl);
      const int32_t m = cute::get<0>(tile_coord_mnkl);
      const int32_t tile = (start_ >> 3) + m;  // (start_ / kResidues: the group's first M tile)
      if (start_ >= 0 && (m + 1) * kTileM <= rows && tile < kRows / kTileM) {  // a whole tile of the group
        map = slot(2 + (start_ & (kResidues - 1)));
        cute::get<0>(shape) = kRows + kTileM;
        cute::get<0>(coord) = tile;
      } else if (m * kTileM >= rows) {  // no row of the group: stored wholly out of bounds
        map = slot(2);
        cute::get<0>(shape) = kRows + kTileM;
        cute::get<0>(coord) = kRows / kTileM;
      } else {  // a partial tile, or a start off the row steps: the group's own descriptor
        if (loaded_ != group_) write_group_map(problem_shape_mnkl);
        if (unacquired_) {
          cute::tma_descriptor_fence_acquire(slot(current_));
          unacquired_ = false;
        }
        map = slot(current_);
      }
    }
    return Base::store(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state, shape,
                       tile_shape_MNK, coord, accumulators, tiled_mma, thread_idx, shared_tensors, map,
                       subtile_idx);
  }

 private:
  static_assert(kResidues == 8, "RowBlockStoreMaps: start_ packs the residue in 3 bits");

  // At the first group: the kResidues matrix descriptors (group 0's address moved down by
  // kRowStep * r rows, 2^30 rows), released back to back and acquired once, before the
  // first mainloop (whose first loads they overlap). Warp 0, converged.
  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE void write_matrix_maps(TensorMapStorage& shared_tensormaps, Params const& params,
                                        ProblemShapeMNKL problem_shape_mnkl, int32_t warp_group_idx) {
    auto matrix = problem_shape_mnkl;
    cute::get<0>(matrix) = kRows;
    Base::template tensormaps_perform_update<false>(shared_tensormaps, params, slot(2), matrix, 0, warp_group_idx);
    base_ = params.ptr_D[0];
    ld_ = static_cast<int32_t>(cute::get<0>(params.dD[0]));
    __syncwarp();
#pragma unroll 1
    for (int r = 0; r < kResidues; ++r) {
      if (r > 0) {
        if (cute::elect_one_sync()) {
          cute::tma_descriptor_replace_addr_in_shared_mem(shared_tensormaps.smem_tensormap_D[warp_group_idx],
                                                          base_ + int64_t(kRowStep) * r * ld_);
        }
        __syncwarp();
      }
      cute::tma_descriptor_cp_fence_release(slot(2 + r), shared_tensormaps.smem_tensormap_D[warp_group_idx]);
    }
#pragma unroll 1
    for (int r = 0; r < kResidues; ++r) cute::tma_descriptor_fence_acquire(slot(2 + r));
  }

  // The group's own descriptor into the slot not in use. That slot was last read by
  // stores issued before the latest per-group tile's, which committed at least one bulk
  // group since: all but the latest group done reading covers them. Warp 0, converged.
  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE void write_group_map(ProblemShapeMNKL problem_shape_mnkl) {
    Base::template tensormaps_perform_update<false>(*shared_maps_, params_, slot(current_), problem_shape_mnkl, group_,
                                                    warp_group_);
    __syncwarp();
    current_ ^= 1;
    if (cute::elect_one_sync()) cute::tma_store_wait<1>();  // all but the latest bulk group done reading
    cute::tma_descriptor_cp_fence_release(slot(current_), shared_maps_->smem_tensormap_D[warp_group_]);
    loaded_ = group_;
    unacquired_ = true;
  }

  // The group's first row in kRowStep steps (start_), or -1 where it is not a whole
  // number of them. Once a group, at its first store: the quotient of the group's offset
  // by kRowStep rows of the matrix, through a double (exact: the quotient is below 2^53
  // and the check multiplies back), not a 64-bit division.
  CUTLASS_DEVICE void place_group() {
    const int64_t offset = group_ptr_ - base_;  // elements from the matrix's first row
    const int64_t step = int64_t(kRowStep) * ld_;
    const int64_t q = __double2ll_rn(static_cast<double>(offset) / static_cast<double>(step));
    start_ = (offset >= 0 && q * step == offset && q < kRows / kRowStep) ? static_cast<int32_t>(q) : -1;
    placed_ = group_;
  }

  // Slot 0: the base's descriptor; 1: its alternate; 2 + r: matrix descriptor r.
  CUTLASS_DEVICE cute::TmaDescriptor* slot(int i) const { return slot0_ + i * slots_apart_; }

  Params const& params_;
  TensorMapStorage* shared_maps_ = nullptr;
  cute::TmaDescriptor* slot0_ = nullptr;
  int32_t slots_apart_ = 0;
  int32_t warp_group_ = 0;
  int32_t ld_ = 0;       // the matrix's row stride
  int32_t group_ = -1;   // the current tile's group
  int32_t loaded_ = -1;  // the group of the per-group descriptor in slot current_
  int32_t placed_ = -1;  // the group start_ belongs to
  int32_t start_ = -1;   // the group's first row / kRowStep, -1 where not whole
  int32_t current_ = 1;  // the slot of the per-group descriptor; the first update writes slot 0
  bool unacquired_ = false;  // slot current_ released, not yet acquired
  ElementD* base_ = nullptr;  // the matrix (group 0's address); null until the matrix maps are written
  ElementD* group_ptr_ = nullptr;
};

}  // namespace moe_fp8
