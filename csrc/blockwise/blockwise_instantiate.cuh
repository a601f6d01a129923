// Torch-free instantiation of every FP8 blockwise launcher (the engine with the
// recipe's policies), for scripts/check_hip.sh; see rowwise_instantiate.cuh for why it
// is not inline. The policy lists are spelled out (not taken from blockwise_ops.h,
// which holds torch glue).
#pragma once

#include "../quant/engine_instantiate.cuh"

namespace moe_fp8 {
namespace instantiate {

int blockwise_launchers(const QuantSpec& spec, const RowsArgs& r, const ColsArgs& c, gpuStream_t stream) {
  return instantiate_engine<RuleList<Fp32Exact>, BlockList<128>, LayoutList<LinearScales>>(spec, r, c, stream);
}

}  // namespace instantiate
}  // namespace moe_fp8
