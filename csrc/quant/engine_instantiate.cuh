// Torch-free instantiation of the engine's launchers for a recipe's policy lists, every input dtype and fp8 format the
// rules support: each recipe's <family>_instantiate.cuh calls it, so scripts/check_hip.sh compiles every kernel a
// recipe registers without a ROCm torch.
#pragma once

#include "../core/dispatch.h"
#include "cols_kernel.cuh"
#include "rows_kernel.cuh"

namespace moe_fp8 {

template <class Rules, class Blocks, class Layouts, bool kAsBF16 = false>
int instantiate_engine(const QuantSpec& spec, const RowsArgs& r, const ColsArgs& c, gpuStream_t stream) {
  int err = 0;
  for (int in = 0; in < 4; ++in) {
    for (int fmt = 0; fmt < 3; ++fmt) {
      dispatch_engine<Rules, Blocks, Layouts, kAsBF16>(
          static_cast<InputKind>(in), static_cast<Fp8Format>(fmt), spec,
          [&](auto kin, auto kfmt, auto rule, auto block, auto layout) {
            constexpr InputKind K = decltype(kin)::value;
            constexpr Fp8Format F = decltype(kfmt)::value;
            constexpr int B = decltype(block)::value;
            err |= launch_quantize_rows<K, F, decltype(rule), B, decltype(layout)>(r, stream);
            err |= launch_quantize_cols<K, F, decltype(rule), B, decltype(layout)>(
                c, plan_cols_launch(1024, 1, 65536, false, B), stream);
          });
    }
  }
  return err;
}

}  // namespace moe_fp8
