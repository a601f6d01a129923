// Torch-free instantiation of every FP8 blockwise launcher (the engine with the recipe's policies), for
// scripts/check_hip.sh; not inline: see rowwise_instantiate.cuh. The policy lists are spelled out (not taken from
// blockwise_ops.h, which holds torch glue).
#pragma once

#include "../quant/engine_instantiate.cuh"
#include "../quant/specialized/act_dual_kernel.cuh"
#include "../quant/specialized/tiles_kernel.cuh"

namespace moe_fp8 {
namespace instantiate {

int blockwise_launchers(const QuantSpec& spec, const RowsArgs& r, const ColsArgs& c, gpuStream_t stream) {
  return instantiate_engine<RuleList<Fp32Exact>, BlockList<128>, LayoutList<LinearScales>>(spec, r, c, stream);
}

// The weights' 128x128 tiles, every input kind (fp32 as bf16 too) and fp8 format.
int blockwise_tile_launchers(const TilesArgs& a, gpuStream_t stream) {
  int err = 0;
  for (int in = 0; in < 4; ++in) {
    for (int fmt = 0; fmt < 3; ++fmt) {
      dispatch_input_fp8<true>(static_cast<InputKind>(in), static_cast<Fp8Format>(fmt), [&](auto kin, auto kfmt) {
        err |= launch_quantize_tiles<decltype(kin)::value, decltype(kfmt)::value, Fp32Exact>(a, stream);
      });
    }
  }
  return err;
}

// The activations' 1x128 + 128x1 dual, 2-byte inputs, every fp8 format.
int blockwise_act_dual_launchers(const ActDualArgs& a, gpuStream_t stream) {
  int err = 0;
  for (int fmt = 0; fmt < 3; ++fmt) {
    dispatch_input_fp8(InputKind::kBF16, static_cast<Fp8Format>(fmt), [&](auto, auto kfmt) {
      err |= launch_quantize_act_dual<InputKind::kBF16, decltype(kfmt)::value, Fp32Exact>(a, stream);
      err |= launch_quantize_act_dual<InputKind::kFP16, decltype(kfmt)::value, Fp32Exact>(a, stream);
    });
  }
  return err;
}

}  // namespace instantiate
}  // namespace moe_fp8
