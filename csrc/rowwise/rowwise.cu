// CUDA registration of the FP8 rowwise recipe: the engine's kernels instantiated with
// the recipe's policies (fp32 pow2/exact scales, whole reduction sets, linear scales),
// and the dual kernel (a weight's two orientations, or a token-grouped tensor's rowwise
// and per-group colwise fp8, from one read).
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <type_traits>

#include "../quant/dual_kernel.cuh"
#include "../quant/engine_cuda.cuh"
#include "rowwise_ops.h"

namespace moe_fp8 {
namespace {

// The L2 budget of the dual kernel: MOE_FP8_DUAL_L2_BYTES unset or "l2" = three fifths of
// L2 (what the H100 measurements used), a byte count, or 0 = never the dual kernel (the
// two ops it replaces, the same bits). 0 too on a device whose blocks cannot have the
// kernel's 85 KB of shared memory (AMD MI300: 64 KB). On ROCm unset means 0: the kernel
// compiles there (hipcc in CI) but has not run on an AMD GPU; "l2" or a count opts in.
int64_t dual_budget(int device) {
  const char* v = std::getenv("MOE_FP8_DUAL_L2_BYTES");
  const bool fits = dual_smem_ok(device);
  if (v == nullptr && kRocm) return 0;
  if (v == nullptr || std::string(v) == "l2") return fits ? l2_cache_bytes(device) * 3 / 5 : 0;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  TORCH_CHECK(end != v && *end == '\0' && n >= 0,
              "moe_fp8: expected MOE_FP8_DUAL_L2_BYTES to be \"l2\" or a byte count, got \"", v, "\"");
  return fits ? n : 0;
}

// The L2 budget of the jagged dual kernel (an activation's rowwise and per-group colwise
// fp8 from one read): dual_budget where MOE_FP8_ONE_READ_ACTIVATIONS is "1", else 0 (the
// two ops, the same bits). Off by default: on the H100 it measured 0.87-0.93x the two
// ops' speed (bench/RESULTS.md).
int64_t dual_jagged_budget(int device) {
  const char* v = std::getenv("MOE_FP8_ONE_READ_ACTIVATIONS");
  if (v == nullptr || std::string(v) == "0") return 0;
  TORCH_CHECK(std::string(v) == "1", "moe_fp8: expected MOE_FP8_ONE_READ_ACTIVATIONS to be \"0\" or \"1\", got \"", v,
              "\"");
  return dual_budget(device);
}

// One launch of the dual kernel with the schedule of Args (a weight's DualArgs, or a
// token-grouped tensor's DualJaggedArgs), sized to the blocks the device holds.
template <class Sched, InputKind K, Fp8Format F, class Rule, class Args>
int launch_dual(const Args& a, int64_t budget, gpuStream_t stream) {
  static const int per_sm = resident_blocks(quantize_dual_kernel<K, F, Rule, Sched>, kDualThreads, 0);
  const int64_t resident = int64_t{per_sm} * multiprocessor_count();
  if constexpr (std::is_same_v<Args, DualArgs>) {
    return launch_quantize_dual<K, F, Rule>(a, resident, budget, stream);
  } else {
    return launch_quantize_dual_jagged<K, F, Rule>(a, resident, budget, stream);
  }
}

template <class Sched, class Args>
void run_dual_shape(InputKind in, Fp8Format fmt, bool pow2, const Args& a, int device, const char* what) {
  const GpuLaunch gpu(device);
  const int64_t budget = dual_budget(device);
  int err = -1;
  dispatch_input_fp8(in, fmt, [&](auto kin, auto kfmt) {
    constexpr InputKind K = decltype(kin)::value;
    constexpr Fp8Format F = decltype(kfmt)::value;
    if constexpr (K != InputKind::kFP32) {
      err = pow2 ? launch_dual<Sched, K, F, Fp32Pow2>(a, budget, gpu.stream())
                 : launch_dual<Sched, K, F, Fp32Exact>(a, budget, gpu.stream());
    }
  });
  gpu.check(err, what);
}

void run_dual(InputKind in, Fp8Format fmt, bool pow2, const DualArgs& a, int device) {
  run_dual_shape<DualExpertsSchedule>(in, fmt, pow2, a, device, "dual weight quantization");
}

void run_dual_jagged(InputKind in, Fp8Format fmt, bool pow2, const DualJaggedArgs& a, int device) {
  run_dual_shape<DualJaggedSchedule>(in, fmt, pow2, a, device, "jagged dual quantization");
}

constexpr QuantKernels rowwise_cuda_kernels() {
  QuantKernels k = cuda_quant_kernels<RowwiseRules, RowwiseBlocks, RowwiseLayouts>();
  k.dual_budget = &dual_budget;
  k.dual = &run_dual;
  k.dual_jagged_budget = &dual_jagged_budget;
  k.dual_jagged = &run_dual_jagged;
  return k;
}

}  // namespace

extern const QuantKernels kRowwiseCuda;
const QuantKernels kRowwiseCuda = rowwise_cuda_kernels();

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CUDA, m) { moe_fp8::RowwiseOn<moe_fp8::kRowwiseCuda>::register_impls(m); }
