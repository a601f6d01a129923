// CUDA (and hipified ROCm) registration of the FP8 blockwise recipe: the engine's
// kernels instantiated with the recipe's policies (Fp32Exact, blocks of 128, linear
// scales), for e4m3fn, e4m3fnuz and e5m2 data.
#include <torch/library.h>

#include "../quant/engine_cuda.cuh"
#include "blockwise_ops.h"

namespace moe_fp8 {

extern const QuantKernels kBlockwiseCuda;
const QuantKernels kBlockwiseCuda = cuda_quant_kernels<BlockwiseRules, BlockwiseBlocks, BlockwiseLayouts>();
extern const TileKernels kBlockwiseTilesCuda;
const TileKernels kBlockwiseTilesCuda = cuda_tile_kernels<BlockwiseRules>();

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CUDA, m) {
  moe_fp8::BlockwiseOn<moe_fp8::kBlockwiseCuda, moe_fp8::kBlockwiseTilesCuda>::register_impls(m);
}
