// CUDA registration of the MXFP8 recipe: the engine's kernels instantiated with the
// recipe's policies (E8M0 FLOOR/RCEIL, blocks of 32, linear or blocked scales). The
// quantization runs on any GPU; only the GEMM that consumes it needs sm100.
#include <torch/library.h>

#include "../quant/engine_cuda.cuh"
#include "mxfp8_ops.h"

namespace moe_fp8 {

extern const QuantKernels kMxfp8Cuda;
const QuantKernels kMxfp8Cuda = cuda_quant_kernels<Mxfp8Rules, Mxfp8Blocks, Mxfp8Layouts>();

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CUDA, m) { moe_fp8::Mxfp8On<moe_fp8::kMxfp8Cuda>::register_impls(m); }
