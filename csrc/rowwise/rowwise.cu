// CUDA registration of the FP8 rowwise recipe: the engine's kernels instantiated with
// the recipe's policies (fp32 pow2/exact scales, whole reduction sets, linear scales).
#include <torch/library.h>

#include "../quant/engine_cuda.cuh"
#include "rowwise_ops.h"

namespace moe_fp8 {

extern const QuantKernels kRowwiseCuda;
const QuantKernels kRowwiseCuda = cuda_quant_kernels<RowwiseRules, RowwiseBlocks, RowwiseLayouts>();

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CUDA, m) { moe_fp8::RowwiseOn<moe_fp8::kRowwiseCuda>::register_impls(m); }
