// Torch-free instantiation of every rowwise launcher, every input dtype and fp8 format, not part of the extension:
// scripts/check_hip.sh compiles the hipified copy for each AMD arch. Not inline on purpose (only check_hip.sh includes
// it, into one file): an unused inline function would let the compiler skip generating the kernels it names.
#pragma once

#include "../quant/specialized/dual_kernel.cuh"
#include "../quant/engine_instantiate.cuh"

namespace moe_fp8 {
namespace instantiate {

int rowwise_launchers(const QuantSpec& spec, const RowsArgs& r, const ColsArgs& c, gpuStream_t stream) {
  return instantiate_engine<RuleList<Fp32Pow2, Fp32Exact>, BlockList<kWholeSet>, LayoutList<LinearScales>, true>(
      spec, r, c, stream);
}

// The dual kernel (a weight's two orientations), 2-byte inputs only.
int rowwise_dual_launchers(const DualArgs& a, gpuStream_t stream) {
  int err = 0;
  for (int in = 0; in < 2; ++in) {
    for (int fmt = 0; fmt < 3; ++fmt) {
      dispatch_input_fp8(static_cast<InputKind>(in), static_cast<Fp8Format>(fmt), [&](auto kin, auto kfmt) {
        constexpr InputKind K = decltype(kin)::value;
        constexpr Fp8Format F = decltype(kfmt)::value;
        if constexpr (K != InputKind::kFP32) {
          err |= launch_quantize_dual<K, F, Fp32Pow2>(a, 264, 1 << 25, stream);
          err |= launch_quantize_dual<K, F, Fp32Exact>(a, 264, 1 << 25, stream);
        }
      });
    }
  }
  return err;
}

}  // namespace instantiate
}  // namespace moe_fp8
