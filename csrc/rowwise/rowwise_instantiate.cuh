// Torch-free instantiation of every rowwise launcher (the engine with the recipe's
// policies) for every input dtype and fp8 format. Not part of the extension:
// scripts/check_hip.sh compiles the hipified copy for each AMD arch (no ROCm torch
// needed). Non-inline on purpose (only check_hip.sh includes it, into one file): an
// unused inline function would let the compiler skip generating the kernels it names.
#pragma once

#include "../quant/engine_instantiate.cuh"

namespace moe_fp8 {
namespace instantiate {

int rowwise_launchers(const QuantSpec& spec, const RowsArgs& r, const ColsArgs& c, gpuStream_t stream) {
  return instantiate_engine<RuleList<Fp32Pow2, Fp32Exact>, BlockList<kWholeSet>, LayoutList<LinearScales>>(spec, r, c,
                                                                                                         stream);
}

}  // namespace instantiate
}  // namespace moe_fp8
