// CPU registration of the MXFP8 recipe: the engine's CPU twin instantiated with the
// recipe's policies.
#include <torch/library.h>

#include "../quant/engine_cpu.h"
#include "mxfp8_ops.h"

namespace moe_fp8 {

extern const QuantKernels kMxfp8Cpu;
const QuantKernels kMxfp8Cpu = cpu_quant_kernels<Mxfp8Rules, Mxfp8Blocks, Mxfp8Layouts>();

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CPU, m) { moe_fp8::Mxfp8On<moe_fp8::kMxfp8Cpu>::register_impls(m); }
