// CPU side of the SwiGLU family: the GPU kernel's math as plain loops over the scalar
// functions of swiglu.h (one rounding per fp32 operation, as on the GPU), so CI checks
// the exact bits the GPU writes. Registered for the CPU dispatch key.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "../core/dispatch.h"
#include "swiglu_ops.h"

namespace moe_fp8 {
namespace {

template <InputKind K, Fp8Format F>
void run_rows(const SwigluArgs& a) {
  using E = SwigluElem<K>;
  using T = typename E::storage;
  constexpr float kMax = Fp8Spec<F>::kMax;
  const int halves = a.backward ? 2 : 1;
  const bool quant = a.quant;
  at::parallel_for(0, a.rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> row(static_cast<size_t>(2 * a.hidden));
    for (int64_t r = begin; r < end; ++r) {
      const T* h = static_cast<const T*>(a.h13) + r * a.h13_stride;
      const T* g = a.backward ? static_cast<const T*>(a.grad) + r * a.grad_stride : nullptr;
      T* h_out = a.h_out != nullptr ? static_cast<T*>(a.h_out) + r * a.h_out_stride : nullptr;
      for (int64_t c = 0; c < a.hidden; ++c) {
        if (a.backward) {
          swiglu_backward_elem<K>(g[c], h[c], h[a.hidden + c], &row[c], &row[a.hidden + c],
                                  h_out != nullptr ? &h_out[c] : nullptr);
        } else {
          row[c] = swiglu_elem<K>(h[c], h[a.hidden + c]);
        }
      }
      if (a.out != nullptr) {
        std::copy(row.begin(), row.begin() + halves * a.hidden, static_cast<T*>(a.out) + r * a.out_stride);
      }
      if (!quant) continue;
      uint32_t amax_all = 0;  // joint: one scale over the whole row
      for (int64_t c = 0; c < halves * a.hidden; ++c) amax_all = std::max(amax_all, abs_bits(E::to_float(row[c])));
      for (int half = 0; half < halves; ++half) {
        const T* v = row.data() + half * a.hidden;
        uint32_t amax = 0;
        for (int64_t c = 0; c < a.hidden; ++c) amax = std::max(amax, abs_bits(E::to_float(v[c])));
        const QuantScale sc = scale_from_amax_bits(a.joint ? amax_all : amax, kMax, a.pow2);
        a.scale[half][r] = sc.decode;
        uint8_t* q = a.q[half] + r * a.q_stride;
        for (int64_t c = 0; c < a.hidden; ++c) q[c] = encode_fp8<F>(scale_clamp(E::to_float(v[c]), sc.encode, kMax));
      }
    }
  });
}

void run_cpu(InputKind in, Fp8Format fmt, const SwigluArgs& a, int /*device*/) {
  dispatch_input_fp8(in, fmt, [&](auto kc, auto fc) { run_rows<decltype(kc)::value, decltype(fc)::value>(a); });
}

}  // namespace

extern const SwigluKernels kSwigluCpu = {run_cpu};

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CPU, m) { moe_fp8::SwigluOn<moe_fp8::kSwigluCpu>::register_impls(m); }
