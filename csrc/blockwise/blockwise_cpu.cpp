// CPU registration of the FP8 blockwise recipe: the engine's CPU twin instantiated with
// the recipe's policies (Fp32Exact, blocks of 128, linear scales).
#include <torch/library.h>

#include "../quant/engine_cpu.h"
#include "blockwise_ops.h"

namespace moe_fp8 {

extern const QuantKernels kBlockwiseCpu;
const QuantKernels kBlockwiseCpu = cpu_quant_kernels<BlockwiseRules, BlockwiseBlocks, BlockwiseLayouts>();
extern const TileKernels kBlockwiseTilesCpu;
const TileKernels kBlockwiseTilesCpu = cpu_tile_kernels<BlockwiseRules>();

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CPU, m) {
  moe_fp8::BlockwiseOn<moe_fp8::kBlockwiseCpu, moe_fp8::kBlockwiseTilesCpu>::register_impls(m);
}
