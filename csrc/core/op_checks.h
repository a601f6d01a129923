// Host-side input checks shared by every family's torch glue, with the message form
// of DESIGN §3: "<op>: expected <what>, got <what>". Torch headers; never included by
// device code.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace moe_fp8 {

inline void check_rank(const at::Tensor& x, int64_t rank, const char* op, const char* name) {
  TORCH_CHECK(x.dim() == rank, op, ": expected ", name, " to be a ", rank, "-D tensor, got ", x.dim(), "-D");
}

// MOE_FP8_DEBUG=1 turns on content checks of GPU index tensors (they sync).
inline bool debug_checks() {
  static const bool on = [] {
    const char* v = std::getenv("MOE_FP8_DEBUG");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

// Whether the content of a (possibly GPU) index tensor is to be checked: always on
// the CPU, on a GPU only with MOE_FP8_DEBUG=1.
inline bool check_content(const at::Tensor& t) { return t.is_cpu() || debug_checks(); }

// An int32 1-D index tensor on the device of x.
inline void check_index_tensor(const at::Tensor& t, const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt, op, ": expected ", name, " of dtype int32, got ", t.scalar_type());
  check_rank(t, 1, op, name);
  TORCH_CHECK(t.device() == x.device(), op, ": expected ", name, " on ", x.device(), " (the device of x), got ",
              t.device());
}

// offs: int32 (G,) cumulative group ends in [0, rows], non-decreasing (DESIGN §3).
// The content is checked on the CPU, and on a GPU with MOE_FP8_DEBUG=1; the kernels
// clamp, so bad content on a GPU never reaches memory out of bounds.
inline void check_offs(const at::Tensor& offs, const at::Tensor& x, int64_t rows, const char* op) {
  check_index_tensor(offs, x, op, "offs");
  if (!check_content(offs)) return;
  const at::Tensor host = offs.cpu().contiguous();  // host-sync-ok: CPU or MOE_FP8_DEBUG only
  const int32_t* o = host.data_ptr<int32_t>();
  for (int64_t g = 0; g < host.numel(); ++g) {
    TORCH_CHECK(o[g] >= 0 && o[g] <= rows, op, ": expected offs[", g, "] in [0, ", rows, "], got ", o[g]);
    TORCH_CHECK(g == 0 || o[g] >= o[g - 1], op, ": expected non-decreasing offs, got offs[", g, "] = ", o[g],
                " < offs[", g - 1, "] = ", o[g - 1]);
  }
}

// A power of two in [1, 1024].
inline void check_alignment(int64_t alignment, const char* op) {
  TORCH_CHECK(alignment >= 1 && alignment <= 1024 && (alignment & (alignment - 1)) == 0, op,
              ": expected alignment to be a power of two in [1, 1024], got ", alignment);
}

}  // namespace moe_fp8
