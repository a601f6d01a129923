// The Hopper (sm_90a) FP8 rowwise grouped GEMM kernels, shared by the op file (rowwise_grouped_sm90.cu: checks,
// tables, the pick) and the configuration files (rowwise_grouped_sm90_cfg*.cu, two configurations each, so that the
// CUTLASS instantiations compile in parallel).
#pragma once

// CuTe's device-side assert() is a call, and a call inside the mainloop makes ptxas
// serialize every WGMMA: release builds define NDEBUG; these files do in any build.
#ifndef NDEBUG
#define NDEBUG
#endif
#include <ATen/ATen.h>

#include <cstdint>

#include "../core/launch.h"

// CUTLASS 4.2's headers under C++20 and -Werror: its sm100 collectives (parsed, never
// instantiated here) capture `this` implicitly in lambdas (diagnostic 2908).
#pragma nv_diagnostic push
#pragma nv_diag_suppress 2908
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#pragma nv_diagnostic pop

// The CUTLASS kernels need nvcc 12.3+ (Hopper TMA descriptor updates on the device).
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED) && defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#define MOE_FP8_RW_GEMM_SM90 1
#else
#define MOE_FP8_RW_GEMM_SM90 0
#endif

namespace moe_fp8 {
namespace rowwise_gemm {

// Configuration names: Coop, both consumer warp groups on one tile; Pong, each on its own tile (the shape is one warp
// group's), one's epilogue overlapping the other's MMAs. MxN is the tile (K 128), Cmn the cluster (m CTAs along M
// share B by TMA multicast, n along N share A). The op's `config` is a place in MOE_FP8_RW_CONFIGS, from 0.
using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group
using StrideAB = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;  // K-major rows/columns
using StrideD = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;   // row-major

// The per-group arguments of one grouped GEMM, in one device buffer (written by a table
// kernel, read by the GEMM): the same for every configuration.
struct Tables {
  ProblemShape::UnderlyingProblemShape* shape;
  const ElementAB** a;
  const ElementAB** b;
  ElementD** d;
  const float** scale_a;  // per row of the group's A (M_g values)
  const float** scale_b;  // per column of the group's B (N values)
  StrideAB* stride_a;
  StrideAB* stride_b;
  StrideD* stride_d;
  bool raster_along_n = false;  // host only: the order of the tiles (run_config)
};

// One launcher per configuration, each defined in a configuration file
// (rowwise_grouped_sm90_cfg*.cu): runs it over `groups` groups whose tables are on the
// device.
#define MOE_FP8_RW_CONFIGS(X) \
  X(Coop128x128C21) X(Coop128x128C12) X(Coop128x256C21) X(Coop256x128C21) X(Pong128x128C21) X(Pong128x128C12)
#define MOE_FP8_RW_DECLARE(name) \
  void run_##name(const Tables& t, int groups, int sm_count, const at::Tensor& like, const GpuLaunch& gpu, const char* op);
MOE_FP8_RW_CONFIGS(MOE_FP8_RW_DECLARE)
#undef MOE_FP8_RW_DECLARE
// The wgrad added into an fp32 out in place (the tables' d, reinterpreted as fp32): cooperative 128x256, 2x1 cluster.
void run_AddCoop128x256C21(const Tables& t, int groups, int sm_count, const at::Tensor& like, const GpuLaunch& gpu,
                           const char* op);

#if MOE_FP8_RW_GEMM_SM90

// out + product as one IEEE fp32 add: __fadd_rn keeps nvcc from contracting it with the scale multiply before it into
// an FMA (which rounds once, not twice, and would differ from the bf16 op's product plus out).
template <class T>
struct AddRn {
  CUTLASS_DEVICE T operator()(T const& x, T const& y) const {
    T r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < int(T::kElements); ++i) r[i] = __fadd_rn(x[i], y[i]);
    return r;
  }
};

// One kernel type a configuration: CUTLASS's pointer-array grouped "TN" e4m3 GEMM, fast accumulation (as
// torch._scaled_grouped_mm), D = bf16((acc * scale_a[m]) * scale_b[n]) with per-group scale pointers, torch's order.
// kAdd: D = C + (acc * scale_a[m]) * scale_b[n] in fp32, C the same memory as D (the wgrad into a main gradient).
template <class TileShape_, class ClusterShape_, bool kPingpong,
          class EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto, bool kAdd = false>
struct Gemm {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using LayoutA = cutlass::layout::RowMajor;     // K-major
  using LayoutB = cutlass::layout::ColumnMajor;  // K-major
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr bool kAccumulate = kAdd;
  using Out = std::conditional_t<kAdd, float, ElementD>;
  using ElementC = std::conditional_t<kAdd, float, void>;
  static constexpr int kAlignAB = 16;  // elements: 16 bytes, TMA
  static constexpr int kAlignD = 16 / static_cast<int>(sizeof(Out));

  using MainloopSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

  // D = bf16((acc * scale_a[m]) * scale_b[n]); the scales are arrays of per-group pointers.
  using ScaleA = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float*, float,
                                                             cute::Stride<cute::_1, cute::_0, cute::_0>>;
  using ScaleB = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float*, float,
                                                             cute::Stride<cute::_0, cute::_1, cute::_0>>;
  using Mul = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                                      cutlass::FloatRoundStyle::round_to_nearest>;
  using Cast = cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, Out, float,
                                                       cutlass::FloatRoundStyle::round_to_nearest>;
  using Scaled = cutlass::epilogue::fusion::Sm90EVT<
      Mul, ScaleB, cutlass::epilogue::fusion::Sm90EVT<Mul, ScaleA, cutlass::epilogue::fusion::Sm90AccFetch>>;
  using Plus = cutlass::epilogue::fusion::Sm90Compute<AddRn, float, float,
                                                       cutlass::FloatRoundStyle::round_to_nearest>;
  using Evt = cutlass::epilogue::fusion::Sm90EVT<
      Cast, std::conditional_t<kAdd,
                               cutlass::epilogue::fusion::Sm90EVT<Plus, cutlass::epilogue::fusion::Sm90SrcFetch<float>,
                                                                  Scaled>,
                               Scaled>>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      EpilogueTile, float, float, ElementC, LayoutD*, kAlignD, Out, LayoutD*,
      kAlignD, EpilogueSchedule, Evt>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignAB, ElementAB, LayoutB*,
      kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(std::is_same_v<StrideAB, typename Kernel::InternalStrideA>);
  static_assert(std::is_same_v<StrideAB, typename Kernel::InternalStrideB>);
  static_assert(std::is_same_v<StrideD, typename Kernel::InternalStrideD>);
};

template <class G>
void run_config(const Tables& t, int groups, int sm_count, const at::Tensor& like, const GpuLaunch& gpu,
                const char* op) {
  using Adapter = typename G::Adapter;
  typename Adapter::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  // Problem shapes on the device only (host pointer null): nothing to sync; the
  // persistent grid is one CTA per SM and the scheduler walks the groups' tiles.
  args.problem_shape = {groups, t.shape, nullptr};
  args.mainloop.ptr_A = t.a;
  args.mainloop.dA = t.stride_a;
  args.mainloop.ptr_B = t.b;
  args.mainloop.dB = t.stride_b;
  // The tree's arguments, children first: Cast(Mul(ScaleB, Mul(ScaleA, acc))), or Cast(Plus(C, that)).
  if constexpr (G::kAccumulate) {
    args.epilogue.thread = {{{}, {{t.scale_b}, {{t.scale_a}, {}, {}}, {}}, {}}, {}};
    args.epilogue.ptr_C = const_cast<const float**>(reinterpret_cast<float**>(t.d));
    args.epilogue.dC = t.stride_d;
    args.epilogue.ptr_D = reinterpret_cast<float**>(t.d);
  } else {
    args.epilogue.thread = {{{t.scale_b}, {{t.scale_a}, {}, {}}, {}}, {}};
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = t.d;
  }
  args.epilogue.dD = t.stride_d;
  // Along N the CTAs in flight cover whole M tile rows, so each A tile is read once (along M, the default, once per N
  // tile: from DRAM once a group's A outgrows L2); picked in rowwise_grouped_mm_2d3d. No swizzle: with device-only
  // problem shapes it is always 1.
  if (t.raster_along_n) args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;
  args.hw_info.device_id = gpu.device();
  args.hw_info.sm_count = sm_count;

  Adapter gemm;
  TORCH_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess, op,
              ": expected arguments the CUTLASS grouped GEMM can implement, got a refusal from can_implement");
  const size_t ws_bytes = Adapter::get_workspace_size(args);
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(ws_bytes > 0 ? ws_bytes : 1)}, like.options().dtype(at::kByte));
  cutlass::Status st = gemm.initialize(args, workspace.data_ptr(), gpu.stream());
  TORCH_CHECK(st == cutlass::Status::kSuccess, op, ": CUTLASS initialize failed: ", cutlassGetStatusString(st));
  st = gemm.run(gpu.stream());
  TORCH_CHECK(st == cutlass::Status::kSuccess, op, ": CUTLASS run failed: ", cutlassGetStatusString(st));
  gpu.check(static_cast<int>(cudaGetLastError()), op);
}

using cute::_1;
using cute::_2;
using cute::_128;
using cute::_256;
using Coop128x128C21 = Gemm<cute::Shape<_128, _128, _128>, cute::Shape<_2, _1, _1>, false>;
using Coop128x128C12 = Gemm<cute::Shape<_128, _128, _128>, cute::Shape<_1, _2, _1>, false>;
// The picked cooperative configuration stores 128x64 epilogue tiles, not CUTLASS's automatic 128x32: half the
// named-barrier rounds and shared-memory fences a tile (record 013). Pingpong keeps CUTLASS's tile.
using Coop128x256C21 = Gemm<cute::Shape<_128, _256, _128>, cute::Shape<_2, _1, _1>, false, cute::Shape<cute::_128, cute::_64>>;
using AddCoop128x256C21 = Gemm<cute::Shape<_128, _256, _128>, cute::Shape<_2, _1, _1>, false,
                               cute::Shape<cute::_128, cute::_32>, true>;  // (128-byte fp32 epilogue rows)
using Coop256x128C21 = Gemm<cute::Shape<_256, _128, _128>, cute::Shape<_2, _1, _1>, false>;
using Pong128x128C21 = Gemm<cute::Shape<_128, _128, _128>, cute::Shape<_2, _1, _1>, true>;
using Pong128x128C12 = Gemm<cute::Shape<_128, _128, _128>, cute::Shape<_1, _2, _1>, true>;

#endif  // MOE_FP8_RW_GEMM_SM90

}  // namespace rowwise_gemm
}  // namespace moe_fp8
