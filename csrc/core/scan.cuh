// Block-wide exclusive prefix sums over a whole array (any length, one block), for
// the small offset tables of the token-group ops. Sums are taken in int64 and
// stored as int32 clamped to INT32_MAX.
#pragma once

#include <cstdint>

#include "portability.h"

namespace moe_fp8 {

// out[i] = sum of value_of(j) for j < i, for i in [0, n); returns the total. Every
// thread of the block must call it; `s_tmp` holds blockDim.x values. Each thread
// scans a contiguous strip, and the strip sums are scanned across the block.
template <typename Fn>
MOE_FP8_DEVICE int64_t block_exclusive_scan(Fn value_of, int n, int32_t* out, int64_t* s_tmp) {
  const int t = static_cast<int>(threadIdx.x);
  const int nt = static_cast<int>(blockDim.x);
  const int per = (n + nt - 1) / nt;
  const int lo = min(n, t * per);
  const int hi = min(n, lo + per);
  int64_t sum = 0;
  for (int i = lo; i < hi; ++i) sum += value_of(i);
  s_tmp[t] = sum;
  __syncthreads();
  for (int off = 1; off < nt; off <<= 1) {  // Hillis-Steele over the strip sums
    const int64_t v = t >= off ? s_tmp[t - off] : 0;
    __syncthreads();
    s_tmp[t] += v;
    __syncthreads();
  }
  int64_t run = s_tmp[t] - sum;
  const int64_t total = s_tmp[nt - 1];
  for (int i = lo; i < hi; ++i) {
    out[i] = static_cast<int32_t>(run < INT32_MAX ? run : INT32_MAX);
    run += value_of(i);
  }
  __syncthreads();
  return total;
}

}  // namespace moe_fp8
