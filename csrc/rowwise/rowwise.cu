// CUDA registration of the FP8 rowwise recipe: the engine's kernels instantiated with
// the recipe's policies (fp32 pow2/exact scales, whole reduction sets, linear scales),
// and the dual kernel (a weight's two orientations from one read).
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "../core/device_runtime.h"
#include "../core/tuning.h"
#include "../core/tuning_constants.h"
#include "../quant/specialized/dual_kernel.cuh"
#include "../quant/engine_cuda.cuh"
#include "rowwise_ops.h"

namespace moe_fp8 {
namespace {

// The L2 budget of the dual kernel: tuning dual_l2_bytes unset or "l2" = three fifths of
// L2, a byte count, or 0 = never (the two ops, the same bits); 0 where a block cannot
// have the kernel's shared memory, and unset means 0 on ROCm (not yet run on AMD GPUs).
int64_t dual_budget(int device) {
  const std::optional<std::string> v = tuning(Knob::kDualL2Bytes);
  const bool fits = dual_smem_ok(device);
  if (!v && kRocm) return 0;
  if (!v || *v == "l2") return fits ? l2_cache_bytes(device) * kDualL2Fifths / 5 : 0;
  char* end = nullptr;
  const long long n = std::strtoll(v->c_str(), &end, 10);
  TORCH_CHECK(end != v->c_str() && *end == '\0' && n >= 0,
              "moe_fp8: expected tuning dual_l2_bytes to be \"l2\" or a byte count, got \"", *v, "\"");
  return fits ? n : 0;
}

// One launch of the dual kernel over a weight's experts, sized to the blocks the device holds.
template <InputKind K, Fp8Format F, class Rule>
int launch_dual(const DualArgs& a, int64_t budget, gpuStream_t stream) {
  static const int per_sm = resident_blocks(quantize_dual_kernel<K, F, Rule, DualExpertsSchedule>, kDualThreads, 0);
  const int64_t resident = int64_t{per_sm} * multiprocessor_count();
  return launch_quantize_dual<K, F, Rule>(a, resident, budget, stream);
}

void run_dual(InputKind in, Fp8Format fmt, bool pow2, const DualArgs& a, int device) {
  const GpuLaunch gpu(device);
  const int64_t budget = dual_budget(device);
  int err = -1;
  dispatch_input_fp8(in, fmt, [&](auto kin, auto kfmt) {
    constexpr InputKind K = decltype(kin)::value;
    constexpr Fp8Format F = decltype(kfmt)::value;
    if constexpr (K != InputKind::kFP32) {
      err = pow2 ? launch_dual<K, F, Fp32Pow2>(a, budget, gpu.stream())
                 : launch_dual<K, F, Fp32Exact>(a, budget, gpu.stream());
    }
  });
  gpu.check(err, "dual weight quantization");
}

constexpr QuantKernels rowwise_cuda_kernels() {
  QuantKernels k = cuda_quant_kernels<RowwiseRules, RowwiseBlocks, RowwiseLayouts, true>();
  k.dual_budget = &dual_budget;
  k.dual = &run_dual;
  return k;
}

}  // namespace

extern const QuantKernels kRowwiseCuda;
const QuantKernels kRowwiseCuda = rowwise_cuda_kernels();

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CUDA, m) { moe_fp8::RowwiseOn<moe_fp8::kRowwiseCuda>::register_impls(m); }
