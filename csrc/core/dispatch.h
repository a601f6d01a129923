// Runtime (InputKind, Fp8Format) -> compile-time constants, for the CPU loops and
// the GPU launchers alike. Torch-free; the torch glue maps ScalarTypes to these enums.
#pragma once

#include <type_traits>

#include "numerics.h"

namespace moe_fp8 {

template <Fp8Format F>
using Fp8Constant = std::integral_constant<Fp8Format, F>;
template <InputKind K>
using InputConstant = std::integral_constant<InputKind, K>;

// Calls fn(InputConstant<K>{}, Fp8Constant<F>{}) for the runtime pair; kFP32AsBF16 only
// where kAsBF16 (the weight quantizers), else nothing is called for it.
template <bool kAsBF16 = false, typename Fn>
void dispatch_input_fp8(InputKind in, Fp8Format fmt, Fn&& fn) {
  auto with_input = [&](auto fc) {
    switch (in) {
      case InputKind::kBF16: fn(InputConstant<InputKind::kBF16>{}, fc); return;
      case InputKind::kFP16: fn(InputConstant<InputKind::kFP16>{}, fc); return;
      case InputKind::kFP32: fn(InputConstant<InputKind::kFP32>{}, fc); return;
      case InputKind::kFP32AsBF16:
        if constexpr (kAsBF16) fn(InputConstant<InputKind::kFP32AsBF16>{}, fc);
        return;
    }
  };
  switch (fmt) {
    case Fp8Format::kE4M3FN: with_input(Fp8Constant<Fp8Format::kE4M3FN>{}); return;
    case Fp8Format::kE4M3FNUZ: with_input(Fp8Constant<Fp8Format::kE4M3FNUZ>{}); return;
    case Fp8Format::kE5M2: with_input(Fp8Constant<Fp8Format::kE5M2>{}); return;
  }
}

}  // namespace moe_fp8
