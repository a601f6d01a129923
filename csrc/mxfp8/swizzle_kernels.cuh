// GPU kernels of the MXFP8 scale swizzles (swizzle.h). Torch-free: raw pointers,
// sizes and a stream.
//
// to_blocked: one thread per 16 bytes of the blocked buffer (one row r % 32 of a
// 128x4 tile: 4 rows x 4 columns gathered from the plain matrix), in the warp order of
// swizzle_chunk_of, a grid-stride loop, 16-byte stores; the whole buffer is written
// once, padding included (no memset).
// from_blocked: one thread per 4 bytes of the plain output.
// Token groups: each block builds the group tables (clamped ends, prefix of the padded
// sizes, K-group reach) from offs in shared memory before its loop, so there is one
// launch and no host sync. Above kSwizzleSmemGroups groups a one-block kernel builds
// the same tables in a global scratch buffer first (two launches, still no sync).
#pragma once

#include <cstdint>

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

// to_blocked's thread order. Chunk u (16 bytes: row u % 32 of tile u / 32) gathers 4
// bytes from each of 4 rows 32 apart. A warp takes 8 consecutive tiles x 4 consecutive
// rows of them: consecutive tiles are (mostly) consecutive column quads of the same
// rows, so each load instruction reads 4 rows x 32 contiguous bytes, and each store
// instruction writes 8 runs of 64 contiguous bytes. (One warp per tile, the plain
// order, reads 32 rows per load: 8x the sectors.)
MOE_FP8_HD int64_t swizzle_to_blocked_work(int64_t chunks) {
  const int64_t tiles = (chunks + 31) / 32;
  return (tiles + 7) / 8 * 8 * 32;
}
MOE_FP8_DEVICE int64_t swizzle_chunk_of(int64_t v) {
  const int64_t tile = (v >> 8) * 8 + (v & 7);   // 8 tiles per 256 threads
  const int64_t row = ((v >> 5) & 7) * 4 + ((v >> 3) & 3);  // warp (v >> 5) & 7: rows 4w..4w+3
  return tile * 32 + row;
}

template <SwizzleGroups kGroups>
__global__ void __launch_bounds__(kSwizzleThreads) to_blocked_kernel(SwizzleArgs a, const int32_t* tables) {
  extern __shared__ int32_t s_tables[];
  __shared__ int64_t s_tmp[kMaxWarpsPerBlock];
  a.groups = kGroups;
  SwizzleTables t;
  if (kGroups != SwizzleGroups::kNone) t = swizzle_tables(a, tables, false, s_tables, s_tmp);
  (void)s_tmp;
  const int64_t chunks = (a.blocked_bytes + 15) / 16;
  const int64_t work = swizzle_to_blocked_work(chunks);
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < work;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t u = swizzle_chunk_of(v);
    if (u >= chunks) continue;
    alignas(16) uint8_t out[16];
    swizzle_to_blocked_chunk(a, t, u, out);
    uint8_t* d = a.blocked_out + u * 16;
    if (u * 16 + 16 <= a.blocked_bytes) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(out);
    } else {
      for (int64_t j = 0; j < a.blocked_bytes - u * 16; ++j) d[j] = out[j];
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
  const int64_t work =
      to_blocked ? swizzle_to_blocked_work((a.blocked_bytes + 15) / 16) : (a.E * a.R * a.C + 3) / 4;
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
  const dim3 grid(swizzle_grid(work)), block(kSwizzleThreads);
  if (to_blocked) return launch_kernel(to_blocked_kernel<kGroups>, grid, block, smem, stream, 1, a, tables);
  return launch_kernel(from_blocked_kernel<kGroups>, grid, block, smem, stream, 1, a, tables);
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
