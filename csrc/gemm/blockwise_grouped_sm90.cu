// FP8 blockwise grouped GEMMs (DESIGN §6), Hopper sm_90a only: CUTLASS's pointer-array grouped GEMM, each
// 128-deep K block's fp32 partial promoted and scaled on the CUDA cores. The per-group tables are built on the
// device from `offs` by one small kernel: no host sync, so the ops are CUDA-graph capturable.

// CuTe's device-side assert() is a call (__assertfail), and a call inside the mainloop
// makes ptxas serialize every WGMMA ("wgmma pipeline crossing function boundary"): a
// large slowdown. Release builds define NDEBUG; this file does in any build.
#ifndef NDEBUG
#define NDEBUG
#endif
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../core/groups.h"
#include "../core/launch.h"
#include "../core/op_checks.h"

// CUTLASS 4.2's headers under C++20 and -Werror: its sm100 collectives (parsed, never
// instantiated here) capture `this` implicitly in lambdas (diagnostic 2908).
#pragma nv_diagnostic push
#pragma nv_diag_suppress 2908
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#pragma nv_diagnostic pop

#include "grouped_gemm_common.h"
#include "pipelined_promotion.cuh"
#include "scale_layouts_from_args.cuh"
#include "store_warp_epilogue.cuh"
#include "dswiglu_epilogue.cuh"
#include "swiglu_epilogue.cuh"

// The CUTLASS kernels need nvcc 12.3+ (Hopper TMA descriptor updates on the device).
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED) && defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#define MOE_FP8_BW_GEMM_SM90 1
#else
#define MOE_FP8_BW_GEMM_SM90 0
#endif

namespace moe_fp8 {
namespace {

constexpr int64_t kBlock = 128;  // the recipe's block: 1x128 activations, 128x128 weights
constexpr int64_t kConfigs2d3d = 4, kConfigs2d2d = 4;  // the GEMM configurations (below)
constexpr int64_t kConfigs2d2dAdd = 2;  // the fused accumulation's: WgradAdd12, WgradAdd21

using namespace gemm_common;  // NOLINT: the shared checks and helpers

#if MOE_FP8_BW_GEMM_SM90

using namespace cute;

// ---- the GEMM types ---------------------------------------------------------------------
// A CollectiveMma with another TiledMma (the rest of the builder's choices kept).
template <class, class>
struct WithTiledMma;
template <class DP, class TS, class EA, class SA, class EB, class SB, class TM, class GA, class LA, class CA, class TA,
          class GB, class LB, class CB, class TB, class New>
struct WithTiledMma<cutlass::gemm::collective::CollectiveMma<DP, TS, EA, SA, EB, SB, TM, GA, LA, CA, TA, GB, LB, CB, TB>,
                    New> {
  using type = cutlass::gemm::collective::CollectiveMma<DP, TS, EA, SA, EB, SB, New, GA, LA, CA, TA, GB, LB, CB, TB>;
};

// kWgrad: scale granularity 1 on both sides (2d2d), else (1, 128) on A and (128, 128) on B. Cooperative kernel (both
// consumer warp groups on one tile, split along M). kEpi: plain D, the W13 SwiGLU or the W2 dgrad dSwiGLU epilogue, or
// kAccumulate: fp32 D = acc + D by CUTLASS's epilogue reading D as its C (the wgrad into a main gradient in place).
enum class Epi { kPlain, kSwiglu, kDswiglu, kAccumulate };
template <class TileShape_, class ClusterShape_, bool kWgrad, class EpilogueTile, Epi kEpi = Epi::kPlain>
struct BlockwiseGemm {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  static constexpr bool kAccumulate = kEpi == Epi::kAccumulate;
  using ElementD = std::conditional_t<kAccumulate, float, cutlass::bfloat16_t>;
  using ElementC = std::conditional_t<kAccumulate, float, void>;
  using LayoutA = cutlass::layout::RowMajor;     // K-major
  using LayoutB = cutlass::layout::ColumnMajor;  // K-major
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16;  // elements: 16 bytes, TMA
  static constexpr int kAlignD = 16 / static_cast<int>(sizeof(ElementD));

  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
      /*M*/ 1, /*N*/ kWgrad ? 1 : int(kBlock), /*K*/ int(kBlock), cute::GMMA::Major::MN,
      kWgrad ? cute::GMMA::Major::MN : cute::GMMA::Major::K>;
  using ScaleLayoutA = decltype(ScaleConfig::deduce_layoutSFA());
  using ScaleLayoutB = decltype(ScaleConfig::deduce_layoutSFB());

  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

  using BuiltEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      EpilogueTile, float, float, ElementC, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;
  // One D stage per subtile: the store warp takes the whole tile at once.
  using CutlassEpilogue = typename WithStagesD<
      BuiltEpilogue, (cute::size<0>(TileShape{}) / cute::size<0>(EpilogueTile{})) *
                         (cute::size<1>(TileShape{}) / cute::size<1>(EpilogueTile{}))>::type;
  // The TMA stores issued by the producer warp group's spare warp, not by the consumers
  // (store_warp_epilogue.cuh).
  using Epilogue = std::conditional_t<
      kAccumulate, BuiltEpilogue,
      std::conditional_t<kEpi == Epi::kSwiglu, SwigluEpilogue<CutlassEpilogue>,
                         std::conditional_t<kEpi == Epi::kDswiglu, DswigluEpilogue<CutlassEpilogue>,
                                            StoreWarpEpilogue<CutlassEpilogue>>>>;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, ScaleLayoutA*>, kAlignAB,
      ElementB, cute::tuple<LayoutB*, ScaleLayoutB*>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  // Tiles wider than 128: 64x128 GMMA atoms (the builder picks 64x256), so that one
  // atom's accumulators are the partial of SequencedPromotion.
  using CutlassMainloop = std::conditional_t<
      (cute::size<1>(TileShape{}) > 128),
      typename WithTiledMma<BuiltMainloop,
                            decltype(cute::make_tiled_mma(
                                cute::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>{}, Layout<Shape<_2, _1, _1>>{}))>::type,
      BuiltMainloop>;
  // 256x128 and 128x256 tiles: the total takes 128 registers a thread, so one 64x128 partial (SequencedPromotion).
  using Mainloop = std::conditional_t<(cute::size<0>(TileShape{}) > 128 || cute::size<1>(TileShape{}) > 128),
                                      SequencedPromotion<ScaleLayoutsFromArgs<CutlassMainloop>>,
                                      PipelinedPromotion<ScaleLayoutsFromArgs<CutlassMainloop>>>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  static_assert(std::is_same_v<ScaleLayoutA, typename CutlassMainloop::InternalLayoutSFA>);
  static_assert(std::is_same_v<ScaleLayoutB, typename CutlassMainloop::InternalLayoutSFB>);
};

// The per-group arguments of one grouped GEMM, in one device buffer (written by the
// table kernel, read by the GEMM).
template <class G>
struct GroupTables {
  typename G::ProblemShape::UnderlyingProblemShape* shape;
  const typename G::ElementA** a;
  const typename G::ElementB** b;
  const float** sfa;
  const float** sfb;
  typename G::ElementD** d;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;
  typename G::ScaleLayoutA* layout_sfa;
  typename G::ScaleLayoutB* layout_sfb;
};

// Carve the tables of `groups` groups out of one byte tensor (16-byte aligned arrays).
template <class G>
GroupTables<G> carve_tables(at::Tensor& storage, int64_t groups, const at::TensorOptions& opts) {
  auto bytes = [&](int64_t each) { return round_up(each * std::max<int64_t>(groups, 1), 16); };
  GroupTables<G> t;
  const int64_t sizes[] = {
      bytes(sizeof(*t.shape)),    bytes(sizeof(*t.a)),        bytes(sizeof(*t.b)),         bytes(sizeof(*t.sfa)),
      bytes(sizeof(*t.sfb)),      bytes(sizeof(*t.d)),        bytes(sizeof(*t.stride_a)),  bytes(sizeof(*t.stride_b)),
      bytes(sizeof(*t.stride_d)), bytes(sizeof(*t.layout_sfa)), bytes(sizeof(*t.layout_sfb))};
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  storage = at::empty({total}, opts.dtype(at::kByte));
  char* p = static_cast<char*>(storage.data_ptr());
  auto take = [&](auto*& field, int i) {
    field = reinterpret_cast<std::remove_reference_t<decltype(field)>>(p);
    p += sizes[i];
  };
  take(t.shape, 0);
  take(t.a, 1);
  take(t.b, 2);
  take(t.sfa, 3);
  take(t.sfb, 4);
  take(t.d, 5);
  take(t.stride_a, 6);
  take(t.stride_b, 7);
  take(t.stride_d, 8);
  take(t.layout_sfa, 9);
  take(t.layout_sfb, 10);
  return t;
}

// ---- 2d3d tables: group g is rows [s, e) of a and out, expert g of b ----------------------
struct Args2d3d {
  const uint8_t* a;       // [M, K] row-major (row stride lda)
  const float* scale_a;   // [M, ceil(K/128)] column-major (column stride lds)
  const uint8_t* b;       // [E, K, N] per expert column-major (column stride ldb, expert stride sbe)
  const float* scale_b;   // [E, ceil(K/128), ceil(N/128)] per expert column-major (snb, sse)
  const int32_t* offs;    // [E] group ends
  void* out;              // [M, N] row-major bf16
  int64_t M, N, K, lda, lds, ldb, sbe, snb, sse;
  int groups;
};

// GEMM (M_g, N, K), "TN" (A and B K-major, as FP8 WGMMA reads): A = a rows, B = b[g]; SFA (1, 128) MN-major with
// the column stride of all M rows (hence ScaleLayoutsFromArgs), SFB (128, 128) K-major. group_range clamps every
// group into [0, M], so bad offs never reach memory out of bounds (MOE_FP8_DEBUG=1 checks them on the host).
template <class G>
__global__ void build_tables_2d3d(GroupTables<G> t, Args2d3d p) {
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  const int kb = static_cast<int>(ceil_div(p.K, kBlock)), nb = static_cast<int>(ceil_div(p.N, kBlock));
  if (thread < p.groups) {
    const int g = static_cast<int>(thread);
    int64_t s, e;
    group_range(p.offs, g, p.M, &s, &e);
    const int mg = static_cast<int>(e - s);
    t.shape[g] = {mg, static_cast<int>(p.N), static_cast<int>(p.K)};
    t.a[g] = reinterpret_cast<const typename G::ElementA*>(p.a + s * p.lda);
    t.b[g] = reinterpret_cast<const typename G::ElementB*>(p.b + g * p.sbe);
    t.sfa[g] = p.scale_a + s;  // row s of the column-major scales
    t.sfb[g] = p.scale_b + g * p.sse;
    t.d[g] = p.out != nullptr ? static_cast<typename G::ElementD*>(p.out) + s * p.N : nullptr;
    t.stride_a[g] = cute::make_stride(p.lda, Int<1>{}, Int<0>{});
    t.stride_b[g] = cute::make_stride(p.ldb, Int<1>{}, Int<0>{});
    t.stride_d[g] = cute::make_stride(p.N, Int<1>{}, Int<0>{});
    // (m, k) -> m + kb * lds: the column stride of all M rows, not M_g.
    t.layout_sfa[g] = make_layout(make_shape(make_shape(Int<1>{}, mg), make_shape(Int<kBlock>{}, kb), 1),
                                  make_stride(make_stride(Int<0>{}, Int<1>{}),
                                              make_stride(Int<0>{}, static_cast<int>(p.lds)), 0));
    // (n, k) -> nb * snb + kb (K-major 128x128 tiles).
    t.layout_sfb[g] = make_layout(make_shape(make_shape(Int<kBlock>{}, nb), make_shape(Int<kBlock>{}, kb), 1),
                                  make_stride(make_stride(Int<0>{}, static_cast<int>(p.snb)),
                                              make_stride(Int<0>{}, Int<1>{}), 0));
  }
  // Rows past the last group belong to no group: zeros (never uninitialized memory). No out: an epilogue that writes
  // no D (dSwiGLU).
  const int64_t tail = p.groups > 0 ? clamp_offset(p.offs[p.groups - 1], p.M) : 0;
  if (p.out != nullptr) zero_bf16(p.out, tail * p.N, p.M * p.N, thread, threads);
}

// ---- 2d2d tables: group g is tokens [s, e), a multiple of 128 at its start -----------------
struct Args2d2d {
  const uint8_t* a;       // [N, M] row-major (row stride lda)
  const float* scale_a;   // [N, ceil(M/128)] column-major (column stride lds)
  const uint8_t* b;       // [M, K] column-major (column stride ldb)
  const float* scale_b;   // [ceil(M/128), K] row-major (row stride sbr)
  const int32_t* offs;    // [E] group ends
  void* out;              // [E, N, K] row-major bf16, or fp32 added to (accumulate)
  int64_t M, N, K, lda, lds, ldb, sbr;
  int groups;
  int blocks_per_group;
  bool accumulate;  // out += the product: an empty group leaves its output as it is
};

// GEMM (N, K, T_g), "TN": A = a[:, tokens of g] (row-major (N, M)), B = b[tokens of g, :] (column-major (M, K));
// SFA and SFB granularity (1, 128) MN-major. Empty groups' outputs are zeroed here (left as they are when
// accumulating).
template <class G>
__global__ void build_tables_2d2d(GroupTables<G> t, Args2d2d p) {
  const int g = static_cast<int>(blockIdx.x / p.blocks_per_group);
  const int x = static_cast<int>(blockIdx.x % p.blocks_per_group);
  if (g >= p.groups) return;
  int64_t s, e;
  group_range(p.offs, g, p.M, &s, &e);
  // A group that does not start at a multiple of 128 has no blocks of its own (bad
  // offs): empty, like a group with no tokens, so no misaligned address is formed.
  const bool live = e > s && s % kBlock == 0;
  const int64_t sb = s / kBlock;
  if (x == 0 && threadIdx.x == 0) {
    const int tg = live ? static_cast<int>(e - s) : 0;
    const int kb = static_cast<int>(ceil_div(tg, kBlock));
    // An empty group gets no tiles (M = 0); its output is zeroed below.
    t.shape[g] = {live ? static_cast<int>(p.N) : 0, static_cast<int>(p.K), tg};
    t.a[g] = reinterpret_cast<const typename G::ElementA*>(p.a + (live ? s : 0));
    t.b[g] = reinterpret_cast<const typename G::ElementB*>(p.b + (live ? s : 0));
    t.sfa[g] = p.scale_a + (live ? sb * p.lds : 0);
    t.sfb[g] = p.scale_b + (live ? sb * p.sbr : 0);
    t.d[g] = static_cast<typename G::ElementD*>(p.out) + g * p.N * p.K;
    t.stride_a[g] = cute::make_stride(p.lda, Int<1>{}, Int<0>{});
    t.stride_b[g] = cute::make_stride(p.ldb, Int<1>{}, Int<0>{});
    t.stride_d[g] = cute::make_stride(p.K, Int<1>{}, Int<0>{});
    // (n, token block) -> n + kb * lds and (k, token block) -> k + kb * sbr.
    t.layout_sfa[g] = make_layout(make_shape(make_shape(Int<1>{}, static_cast<int>(p.N)), make_shape(Int<kBlock>{}, kb), 1),
                                  make_stride(make_stride(Int<0>{}, Int<1>{}),
                                              make_stride(Int<0>{}, static_cast<int>(p.lds)), 0));
    t.layout_sfb[g] = make_layout(make_shape(make_shape(Int<1>{}, static_cast<int>(p.K)), make_shape(Int<kBlock>{}, kb), 1),
                                  make_stride(make_stride(Int<0>{}, Int<1>{}),
                                              make_stride(Int<0>{}, static_cast<int>(p.sbr)), 0));
  }
  if (!live && !p.accumulate) {
    const int64_t per_group = p.N * p.K;
    zero_bf16(p.out, g * per_group, (g + 1) * per_group, int64_t(x) * blockDim.x + threadIdx.x,
              int64_t(p.blocks_per_group) * blockDim.x);
  }
}

// ---- running one grouped GEMM -----------------------------------------------------------

// fused: what a fused epilogue reads and writes (SwigluQuantOut, DswigluQuantOut), for G's epilogue.
template <class G, class Fused = SwigluQuantOut>
void run_gemm(const GroupTables<G>& t, int groups, bool raster_along_n, const at::Tensor& like, const GpuLaunch& gpu,
              const char* op, const Fused* fused = nullptr) {
  using Gemm = typename G::Gemm;
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  // Problem shapes on the device only (host pointer null): nothing to sync; the
  // persistent grid is one CTA per SM and the scheduler walks the groups' tiles.
  args.problem_shape = {groups, t.shape, nullptr};
  args.mainloop.ptr_A = t.a;
  args.mainloop.dA = t.stride_a;
  args.mainloop.ptr_B = t.b;
  args.mainloop.dB = t.stride_b;
  args.mainloop.ptr_SFA = t.sfa;
  args.mainloop.layout_SFA = t.layout_sfa;
  args.mainloop.ptr_SFB = t.sfb;
  args.mainloop.layout_SFB = t.layout_sfb;
  args.epilogue.thread.alpha = 1.0f;
  if constexpr (G::kAccumulate) {  // D += acc: D is the source too (each tile read before it is written)
    args.epilogue.thread.beta = 1.0f;
    args.epilogue.ptr_C = const_cast<const float**>(t.d);
    args.epilogue.dC = t.stride_d;
  } else {
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
  }
  args.epilogue.ptr_D = t.d;
  args.epilogue.dD = t.stride_d;
  if constexpr (requires { args.epilogue.fused; }) args.epilogue.fused = *fused;
  // 2d3d rasters along N: the CTAs in flight cover whole M tile rows, so A is read once and the expert's weight
  // stays in L2 (record 009); 2d2d keeps the default. No swizzle: with device-only problem shapes the grouped
  // scheduler uses 1 whatever it is asked.
  if (raster_along_n) args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;
  args.hw_info.device_id = gpu.device();
  args.hw_info.sm_count = sm_count(gpu.device());

  Gemm gemm;
  TORCH_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess, op,
              ": expected arguments the CUTLASS grouped GEMM can implement, got a refusal from can_implement");
  const size_t ws_bytes = Gemm::get_workspace_size(args);
  at::Tensor workspace = at::empty({static_cast<int64_t>(std::max<size_t>(ws_bytes, 1))}, like.options().dtype(at::kByte));
  cutlass::Status st = gemm.initialize(args, workspace.data_ptr(), gpu.stream());
  TORCH_CHECK(st == cutlass::Status::kSuccess, op, ": CUTLASS initialize failed: ", cutlassGetStatusString(st));
  st = gemm.run(gpu.stream());
  TORCH_CHECK(st == cutlass::Status::kSuccess, op, ": CUTLASS run failed: ", cutlassGetStatusString(st));
  gpu.check(static_cast<int>(cudaGetLastError()), op);
}

// The configurations (the op's `config`), all cooperative, 128-deep k tiles, bit-equal outputs (the same 64x128
// GMMAs promoted in the same order). A cluster's two CTAs share one operand tile by TMA multicast (1x2: A across
// two N tiles, 2x1: B across two M tiles); the scheduler rounds every group's tile grid up to the cluster.
using EpiTile = Shape<_128, _64>;  // store-warp subtiles, 128-byte swizzled bf16 rows (records 013, 017)
using FwdCluster21 = BlockwiseGemm<Shape<_128, _128, _128>, Shape<_2, _1, _1>, false, EpiTile>;  // 2d3d 0
using FwdCluster12 = BlockwiseGemm<Shape<_128, _128, _128>, Shape<_1, _2, _1>, false, EpiTile>;  // 2d3d 1
using WgradCluster12 = BlockwiseGemm<Shape<_128, _128, _128>, Shape<_1, _2, _1>, true, EpiTile>;  // 2d2d 0
using WgradCluster21 = BlockwiseGemm<Shape<_128, _128, _128>, Shape<_2, _1, _1>, true, EpiTile>;  // 2d2d 1
using FwdTall12 = BlockwiseGemm<Shape<_256, _128, _128>, Shape<_1, _2, _1>, false, EpiTile>;  // 2d3d 2
using WgradTall12 = BlockwiseGemm<Shape<_256, _128, _128>, Shape<_1, _2, _1>, true, EpiTile>;  // 2d2d 2
using WgradWide12 = BlockwiseGemm<Shape<_128, _256, _128>, Shape<_1, _2, _1>, true, EpiTile>;  // 2d2d 3
using FwdWide12 = BlockwiseGemm<Shape<_128, _256, _128>, Shape<_1, _2, _1>, false, EpiTile>;  // 2d3d 3
using FwdSwiglu12 = BlockwiseGemm<Shape<_128, _256, _128>, Shape<_1, _2, _1>, false, EpiTile, Epi::kSwiglu>;  // W13
using FwdSwiglu11 = BlockwiseGemm<Shape<_128, _256, _128>, Shape<_1, _1, _1>, false, EpiTile, Epi::kSwiglu>;  // odd N
using DgradDswiglu12 = BlockwiseGemm<Shape<_128, _128, _128>, Shape<_1, _2, _1>, false, EpiTile, Epi::kDswiglu>;  // W2
using DgradDswiglu21 = BlockwiseGemm<Shape<_128, _128, _128>, Shape<_2, _1, _1>, false, EpiTile, Epi::kDswiglu>;
// D += acc in fp32 (wgrad into a main gradient): CUTLASS's epilogue, 128x32 fp32 subtiles (128-byte rows).
using WgradAdd12 = BlockwiseGemm<Shape<_128, _128, _128>, Shape<_1, _2, _1>, true, Shape<_128, _32>, Epi::kAccumulate>;
using WgradAdd21 = BlockwiseGemm<Shape<_128, _128, _128>, Shape<_2, _1, _1>, true, Shape<_128, _32>, Epi::kAccumulate>;

// The picks by shape (host values only: no sync; records 007, 020, 035). Big tiles move a quarter fewer bytes a
// FLOP; pingpong 64x128x128 is not used (record 030).
int64_t pick_2d3d(int64_t M, int64_t N, int64_t E) {
  if (M >= 256 * E && ceil_div(N, 2 * kBlock) % 2 == 0) return 3;  // 128x256 where its 1x2 clusters fill N
  if (M >= 256 * E) return 2;                       // 256x128 from 256 rows a group (a tile wastes up to 255)
  return ceil_div(N, kBlock) % 2 == 1 ? 0 : 1;      // 128x128: 2x1 for an odd number of N tiles (record 007)
}
int64_t pick_2d2d(int64_t M, int64_t N, int64_t K, int64_t E) {
  if (M <= 4096 * E && N % 256 == 0) return 2;     // 256x128; over longer k loops 128x128's own overlap wins
  if (M <= 4096 * E && K % 256 == 0) return 3;     // 128x256
  return ceil_div(K, kBlock) % 2 == 1 && ceil_div(N, kBlock) % 2 == 0 ? 1 : 0;  // 128x128 (record 007)
}

template <class G, class Fused = SwigluQuantOut>
void launch_2d3d(const Args2d3d& p, const at::Tensor& like, const GpuLaunch& gpu, const char* op,
                 const Fused* fused = nullptr) {
  at::Tensor storage;
  const auto tables = carve_tables<G>(storage, p.groups, like.options());
  constexpr int kThreads = 256;
  // Enough threads for the tables, and up to two blocks an SM for the zero tail.
  const int64_t blocks = std::max<int64_t>(ceil_div(p.groups, kThreads),
                                           std::min<int64_t>(ceil_div(p.M * p.N / 8, kThreads), 2 * sm_count(gpu.device())));
  build_tables_2d3d<G><<<static_cast<unsigned>(blocks), kThreads, 0, gpu.stream()>>>(tables, p);
  gpu.check(static_cast<int>(cudaGetLastError()), op);
  run_gemm<G>(tables, p.groups, /*raster_along_n=*/true, like, gpu, op, fused);
}

template <class G>
void launch_2d2d(Args2d2d p, const at::Tensor& like, const GpuLaunch& gpu, const char* op) {
  at::Tensor storage;
  const auto tables = carve_tables<G>(storage, p.groups, like.options());
  constexpr int kThreads = 256;
  // Blocks per group: enough to zero an empty group's (N, K) quickly; the blocks of the
  // live groups return at once (one of them writes the group's tables).
  p.blocks_per_group = static_cast<int>(std::min<int64_t>(ceil_div(p.N * p.K / 8, kThreads), 16));
  const int64_t blocks = int64_t(p.groups) * p.blocks_per_group;
  TORCH_CHECK(blocks <= kInt32Max, op, ": expected at most ", kInt32Max / 16, " groups, got ", p.groups);
  build_tables_2d2d<G><<<static_cast<unsigned>(blocks), kThreads, 0, gpu.stream()>>>(tables, p);
  gpu.check(static_cast<int>(cudaGetLastError()), op);
  run_gemm<G>(tables, p.groups, /*raster_along_n=*/false, like, gpu, op);
}

// What no (d)SwiGLU GEMM tile writes: the silu table it reads (where it reads one); rows past the last group (zero
// values: zero codes, amax 0's scale, as quantize_blockwise_act_dual writes them); the padded layout's tail (zero
// codes, scales zeroed at allocation). o.hidden: the operands' columns.
__global__ void swiglu_outputs_init(SwigluQuantOut o, int groups) {
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  uint16_t* table = const_cast<uint16_t*>(o.silu_table);
  for (int64_t i = thread; table != nullptr && i < kSiluTableEntries; i += threads) {
    table[i] = silu_table_entry(static_cast<int>(i));
  }
  int64_t tail = 0, q_tail = 0;
  if (groups > 0) {
    int64_t s, e;
    group_range(o.offs, groups - 1, o.rows, &s, &e);
    tail = e;
    q_tail = clamp_offset(static_cast<int64_t>(o.padded_starts[groups - 1]) + round_up(e - s, kBlock), o.q_rows_total);
  }
  const float s0 = Fp32Exact::from_amax_bits<Fp8Format::kE4M3FN>(0u).stored;
  const int64_t blocks = o.hidden / kBlock, tail_rows = o.rows - tail;
  for (int64_t i = thread; i < tail_rows * o.hidden; i += threads) o.q_rows[tail * o.hidden + i] = 0;
  for (int64_t i = thread; i < tail_rows * blocks; i += threads) {
    o.s_rows[(i / tail_rows) * o.rows + tail + i % tail_rows] = s0;
  }
  const int64_t q_tail_rows = o.q_rows_total - q_tail;
  for (int64_t i = thread; i < q_tail_rows * o.hidden; i += threads) {
    o.q_cols[(i / q_tail_rows) * o.q_rows_total + q_tail + i % q_tail_rows] = 0;
  }
}

#endif  // MOE_FP8_BW_GEMM_SM90

// ---- the ops -----------------------------------------------------------------------------

void check_hopper(const at::Tensor& a, const char* op) { gemm_common::check_hopper(a, op, MOE_FP8_BW_GEMM_SM90); }

void check_common(const char* op, const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                  const at::Tensor& scale_b, const at::Tensor& offs, int64_t b_rank, at::ScalarType out_dtype,
                  int64_t config, int64_t configs) {
  check_rank(a, 2, op, "a");
  check_rank(scale_a, 2, op, "scale_a");
  check_rank(b, b_rank, op, "b");
  check_rank(scale_b, b_rank, op, "scale_b");
  TORCH_CHECK(a.scalar_type() == at::kFloat8_e4m3fn, op, ": expected a of dtype float8_e4m3fn, got ", a.scalar_type());
  TORCH_CHECK(b.scalar_type() == at::kFloat8_e4m3fn, op, ": expected b of dtype float8_e4m3fn, got ", b.scalar_type());
  TORCH_CHECK(scale_a.scalar_type() == at::kFloat, op, ": expected scale_a of dtype float32, got ",
              scale_a.scalar_type());
  TORCH_CHECK(scale_b.scalar_type() == at::kFloat, op, ": expected scale_b of dtype float32, got ",
              scale_b.scalar_type());
  TORCH_CHECK(offs.scalar_type() == at::kInt, op, ": expected offs of dtype int32, got ", offs.scalar_type());
  check_rank(offs, 1, op, "offs");
  check_same_device(op, {"a", a}, {{"scale_a", scale_a}, {"b", b}, {"scale_b", scale_b}, {"offs", offs}});
  check_groups(offs, op);
  TORCH_CHECK(out_dtype == at::kBFloat16, op, ": expected out_dtype bfloat16, got ", out_dtype);
  TORCH_CHECK(config >= -1 && config < configs, op, ": expected config -1 (the pick by shape) or in [0, ", configs,
              "), got ", config);
}

void check_int32(const char* op, const char* what, int64_t v) { check_fits_int32(v, op, what); }

// The shapes and strides of a 2d3d call, checked (blockwise_grouped_mm_2d3d's rules).
struct Shape2d3d {
  int64_t M, K, E, N, lda, lds, ldb, sbe, snb, sse;
};

Shape2d3d check_2d3d(const char* op, const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                     const at::Tensor& scale_b, const at::Tensor& offs) {
  Shape2d3d s;
  s.M = a.size(0), s.K = a.size(1), s.E = b.size(0), s.N = b.size(2);
  const int64_t M = s.M, K = s.K, E = s.E, N = s.N;
  const int64_t KB = ceil_div(K, kBlock), NB = ceil_div(N, kBlock);
  TORCH_CHECK(b.size(1) == K, op, ": expected b of shape (E, K, N) with K = ", K, " (the columns of a), got ",
              b.sizes());
  check_shape(op, "scale_a", scale_a, {M, KB});
  check_shape(op, "scale_b", scale_b, {E, KB, NB});
  TORCH_CHECK(offs.numel() == E, op, ": expected offs of shape (", E, ",) (one group per expert of b), got (",
              offs.numel(), ",)");
  check_unit_stride(op, "a", a, 1, "row-major");
  check_unit_stride(op, "scale_a", scale_a, 0, "column-major");
  check_unit_stride(op, "b", b, 1, "column-major per expert");
  check_unit_stride(op, "scale_b", scale_b, 1, "column-major per expert");
  TORCH_CHECK(K % 16 == 0, op, ": expected K (the columns of a) to be a multiple of 16 (16-byte rows for TMA), got ",
              K);
  TORCH_CHECK(N % 8 == 0, op, ": expected N (the columns of b) to be a multiple of 8 (16-byte bf16 output rows), got ",
              N);
  s.lda = stride_or(a, 0, K), s.lds = stride_or(scale_a, 1, M);
  s.ldb = stride_or(b, 2, K), s.sbe = stride_or(b, 0, 0);
  s.snb = stride_or(scale_b, 2, KB), s.sse = stride_or(scale_b, 0, 0);
  check_ld(op, "a.stride(0)", s.lda, K, 16);
  check_ld(op, "b.stride(2)", s.ldb, K, 16);
  TORCH_CHECK(s.sbe % 16 == 0, op, ": expected b.stride(0) to be a multiple of 16 (16-byte aligned experts), got ",
              s.sbe);
  TORCH_CHECK(s.lds >= M, op, ": expected scale_a.stride(1) >= ", M, " (column-major), got ", s.lds);
  TORCH_CHECK(s.snb >= KB, op, ": expected scale_b.stride(2) >= ", KB, " (column-major per expert), got ", s.snb);
  check_int32(op, "M", M);
  check_int32(op, "N", N);
  check_int32(op, "K", K);
  check_int32(op, "the scale_a offsets (scale_a.stride(1) * (K/128 - 1) + M)", s.lds * (KB - 1) + M);
  check_int32(op, "the scale_b offsets (scale_b.stride(2) * (N/128 - 1) + K/128)", s.snb * (NB - 1) + KB);
  check_offs(offs, a, M, op);
  return s;
}

#if MOE_FP8_BW_GEMM_SM90
// A checked 2d3d call's kernel arguments; offs must be contiguous and outlive the launch.
Args2d3d args_2d3d(const Shape2d3d& s, const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                   const at::Tensor& scale_b, const at::Tensor& offs, void* out) {
  Args2d3d p;
  p.a = static_cast<const uint8_t*>(a.data_ptr());
  p.scale_a = scale_a.data_ptr<float>();
  p.b = static_cast<const uint8_t*>(b.data_ptr());
  p.scale_b = scale_b.data_ptr<float>();
  p.offs = offs.data_ptr<int32_t>();
  p.out = out;
  p.M = s.M;
  p.N = s.N;
  p.K = s.K;
  p.lda = s.lda;
  p.lds = s.lds;
  p.ldb = s.ldb;
  p.sbe = s.sbe;
  p.snb = s.snb;
  p.sse = s.sse;
  p.groups = static_cast<int>(s.E);
  return p;
}
#endif

// Forward / dgrad: out (M, N) bf16, rows of group g = dequant(a[rows of g]) @ dequant(b[g]); a (M, K) in 1x128
// blocks (scale_a (M, K/128) column-major), b (E, K, N) in 128x128 tiles (scale_b (E, K/128, N/128) column-major).
at::Tensor blockwise_grouped_mm_2d3d(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                                     const at::Tensor& scale_b, const at::Tensor& offs, at::ScalarType out_dtype,
                                     int64_t config) {
  constexpr const char* op = "blockwise_grouped_mm_2d3d";
  check_common(op, a, scale_a, b, scale_b, offs, 3, out_dtype, config, kConfigs2d3d);
  const Shape2d3d s = check_2d3d(op, a, scale_a, b, scale_b, offs);
  check_hopper(a, op);

  at::Tensor out = at::empty({s.M, s.N}, a.options().dtype(at::kBFloat16));
  if (s.M == 0 || s.N == 0) return out;
  if (s.K == 0 || s.E == 0) return out.zero_();  // an empty contraction, or no group: all rows are zero
  check_aligned(op, "a", a);
  check_aligned(op, "b", b);
#if MOE_FP8_BW_GEMM_SM90
  const GpuLaunch gpu(a.device().index());
  const at::Tensor offs_c = offs.contiguous();  // the kernels index offs[g]: a strided view is copied
  const Args2d3d p = args_2d3d(s, a, scale_a, b, scale_b, offs_c, out.data_ptr());
  // GEMM (M_g, N, K): the tile by the mean group, the cluster by N's tile count (see the configurations).
  const int64_t c = config >= 0 ? config : pick_2d3d(s.M, s.N, s.E);
  switch (c) {
    case 0: launch_2d3d<FwdCluster21>(p, a, gpu, op); break;
    case 1: launch_2d3d<FwdCluster12>(p, a, gpu, op); break;
    case 2: launch_2d3d<FwdTall12>(p, a, gpu, op); break;
    case 3: launch_2d3d<FwdWide12>(p, a, gpu, op); break;
    default: TORCH_CHECK(false, op, ": no configuration ", c);
  }
#endif
  return out;
}

// An activation's two operands as a fused epilogue writes them, `cols` wide: 1x128 (M rows, row-major; scales
// column-major) and 128x1 in the padded layout of R rows (column-major; scales (R/128, cols), zero where no group
// row is).
struct FusedOperands {
  at::Tensor q_rows, s_rows, q_cols, s_cols;
};

FusedOperands empty_operands(const at::Tensor& like, int64_t M, int64_t R, int64_t cols) {
  const auto qopts = like.options().dtype(at::kFloat8_e4m3fn);
  const auto sopts = like.options().dtype(at::kFloat);
  return {at::empty({M, cols}, qopts), at::empty_strided({M, cols / kBlock}, {1, std::max<int64_t>(M, 1)}, sopts),
          at::empty_strided({R, cols}, {1, std::max<int64_t>(R, 1)}, qopts), at::zeros({R / kBlock, cols}, sopts)};
}

#if MOE_FP8_BW_GEMM_SM90
// The operands' parts no tile writes (swiglu_outputs_init; the silu table too where given), for groups by offs and
// padded starts (both contiguous); returns the pointers it used.
SwigluQuantOut init_operand_tails(FusedOperands& t, const at::Tensor& offs, const at::Tensor& starts, int64_t R,
                                  uint16_t* table, const GpuLaunch& gpu, const char* op) {
  SwigluQuantOut o;
  o.offs = offs.data_ptr<int32_t>();
  o.padded_starts = starts.data_ptr<int32_t>();
  o.silu_table = table;
  o.q_rows = static_cast<uint8_t*>(t.q_rows.data_ptr());
  o.s_rows = t.s_rows.data_ptr<float>();
  o.q_cols = static_cast<uint8_t*>(t.q_cols.data_ptr());
  o.s_cols = t.s_cols.data_ptr<float>();
  o.rows = t.q_rows.size(0);
  o.q_rows_total = R;
  o.hidden = static_cast<int>(t.q_rows.size(1));
  constexpr int kThreads = 256;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(std::max(R, o.rows) * o.hidden, 16 * kThreads),
                                                             2 * sm_count(gpu.device())));
  swiglu_outputs_init<<<static_cast<unsigned>(blocks), kThreads, 0, gpu.stream()>>>(o, static_cast<int>(offs.numel()));
  gpu.check(static_cast<int>(cudaGetLastError()), op);
  return o;
}
#endif

// The W13 GEMM with the SwiGLU epilogue (DESIGN §6; layouts in blockwise_gemm.py): b is [W1; W3] interleaved by 128,
// groups placed by padded_starts in the 128-aligned gap-free layout. Returns h13 as [h1 | h3] and h's 1x128 and 128x1
// operands: bit for bit blockwise_grouped_mm_2d3d, swiglu and quantize_blockwise_act_dual.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> blockwise_grouped_mm_swiglu(
    const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b, const at::Tensor& scale_b,
    const at::Tensor& offs, const at::Tensor& padded_starts) {
  constexpr const char* op = "blockwise_grouped_mm_swiglu";
  check_common(op, a, scale_a, b, scale_b, offs, 3, at::kBFloat16, -1, 1);
  const Shape2d3d s = check_2d3d(op, a, scale_a, b, scale_b, offs);
  const int64_t M = s.M, E = s.E, N = s.N, H = N / 2;
  TORCH_CHECK(N % (2 * kBlock) == 0, op, ": expected b's columns to be 2 * hidden with hidden a multiple of ", kBlock,
              " (W1 and W3 interleaved by ", kBlock, "), got ", N);
  TORCH_CHECK(s.K > 0, op, ": expected K (the columns of a) to be a positive multiple of 16 (16-byte rows for TMA), "
              "got 0");
  const int64_t R = checked_padded_rows(M, E, kBlock, op);
  check_padded_starts(padded_starts, offs, M, R, a, op, kBlock, /*gap_free=*/true);
  check_hopper(a, op);

  at::Tensor h13 = at::empty({M, N}, a.options().dtype(at::kBFloat16));
  FusedOperands h = empty_operands(a, M, R, H);
  if (H == 0) return {h13, h.q_rows, h.s_rows, h.q_cols, h.s_cols};
  check_aligned(op, "a", a);
  check_aligned(op, "b", b);
#if MOE_FP8_BW_GEMM_SM90
  const GpuLaunch gpu(a.device().index());
  const at::Tensor offs_c = offs.contiguous(), starts_c = padded_starts.contiguous();
  at::Tensor table = at::empty({kSiluTableEntries}, a.options().dtype(at::kShort));
  const SwigluQuantOut o =
      init_operand_tails(h, offs_c, starts_c, R, reinterpret_cast<uint16_t*>(table.data_ptr()), gpu, op);
  if (E == 0) h13.zero_();  // no group: every row is past the last one
  if (M > 0 && E > 0) {
    const Args2d3d p = args_2d3d(s, a, scale_a, b, scale_b, offs_c, h13.data_ptr());
    if (H / kBlock % 2 == 0) {
      launch_2d3d<FwdSwiglu12>(p, a, gpu, op, &o);
    } else {  // an odd number of 256-column tiles: no cluster (a 1x2 one would leave a CTA a row of tiles idle)
      launch_2d3d<FwdSwiglu11>(p, a, gpu, op, &o);
    }
  }
#endif
  return {h13, h.q_rows, h.s_rows, h.q_cols, h.s_cols};
}

// The W2 input-gradient GEMM with the dSwiGLU epilogue (DESIGN §6; layouts in blockwise_gemm.py): a is grad_out's
// 1x128 operand, b W2's input-gradient operand (E, K, hidden), h13 the forward's [h1 | h3]. Returns grad_h13's 1x128
// and 128x1 operands, bit for bit blockwise_grouped_mm_2d3d, swiglu_backward and quantize_blockwise_act_dual.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> blockwise_grouped_mm_dswiglu(
    const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b, const at::Tensor& scale_b,
    const at::Tensor& offs, const at::Tensor& h13, const at::Tensor& padded_starts) {
  constexpr const char* op = "blockwise_grouped_mm_dswiglu";
  check_common(op, a, scale_a, b, scale_b, offs, 3, at::kBFloat16, -1, 1);
  const Shape2d3d s = check_2d3d(op, a, scale_a, b, scale_b, offs);
  const int64_t M = s.M, E = s.E, H = s.N, W = 2 * H;
  TORCH_CHECK(H % kBlock == 0, op, ": expected b's columns (hidden) to be a multiple of ", kBlock, ", got ", H);
  TORCH_CHECK(s.K > 0, op, ": expected K (the columns of a) to be a positive multiple of 16 (16-byte rows for TMA), "
              "got 0");
  check_rank(h13, 2, op, "h13");
  TORCH_CHECK(h13.scalar_type() == at::kBFloat16, op, ": expected h13 of dtype bfloat16, got ", h13.scalar_type());
  check_shape(op, "h13", h13, {M, W});
  TORCH_CHECK(h13.is_contiguous(), op, ": expected h13 contiguous (row-major [h1 | h3]), got strides ", h13.strides());
  check_same_device(op, {"a", a}, {{"h13", h13}});
  const int64_t R = checked_padded_rows(M, E, kBlock, op);
  check_padded_starts(padded_starts, offs, M, R, a, op, kBlock, /*gap_free=*/true);
  check_hopper(a, op);

  FusedOperands g13 = empty_operands(a, M, R, W);
  if (H == 0) return {g13.q_rows, g13.s_rows, g13.q_cols, g13.s_cols};
  check_aligned(op, "a", a);
  check_aligned(op, "b", b);
  check_aligned(op, "h13", h13);
#if MOE_FP8_BW_GEMM_SM90
  const GpuLaunch gpu(a.device().index());
  const at::Tensor offs_c = offs.contiguous(), starts_c = padded_starts.contiguous();
  const SwigluQuantOut t = init_operand_tails(g13, offs_c, starts_c, R, nullptr, gpu, op);
  if (M > 0 && E > 0) {  // (no group: every row is past the last one, written above)
    DswigluQuantOut o;
    o.offs = t.offs;
    o.padded_starts = t.padded_starts;
    o.h13 = reinterpret_cast<const uint16_t*>(h13.data_ptr());
    o.q_rows = t.q_rows;
    o.s_rows = t.s_rows;
    o.q_cols = t.q_cols;
    o.s_cols = t.s_cols;
    o.rows = M;
    o.q_rows_total = R;
    o.hidden = static_cast<int>(H);
    const Args2d3d p = args_2d3d(s, a, scale_a, b, scale_b, offs_c, nullptr);
    if (H / kBlock % 2 == 0) {
      launch_2d3d<DgradDswiglu12>(p, a, gpu, op, &o);
    } else {  // an odd number of column tiles: 2x1 clusters (as the plain GEMM's pick)
      launch_2d3d<DgradDswiglu21>(p, a, gpu, op, &o);
    }
  }
#endif
  return {g13.q_rows, g13.s_rows, g13.q_cols, g13.s_cols};
}

// With MOE_FP8_DEBUG=1 (a sync) or CPU offs: every non-empty group starts at a multiple of 128.
void check_group_starts_128(const at::Tensor& offs, int64_t rows, const char* op) {
  if (!check_content(offs)) return;
  const at::Tensor host = offs.cpu().contiguous();  // host-sync-ok: MOE_FP8_DEBUG only
  const int32_t* o = host.data_ptr<int32_t>();
  for (int64_t g = 0; g < host.numel(); ++g) {
    int64_t s, e;
    group_range(o, static_cast<int>(g), rows, &s, &e);
    TORCH_CHECK(e == s || s % kBlock == 0, op, ": expected every non-empty token group to start at a multiple of ",
                kBlock, " tokens (the padded layout), got group ", g, " starting at token ", s);
  }
}

// Wgrad: out (E, N, K) bf16, out[g] = dequant(a[:, tokens of g]) @ dequant(b[tokens of g, :]); a (N, M) in 1x128
// and b (M, K) in 128x1 blocks along the tokens; non-empty groups start at multiples of 128 tokens. With `add`, the
// product is added to out (E, N, K) fp32 in place instead (an empty group adds nothing): config 0 or 1 only.
at::Tensor run_2d2d(const char* op, const at::Tensor* add, const at::Tensor& a, const at::Tensor& scale_a,
                    const at::Tensor& b, const at::Tensor& scale_b, const at::Tensor& offs, at::ScalarType out_dtype,
                    int64_t config) {
  check_common(op, a, scale_a, b, scale_b, offs, 2, out_dtype, config,
               add != nullptr ? kConfigs2d2dAdd : kConfigs2d2d);
  const int64_t N = a.size(0), M = a.size(1), K = b.size(1), E = offs.numel();
  const int64_t MB = ceil_div(M, kBlock);
  TORCH_CHECK(b.size(0) == M, op, ": expected b of shape (M, K) with M = ", M, " (the columns of a), got ", b.sizes());
  check_shape(op, "scale_a", scale_a, {N, MB});
  check_shape(op, "scale_b", scale_b, {MB, K});
  check_unit_stride(op, "a", a, 1, "row-major");
  check_unit_stride(op, "scale_a", scale_a, 0, "column-major");
  check_unit_stride(op, "b", b, 0, "column-major");
  check_unit_stride(op, "scale_b", scale_b, 1, "row-major");
  TORCH_CHECK(K % 8 == 0, op, ": expected K (the columns of b) to be a multiple of 8 (16-byte bf16 output rows), got ",
              K);
  const int64_t lda = stride_or(a, 0, round_up(M, 16)), lds = stride_or(scale_a, 1, N);
  const int64_t ldb = stride_or(b, 1, round_up(M, 16)), sbr = stride_or(scale_b, 0, K);
  check_ld(op, "a.stride(0)", lda, M, 16);
  check_ld(op, "b.stride(1)", ldb, M, 16);
  TORCH_CHECK(lds >= N, op, ": expected scale_a.stride(1) >= ", N, " (column-major), got ", lds);
  TORCH_CHECK(sbr >= K, op, ": expected scale_b.stride(0) >= ", K, " (row-major), got ", sbr);
  check_int32(op, "M", M);
  check_int32(op, "N", N);
  check_int32(op, "K", K);
  check_int32(op, "the scale_a offsets (scale_a.stride(1) * (M/128 - 1) + N)", lds * (MB - 1) + N);
  check_int32(op, "the scale_b offsets (scale_b.stride(0) * (M/128 - 1) + K)", sbr * (MB - 1) + K);
  if (add != nullptr) {
    check_add_out(op, *add, a, {E, N, K});
  } else {
    check_alloc({E, N, K}, 2, op, "out");
  }
  check_offs(offs, a, M, op);
  check_group_starts_128(offs, M, op);
  check_hopper(a, op);

  at::Tensor out = add != nullptr ? *add : at::empty({E, N, K}, a.options().dtype(at::kBFloat16));
  if (out.numel() == 0) return out;
  if (M == 0) return add != nullptr ? out : out.zero_();  // no tokens: every group is empty
  check_aligned(op, "a", a);
  check_aligned(op, "b", b);
  if (add != nullptr) check_aligned(op, "out", out);
#if MOE_FP8_BW_GEMM_SM90
  const GpuLaunch gpu(a.device().index());
  Args2d2d p;
  p.a = static_cast<const uint8_t*>(a.data_ptr());
  p.scale_a = scale_a.data_ptr<float>();
  p.b = static_cast<const uint8_t*>(b.data_ptr());
  p.scale_b = scale_b.data_ptr<float>();
  const at::Tensor offs_c = offs.contiguous();  // the kernels index offs[g]: a strided view is copied
  p.offs = offs_c.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.M = M;
  p.N = N;
  p.K = K;
  p.lda = lda;
  p.lds = lds;
  p.ldb = ldb;
  p.sbr = sbr;
  p.groups = static_cast<int>(E);
  p.accumulate = add != nullptr;
  if (add != nullptr) {  // 128x128 tiles: 2x1 clusters where 1x2 would leave a spare N tile (record 007)
    const bool c21 = config >= 0 ? config == 1 : ceil_div(K, kBlock) % 2 == 1 && ceil_div(N, kBlock) % 2 == 0;
    if (c21) {
      launch_2d2d<WgradAdd21>(p, a, gpu, op);
    } else {
      launch_2d2d<WgradAdd12>(p, a, gpu, op);
    }
    return out;
  }
  // GEMM (N, K, T_g): the tile by the mean group and N, K; the cluster by the tile counts.
  const int64_t c = config >= 0 ? config : pick_2d2d(M, N, K, E);
  switch (c) {
    case 0: launch_2d2d<WgradCluster12>(p, a, gpu, op); break;
    case 1: launch_2d2d<WgradCluster21>(p, a, gpu, op); break;
    case 2: launch_2d2d<WgradTall12>(p, a, gpu, op); break;
    case 3: launch_2d2d<WgradWide12>(p, a, gpu, op); break;
    default: TORCH_CHECK(false, op, ": no configuration ", c);
  }
#endif
  return out;
}

at::Tensor blockwise_grouped_mm_2d2d(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                                     const at::Tensor& scale_b, const at::Tensor& offs, at::ScalarType out_dtype,
                                     int64_t config) {
  return run_2d2d("blockwise_grouped_mm_2d2d", nullptr, a, scale_a, b, scale_b, offs, out_dtype, config);
}

void blockwise_grouped_mm_2d2d_add_(const at::Tensor& out, const at::Tensor& a, const at::Tensor& scale_a,
                                    const at::Tensor& b, const at::Tensor& scale_b, const at::Tensor& offs,
                                    int64_t config) {
  run_2d2d("blockwise_grouped_mm_2d2d_add_", &out, a, scale_a, b, scale_b, offs, at::kBFloat16, config);
}

}  // namespace
}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CUDA, m) {
  m.impl("blockwise_grouped_mm_2d3d", TORCH_FN(moe_fp8::blockwise_grouped_mm_2d3d));
  m.impl("blockwise_grouped_mm_2d2d", TORCH_FN(moe_fp8::blockwise_grouped_mm_2d2d));
  m.impl("blockwise_grouped_mm_2d2d_add_", TORCH_FN(moe_fp8::blockwise_grouped_mm_2d2d_add_));
  m.impl("blockwise_grouped_mm_swiglu", TORCH_FN(moe_fp8::blockwise_grouped_mm_swiglu));
  m.impl("blockwise_grouped_mm_dswiglu", TORCH_FN(moe_fp8::blockwise_grouped_mm_dswiglu));
}
