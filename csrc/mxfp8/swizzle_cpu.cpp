// CPU registration of the MXFP8 scale swizzles: loops over the same runs and per-byte
// functions as the GPU kernels (swizzle.h), so the CPU gives the GPU's bytes.
#include <torch/library.h>

#include <vector>

#include "swizzle_ops.h"

namespace moe_fp8 {
namespace {

void swizzle_cpu(const SwizzleArgs& a, bool to_blocked, int32_t* /*scratch*/, int /*device*/) {
  std::vector<int32_t> storage(3 * static_cast<size_t>(a.num_groups) + 1);
  SwizzleTables t;
  if (a.groups != SwizzleGroups::kNone) t = swizzle_host_tables(a, storage.data());
  if (to_blocked) {
    // the GPU's runs (swizzle_kernels.cuh), byte for byte: row rr of a quad's tile goes
    // to bytes 16 (rr % 32) + 4 (rr / 32) of it
    const SwizzleRunPlan p = swizzle_run_plan(a);
    for (int64_t run = 0; run < p.runs; ++run) {
      for (uint32_t qi = 0; qi < kSwizzleRunTiles; ++qi) {
        const SwizzleRunQuad q = swizzle_run_quad(a, t, p, static_cast<uint32_t>(run), qi);
        if (q.tile < 0) continue;
        for (int64_t rr = 0; rr < 128; ++rr) {
          const uint32_t w = rr < q.rows ? swizzle_load_quad(q.src + rr * a.sr + q.col0 * a.sc, a.sc, q.col0, q.cols, a.vec4) : 0u;
          const int64_t off = q.tile * 512 + (rr % 32) * 16 + (rr / 32) * 4;
          for (int j = 0; j < 4 && off + j < a.blocked_bytes; ++j) a.blocked_out[off + j] = static_cast<uint8_t>(w >> (8 * j));
        }
      }
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
