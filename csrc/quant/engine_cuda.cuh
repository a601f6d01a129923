// GPU runners of the quantization engine for a recipe's policy lists: device guard, current stream, the transposing
// kernel's launch plan, dispatch of (input dtype, fp8 format, QuantSpec) to the instantiated kernels, launch check.
// A recipe's .cu instantiates them through cuda_quant_kernels<...>().
#pragma once

#include <c10/util/Exception.h>

#include <cstdio>
#include <optional>
#include <string>

#include "../core/device_runtime.h"
#include "../core/dispatch.h"
#include "../core/launch.h"
#include "../core/tuning.h"
#include "cols_kernel.cuh"
#include "rows_kernel.cuh"
#include "specialized/act_dual_kernel.cuh"
#include "specialized/tiles_kernel.cuh"

namespace moe_fp8 {
namespace engine_cuda {

// The tuning knobs cols_plan="cluster,rows" (whole-set mode) and cols_block_plan=
// "slices,rows" (block mode: slices per segment 1-64, rows a multiple of a 128-row pass)
// replace the launch plan, for sweeps (bench/sweep_cols.py); only the speed changes.
inline ColsLaunchPlan cols_plan_override(const char* v, int device, bool block_mode) {
  int first = 0, rows = 0;
  char tail = 0;
  const bool parsed = std::sscanf(v, "%d,%d%c", &first, &rows, &tail) == 2;
  const bool rows_fit = static_cast<int64_t>(rows) * kColsTileBytes <= max_dynamic_smem_per_block(device) - 8192;
  if (block_mode) {
    TORCH_CHECK(parsed && first >= 1 && first <= 64 && rows > 0 && rows % kColsPassRows == 0 && rows_fit,
                "moe_fp8: expected tuning cols_block_plan=\"slices,rows\" with slices in [1, 64] and rows a positive ",
                "multiple of ", kColsPassRows, " that fits shared memory, got \"", v, "\"");
  } else {
    const int max_cluster = supports_clusters(device) ? kColsMaxCluster : 1;
    TORCH_CHECK(parsed && first >= 1 && first <= max_cluster && (first & (first - 1)) == 0 && rows > 0 &&
                    rows % kColsFragRows == 0 && rows_fit,
                "moe_fp8: expected tuning cols_plan=\"cluster,rows\" with cluster a power of two up to ", max_cluster,
                " and rows a positive multiple of ", kColsFragRows, " that fits shared memory, got \"", v, "\"");
  }
  return {first, rows};
}

template <class Rules, class Blocks, class Layouts, bool kAsBF16>
void run_rows(InputKind in, Fp8Format fmt, const QuantSpec& spec, const RowsArgs& a, int device) {
  TORCH_CHECK(a.rows <= INT32_MAX, "moe_fp8: expected at most 2^31-1 reduction rows, got ", a.rows);
  TORCH_CHECK(spec.block == kWholeSet || a.rows * round_up(a.cols, 128) < (int64_t{1} << 32) - (int64_t{1} << 26),
              "moe_fp8: expected fewer than 2^32 elements for a block quantization, got ", a.rows, " x ", a.cols);
  const GpuLaunch gpu(device);
  int err = 0;
  const auto run = [&](auto kin, auto kfmt, auto rule, auto block, auto layout) {
    err = launch_quantize_rows<decltype(kin)::value, decltype(kfmt)::value, decltype(rule), decltype(block)::value,
                               decltype(layout)>(a, gpu.stream());
  };
  const bool ran = dispatch_engine<Rules, Blocks, Layouts, kAsBF16>(in, fmt, spec, run);
  TORCH_CHECK(ran, "moe_fp8: internal error: no GPU rows instantiation for this scale rule, block and layout");
  gpu.check(err, "rows quantization");
}

// Rows (and q rows) of one cols launch: int32 with room for the slice arithmetic.
constexpr int64_t kColsMaxRows = INT32_MAX - (int64_t{1} << 16);
// With blocked scales (MXFP8, blocks of 32): the kernel's offset into a segment's scales
// is unsigned 32-bit, 512 bytes per 4 blocks.
constexpr int64_t kColsMaxBlockedRows = int64_t{1} << 30;

template <class Rules, class Blocks, class Layouts, bool kAsBF16>
void run_cols(InputKind in, Fp8Format fmt, const QuantSpec& spec, const ColsArgs& a, int64_t expected_segment_rows,
              int device) {
  const GpuLaunch gpu(device);
  // The kernel's slice arithmetic is 32-bit: a slice rounded up to whole blocks, plus its
  // offset, exceeds the rows by at most 64 slices x 128 rows; keep 2^16 rows of room.
  TORCH_CHECK(a.rows <= kColsMaxRows && a.q_rows <= kColsMaxRows, "moe_fp8: expected at most ", kColsMaxRows,
              " rows (2^31 - 2^16 - 1), got ", std::max(a.rows, a.q_rows));
  TORCH_CHECK(spec.layout != ScaleLayoutKind::kBlocked || a.q_rows <= kColsMaxBlockedRows,
              "moe_fp8: expected at most 2^30 rows with blocked scales, got ", a.q_rows);
  const int segments = segments_with_tail(a);
  TORCH_CHECK(segments <= 65535, "moe_fp8: expected at most 65534 groups, got ", a.num_segments);
  ColsLaunchPlan plan = plan_cols_launch(expected_segment_rows, segments, max_dynamic_smem_per_block(device),
                                         supports_clusters(device), spec.block, a.jagged);
  const bool whole = spec.block == kWholeSet;
  const std::optional<std::string> override_plan = tuning(whole ? Knob::kColsPlan : Knob::kColsBlockPlan);
  // Block mode over token groups: slices sized by each group (narrow operands), unless overridden.
  const bool group_slices = !override_plan && !whole && a.jagged && a.num_segments > 0;
  if (override_plan) {
    plan = cols_plan_override(override_plan->c_str(), device, !whole);
    TORCH_CHECK(static_cast<int64_t>(segments) * plan.cluster <= 65535, "moe_fp8: tuning ",
                whole ? "cols_plan cluster " : "cols_block_plan slices ", plan.cluster,
                " is too large for ", segments, " segments");
  }
  int err = 0;
  const auto run = [&](auto kin, auto kfmt, auto rule, auto block, auto layout) {
    constexpr InputKind K = decltype(kin)::value;
    ColsLaunchPlan p = plan;
    if (group_slices) plan_cols_group_slices(segments, cols_launch_tiles(a, ColsGeometry<K>::kTileCols), &p);
    err = launch_quantize_cols<K, decltype(kfmt)::value, decltype(rule), decltype(block)::value, decltype(layout)>(
        a, p, gpu.stream());
  };
  const bool ran = dispatch_engine<Rules, Blocks, Layouts, kAsBF16>(in, fmt, spec, run);
  TORCH_CHECK(ran, "moe_fp8: internal error: no GPU cols instantiation for this scale rule, block and layout");
  gpu.check(err, "cols quantization");
}

// Calls launch(Rule{}) for the first rule of the list that is `rule` and supports F;
// whether one did.
template <Fp8Format F, class Fn, class... Rules>
bool launch_first_rule(RuleList<Rules...>, ScaleRuleKind rule, Fn&& launch) {
  const auto one = [&](auto r) {
    using Rule = decltype(r);
    if constexpr (Rule::supports(F)) {
      if (rule_kind<Rule>() != rule) return false;
      launch(r);
      return true;
    } else {
      return false;
    }
  };
  return (one(Rules{}) || ...);
}

// Runs launch(kin, kfmt, rule, stream) -> error code for the instantiation of the
// runtime (input dtype, fp8 format, scale rule): the first rule of Rules that is `rule`
// and supports the format, under a device guard on the current stream; then the checks.
template <class Rules, bool kAsBF16, class Launch>
void run_by_rule(InputKind in, Fp8Format fmt, ScaleRuleKind rule, int device, const char* what, Launch&& launch) {
  const GpuLaunch gpu(device);
  int err = 0;
  bool ran = false;
  dispatch_input_fp8<kAsBF16>(in, fmt, [&](auto kin, auto kfmt) {
    ran = launch_first_rule<decltype(kfmt)::value>(Rules{}, rule,
                                                   [&](auto r) { err = launch(kin, kfmt, r, gpu.stream()); });
  });
  TORCH_CHECK(ran, "moe_fp8: internal error: no GPU instantiation of the ", what, " for this scale rule");
  gpu.check(err, what);
}

template <class Rules>
void run_tiles(InputKind in, Fp8Format fmt, ScaleRuleKind rule, const TilesArgs& a, int device) {
  const auto launch = [&](auto kin, auto kfmt, auto r, gpuStream_t s) {
    return launch_quantize_tiles<decltype(kin)::value, decltype(kfmt)::value, decltype(r)>(a, s);
  };
  run_by_rule<Rules, true>(in, fmt, rule, device, "tiles quantization", launch);
}

// Only for act_dual_vector_ok arguments (2-byte inputs: fp32 has no kernel, and its
// launcher refuses).
template <class Rules>
void run_act_dual(InputKind in, Fp8Format fmt, ScaleRuleKind rule, const ActDualArgs& a, int device) {
  TORCH_CHECK(in != InputKind::kFP32 && act_dual_vector_ok(a, 2),
              "moe_fp8: internal error: the activation dual kernel takes 2-byte inputs with aligned rows");
  run_by_rule<Rules, false>(in, fmt, rule, device, "activation dual quantization",
                     [&](auto kin, auto kfmt, auto r, gpuStream_t s) {
                       return launch_quantize_act_dual<decltype(kin)::value, decltype(kfmt)::value, decltype(r)>(a, s);
                     });
}

}  // namespace engine_cuda

template <class Rules>
constexpr TileKernels cuda_tile_kernels() {
  TileKernels k{};  // (a one-member brace list would be read as a conversion of the overload set)
  k.tiles = &engine_cuda::run_tiles<Rules>;
  k.act_dual = &engine_cuda::run_act_dual<Rules>;
  return k;
}

// kAsBF16: the runners take kFP32AsBF16 too (a recipe whose weights are quantized by them).
template <class Rules, class Blocks, class Layouts, bool kAsBF16 = false>
constexpr QuantKernels cuda_quant_kernels() {
  return {&engine_cuda::run_rows<Rules, Blocks, Layouts, kAsBF16>,
          &engine_cuda::run_cols<Rules, Blocks, Layouts, kAsBF16>};
}

}  // namespace moe_fp8
