// Warp and block reductions of amax bits (unsigned max; see abs_bits in numerics.h),
// sized from the portable warp width so they hold for wave64 as well.
#pragma once

#include <cstdint>

#include "portability.h"

namespace moe_fp8 {

constexpr int kMaxWarpsPerBlock = 1024 / kWarpSize;

MOE_FP8_DEVICE uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

// 64-bit values through the 32-bit shuffles of portability.h, as two halves.
MOE_FP8_DEVICE int64_t warp_shfl_i64(int64_t v, int src_lane) {
  const uint64_t u = static_cast<uint64_t>(v);
  const uint32_t lo = warp_shfl(static_cast<uint32_t>(u), src_lane);
  const uint32_t hi = warp_shfl(static_cast<uint32_t>(u >> 32), src_lane);
  return static_cast<int64_t>((static_cast<uint64_t>(hi) << 32) | lo);
}

MOE_FP8_DEVICE int64_t warp_shfl_xor_i64(int64_t v, int lane_mask) {
  const uint64_t u = static_cast<uint64_t>(v);
  const uint32_t lo = warp_shfl_xor(static_cast<uint32_t>(u), lane_mask);
  const uint32_t hi = warp_shfl_xor(static_cast<uint32_t>(u >> 32), lane_mask);
  return static_cast<int64_t>((static_cast<uint64_t>(hi) << 32) | lo);
}

// Max over lanes whose index differs only in bits >= first_mask (xor butterfly).
MOE_FP8_DEVICE uint32_t warp_max_from(uint32_t v, int first_mask) {
#pragma unroll
  for (int m = kWarpSize / 2; m >= 1; m >>= 1) {
    if (m >= first_mask) v = umax(v, warp_shfl_xor(v, m));
  }
  return v;
}

// Max over the whole block; every thread gets the result. `smem` holds
// kMaxWarpsPerBlock + 1 words.
MOE_FP8_DEVICE uint32_t block_max(uint32_t v, uint32_t* smem) {
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int nwarps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  v = warp_max_from(v, 1);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    uint32_t w = lane < nwarps ? smem[lane] : 0u;
    w = warp_max_from(w, 1);
    if (lane == 0) smem[kMaxWarpsPerBlock] = w;
  }
  __syncthreads();
  return smem[kMaxWarpsPerBlock];
}

}  // namespace moe_fp8
