// CPU registration of the MXFP8 scale swizzles: loops over the same per-chunk and
// per-byte functions as the GPU kernels (swizzle.h), so the CPU gives the GPU's bytes.
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "swizzle_ops.h"

namespace moe_fp8 {
namespace {

void swizzle_cpu(const SwizzleArgs& a, bool to_blocked, int32_t* /*scratch*/, int /*device*/) {
  std::vector<int32_t> storage(3 * static_cast<size_t>(a.num_groups) + 1);
  SwizzleTables t;
  if (a.groups != SwizzleGroups::kNone) t = swizzle_host_tables(a, storage.data());
  if (to_blocked) {
    const int64_t chunks = (a.blocked_bytes + 15) / 16;
    for (int64_t u = 0; u < chunks; ++u) {
      uint8_t out[16];
      swizzle_to_blocked_chunk(a, t, u, out);
      const int64_t n = a.blocked_bytes - u * 16 < 16 ? a.blocked_bytes - u * 16 : 16;
      std::memcpy(a.blocked_out + u * 16, out, static_cast<size_t>(n));
    }
    return;
  }
  const int64_t n = a.E * a.R * a.C;
  for (int64_t i = 0; i < n; ++i) a.plain_out[i] = swizzle_from_blocked_byte(a, t, i);
}

}  // namespace

extern const SwizzleKernels kSwizzleCpu;
const SwizzleKernels kSwizzleCpu = {swizzle_cpu};

}  // namespace moe_fp8

TORCH_LIBRARY_IMPL(moe_fp8, CPU, m) { moe_fp8::SwizzleOn<moe_fp8::kSwizzleCpu>::register_impls(m); }
