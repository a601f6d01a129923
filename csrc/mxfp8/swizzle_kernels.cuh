// GPU kernels of the MXFP8 scale swizzles (swizzle.h), torch-free. to_blocked: a block per run of tiles, staged in
// shared memory, the whole buffer written once, padding included (no memset); from_blocked: a thread per 4 plain
// bytes. With token groups each block builds the group tables from offs itself: one launch, no host sync.
#pragma once

#include <cstdint>

#include "../core/device_runtime.h"
#include "../core/portability.h"
#include "../core/scan.cuh"
#include "swizzle.h"

namespace moe_fp8 {

constexpr int kSwizzleThreads = 256;

// The tables of swizzle.h for a's groups into ends[G], start[G + 1], reach[G] (reach
// only when `with_reach`), by the whole block.
MOE_FP8_DEVICE void swizzle_block_tables(const SwizzleArgs& a, int32_t* ends, int32_t* start, int32_t* reach,
                                         bool with_reach, int64_t* s_tmp) {
  const int G = a.num_groups;
  const int64_t limit = swizzle_limit(a);
  for (int g = threadIdx.x; g < G; g += blockDim.x) ends[g] = swizzle_clamp_end(a.offs[g], limit);
  __syncthreads();
  SwizzleTables t;
  t.ends = ends;
  t.groups = G;
  const SwizzleGroups kind = a.groups;
  const int64_t total = block_scan<false>(
      [&](int g) {
        int64_t lo, hi;
        swizzle_group(t, g, &lo, &hi);
        return swizzle_padded_size(kind, lo, hi);
      },
      G, start, true, s_tmp);
  if (threadIdx.x == 0) start[G] = static_cast<int32_t>(total < INT32_MAX ? total : INT32_MAX);
  if (with_reach) {
    block_scan<true>(
        [&](int g) {
          int64_t lo, hi;
          swizzle_group(t, g, &lo, &hi);
          return swizzle_reach(lo, hi);
        },
        G, reach, false, s_tmp);
  }
  __syncthreads();
}

// Builds the tables (3G + 1 int32: ends, start, reach) in global memory: one block.
__global__ void __launch_bounds__(1024) swizzle_tables_kernel(SwizzleArgs a, int32_t* tables, bool with_reach) {
  __shared__ int64_t s_tmp[kMaxWarpsPerBlock];
  const int G = a.num_groups;
  swizzle_block_tables(a, tables, tables + G, tables + 2 * G + 1, with_reach, s_tmp);
}

// The tables of this block: `global` (3G + 1 int32) if given, else built in shared memory.
MOE_FP8_DEVICE SwizzleTables swizzle_tables(const SwizzleArgs& a, const int32_t* global, bool with_reach,
                                            int32_t* smem, int64_t* s_tmp) {
  const int G = a.num_groups;
  const int32_t* base = global;
  if (base == nullptr) {
    swizzle_block_tables(a, smem, smem + G, smem + 2 * G + 1, with_reach, s_tmp);
    base = smem;
  }
  SwizzleTables t;
  t.ends = base;
  t.start = base + G;
  t.reach = base + 2 * G + 1;
  t.groups = G;
  return t;
}

// ---- to_blocked: runs of tiles staged in shared memory ----------------------------

// A block stages its run's 128 plain rows x 4 bytes a quad in shared memory (4-byte async copies, a warp over one row's
// quads; an unaligned K-group quad as its two aligned words, shifted when written), then each warp writes whole tiles,
// a lane a 16-byte tile row. Without vec4, and where a row ends inside a quad, bytes are read one by one (record 030).
constexpr int kSwizzleRunStride = kSwizzleRunTiles + 1;  // words per staged row: odd, so
                                                          // neither phase has a bank conflict
constexpr int kSwizzleRunRowsPerPass = kSwizzleThreads / kSwizzleRunTiles;
static_assert(kSwizzleThreads % kSwizzleRunTiles == 0 && 128 % kSwizzleRunRowsPerPass == 0, "run geometry");

template <SwizzleGroups kGroups>
__global__ void __launch_bounds__(kSwizzleThreads) to_blocked_kernel(SwizzleArgs a, SwizzleRunPlan p,
                                                                     const int32_t* tables) {
  constexpr bool kShifts = kGroups == SwizzleGroups::kKGroups;  // unaligned quads exist
  extern __shared__ int32_t s_tables[];
  __shared__ int64_t s_tmp[kMaxWarpsPerBlock];
  __shared__ uint32_t lo[128 * kSwizzleRunStride];
  __shared__ uint32_t hi[kShifts ? 128 * kSwizzleRunStride : 1];
  __shared__ int64_t s_tile[kSwizzleRunTiles];
  __shared__ uint32_t s_fix[kSwizzleRunTiles];  // a quad's byte shift | its valid bytes << 8
  a.groups = kGroups;
  SwizzleTables t;
  if (kGroups != SwizzleGroups::kNone) t = swizzle_tables(a, tables, false, s_tables, s_tmp);
  (void)s_tmp;
  const uint32_t qi = threadIdx.x % kSwizzleRunTiles;
  const SwizzleRunQuad q = swizzle_run_quad(a, t, p, blockIdx.x, qi);
  const int64_t left = q.tile >= 0 ? q.cols - q.col0 : 0;
  const uint32_t nb = left <= 0 ? 0u : (left < 4 ? static_cast<uint32_t>(left) : 4u);  // valid bytes
  // Word access: the aligned words holding the nb bytes lie inside the row's C bytes.
  const uint32_t shift = a.vec4 ? static_cast<uint32_t>(q.plain_col & 3) : 0u;
  const int64_t first_word = q.plain_col - shift;
  const bool two = shift + nb > 4;
  const bool words = a.vec4 && nb > 0 && first_word + (two ? 8 : 4) <= a.C;
  if (threadIdx.x < kSwizzleRunTiles) {
    s_tile[qi] = q.tile;
    s_fix[qi] = (words ? shift : 0u) | (nb << 8);
  }
  const int r0 = static_cast<int>(threadIdx.x) / kSwizzleRunTiles;
  constexpr int kPasses = 128 / kSwizzleRunRowsPerPass;
  if (words || nb == 0) {
    const uint8_t* w0 = q.src + (first_word - q.plain_col + q.col0);  // sc == 1 here
#pragma unroll
    for (int k = 0; k < kPasses; ++k) {
      const int rr = r0 + k * kSwizzleRunRowsPerPass;
      const bool ok = nb > 0 && rr < q.rows;
      const uint8_t* src = w0 + static_cast<int64_t>(rr) * a.sr;
      async_copy_4_or_zero(&lo[rr * kSwizzleRunStride + qi], src, ok);
      if (kShifts) async_copy_4_or_zero(&hi[rr * kSwizzleRunStride + qi], src + 4, ok && two);
    }
    async_copy_commit();
  } else {
    for (int k = 0; k < kPasses; ++k) {
      const int rr = r0 + k * kSwizzleRunRowsPerPass;
      lo[rr * kSwizzleRunStride + qi] =
          rr < q.rows ? swizzle_load_quad(q.src + rr * a.sr + q.col0 * a.sc, a.sc, q.col0, q.cols, false) : 0u;
      if (kShifts) hi[rr * kSwizzleRunStride + qi] = 0u;
    }
  }
  async_copy_wait_all();
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize, warp = static_cast<int>(threadIdx.x) / kWarpSize;
  for (int tq = warp; tq < kSwizzleRunTiles; tq += kSwizzleThreads / kWarpSize) {
    const int64_t tile = s_tile[tq];
    if (tile < 0) continue;
    const uint32_t fix = s_fix[tq], sh = fix & 3u, n = fix >> 8;
    const uint32_t mask = n >= 4 ? 0xFFFFFFFFu : (1u << (8 * n)) - 1u;
    uint32_t v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int at = (lane + 32 * i) * kSwizzleRunStride + tq;
      uint32_t x = lo[at];
      if (kShifts && sh != 0) x = static_cast<uint32_t>(((static_cast<uint64_t>(hi[at]) << 32) | x) >> (8 * sh));
      v[i] = x & mask;
    }
    const int64_t off = tile * 512 + int64_t{lane} * 16;
    if (off + 16 <= a.blocked_bytes) {
      *reinterpret_cast<uint4*>(a.blocked_out + off) = make_uint4(v[0], v[1], v[2], v[3]);
    } else {  // the static tail of an M-group buffer ends inside a tile
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        if (off + j < a.blocked_bytes) a.blocked_out[off + j] = static_cast<uint8_t>(v[j / 4] >> (8 * (j % 4)));
      }
    }
  }
}

template <SwizzleGroups kGroups>
__global__ void __launch_bounds__(kSwizzleThreads) from_blocked_kernel(SwizzleArgs a, const int32_t* tables) {
  extern __shared__ int32_t s_tables[];
  __shared__ int64_t s_tmp[kMaxWarpsPerBlock];
  a.groups = kGroups;
  SwizzleTables t;
  if (kGroups != SwizzleGroups::kNone) t = swizzle_tables(a, tables, kGroups == SwizzleGroups::kKGroups, s_tables, s_tmp);
  (void)s_tmp;
  const int64_t n = a.E * a.R * a.C;
  const int64_t quads = (n + 3) / 4;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < quads;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i0 = q * 4;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (i0 + j < n) a.plain_out[i0 + j] = swizzle_from_blocked_byte(a, t, i0 + j);
    }
  }
}

// Host launchers: 0 on success, the launch error otherwise. `scratch` (3G + 1 int32 of
// device memory) is used only above kSwizzleSmemGroups groups.
inline int swizzle_grid(int64_t work) {
  const int64_t want = (work + kSwizzleThreads - 1) / kSwizzleThreads;
  const int64_t cap = static_cast<int64_t>(multiprocessor_count()) * 16;
  return static_cast<int>(want < 1 ? 1 : (want < cap ? want : cap));
}

template <SwizzleGroups kGroups>
inline int launch_swizzle_kind(const SwizzleArgs& a, bool to_blocked, int32_t* scratch, gpuStream_t stream) {
  const SwizzleRunPlan plan = to_blocked ? swizzle_run_plan(a) : SwizzleRunPlan{};
  const int64_t work = to_blocked ? plan.runs : (a.E * a.R * a.C + 3) / 4;
  if (work == 0) return 0;
  const int32_t* tables = nullptr;
  size_t smem = 0;
  if (kGroups != SwizzleGroups::kNone) {
    if (a.num_groups > kSwizzleSmemGroups) {
      const int err = launch_kernel(swizzle_tables_kernel, dim3(1), dim3(1024), 0, stream, 1, a, scratch,
                                    kGroups == SwizzleGroups::kKGroups);
      if (err != 0) return err;
      tables = scratch;
    } else {
      smem = (3 * static_cast<size_t>(a.num_groups) + 1) * sizeof(int32_t);
    }
  }
  const dim3 block(kSwizzleThreads);
  // one run a block: runs <= tiles < 2^31 (kSwizzleMaxBlockedBytes)
  if (to_blocked) return launch_kernel(to_blocked_kernel<kGroups>, dim3(static_cast<uint32_t>(work)), block, smem, stream, 1, a, plan, tables);
  return launch_kernel(from_blocked_kernel<kGroups>, dim3(swizzle_grid(work)), block, smem, stream, 1, a, tables);
}

inline int launch_swizzle(const SwizzleArgs& a, bool to_blocked, int32_t* scratch, gpuStream_t stream) {
  switch (a.groups) {
    case SwizzleGroups::kMGroups:
      return launch_swizzle_kind<SwizzleGroups::kMGroups>(a, to_blocked, scratch, stream);
    case SwizzleGroups::kKGroups:
      return launch_swizzle_kind<SwizzleGroups::kKGroups>(a, to_blocked, scratch, stream);
    default:
      return launch_swizzle_kind<SwizzleGroups::kNone>(a, to_blocked, scratch, stream);
  }
}

}  // namespace moe_fp8
