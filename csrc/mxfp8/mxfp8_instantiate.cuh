// Torch-free instantiation of every MXFP8 launcher (the engine with the recipe's policies), for scripts/check_hip.sh;
// not inline: see rowwise_instantiate.cuh. The policy lists are spelled out (not taken from mxfp8_ops.h, which holds
// torch glue).
#pragma once

#include "../quant/engine_instantiate.cuh"

namespace moe_fp8 {
namespace instantiate {

int mxfp8_launchers(const QuantSpec& spec, const RowsArgs& r, const ColsArgs& c, gpuStream_t stream) {
  return instantiate_engine<RuleList<E8m0Floor, E8m0Rceil>, BlockList<32>, LayoutList<LinearScales, BlockedScales>>(
      spec, r, c, stream);
}

}  // namespace instantiate
}  // namespace moe_fp8
