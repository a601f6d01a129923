// Block-wide prefix scans over a whole array (any length, one block), for the small
// offset tables of the token-group ops and the swizzles. Values are taken in int64
// and stored as int32 clamped to INT32_MAX.
#pragma once

#include <cstdint>

#include "portability.h"
#include "reduce.cuh"

namespace moe_fp8 {

MOE_FP8_DEVICE int64_t scan_combine(bool is_max, int64_t a, int64_t b) { return is_max ? (a > b ? a : b) : a + b; }

// Scan of one value a thread in thread order (sum, or max of values >= 0): warp shuffles, then one warp scans the warp
// totals, two barriers at any block size. Returns this thread's exclusive value (0 for thread 0), *total the block's;
// s_warp holds kMaxWarpsPerBlock values; blockDim.x is a multiple of kWarpSize.
MOE_FP8_DEVICE int64_t block_exclusive_scan1(bool is_max, int64_t v, int64_t* total, int64_t* s_warp) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int nwarps = static_cast<int>(blockDim.x) / kWarpSize;
#pragma unroll
  for (int off = 1; off < kWarpSize; off <<= 1) {
    const int64_t u = warp_shfl_i64(v, lane - off);
    if (lane >= off) v = scan_combine(is_max, u, v);
  }
  if (lane == kWarpSize - 1) s_warp[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < nwarps ? s_warp[lane] : 0;
#pragma unroll
    for (int off = 1; off < kWarpSize; off <<= 1) {
      const int64_t u = warp_shfl_i64(w, lane - off);
      if (lane >= off) w = scan_combine(is_max, u, w);
    }
    if (lane < nwarps) s_warp[lane] = w;
  }
  __syncthreads();
  *total = s_warp[nwarps - 1];
  const int64_t before = warp > 0 ? s_warp[warp - 1] : 0;  // the warps before this one
  const int64_t left = warp_shfl_i64(v, lane - 1);          // within the warp, through lane - 1
  return lane > 0 ? scan_combine(is_max, before, left) : before;
}

// out[i] = the sum (kMax: max, values >= 0) of value_of(j), j < i (exclusive) or j <= i, for i < n; returns the total.
// Every thread of the block calls it; s_tmp holds kMaxWarpsPerBlock values. Threads scan contiguous strips, then the
// strip totals are scanned across the block.
template <bool kMax, typename Fn>
MOE_FP8_DEVICE int64_t block_scan(Fn value_of, int n, int32_t* out, bool exclusive, int64_t* s_tmp) {
  const int t = static_cast<int>(threadIdx.x);
  const int nt = static_cast<int>(blockDim.x);
  const int per = n / nt + (n % nt != 0);  // (n + nt - 1 overflows for n near 2^31)
  const int lo = min(n, t * per);
  const int hi = min(n, lo + per);
  int64_t acc = 0;
  for (int i = lo; i < hi; ++i) acc = scan_combine(kMax, acc, value_of(i));
  int64_t total = 0;
  int64_t run = block_exclusive_scan1(kMax, acc, &total, s_tmp);
  for (int i = lo; i < hi; ++i) {
    const int64_t next = scan_combine(kMax, run, value_of(i));
    const int64_t w = exclusive ? run : next;
    out[i] = static_cast<int32_t>(w < INT32_MAX ? w : INT32_MAX);
    run = next;
  }
  __syncthreads();
  return total;
}

template <typename Fn>
MOE_FP8_DEVICE int64_t block_exclusive_scan(Fn value_of, int n, int32_t* out, int64_t* s_tmp) {
  return block_scan<false>(value_of, n, out, true, s_tmp);
}

}  // namespace moe_fp8
