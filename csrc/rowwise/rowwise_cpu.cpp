// CPU registration of the FP8 rowwise recipe: the engine's CPU twin instantiated with
// the recipe's policies.
#include <torch/library.h>

#include "../quant/engine_cpu.h"
#include "rowwise_ops.h"

namespace moe_fp8 {

extern const QuantKernels kRowwiseCpu;
const QuantKernels kRowwiseCpu = cpu_quant_kernels<RowwiseRules, RowwiseBlocks, RowwiseLayouts, true>();

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CPU, m) { moe_fp8::RowwiseOn<moe_fp8::kRowwiseCpu>::register_impls(m); }
