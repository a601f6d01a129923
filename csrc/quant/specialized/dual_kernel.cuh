// Specialized (FP8 rowwise weights, DESIGN §5): per expert X, q_rows (a scale per row) and q_cols = X^T (a scale per
// column) from one DRAM read, bit-exact with quantize_experts_fwd_cat / _bwd_cat. Both need whole rows and columns first:
// pass A folds each tile into amax arrays, pass B re-reads it from L2 and writes. Torch-free, hipified as is.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../../core/device_runtime.h"
#include "../../core/groups.h"
#include "../../core/numerics.h"
#include "../../core/portability.h"
#include "../../core/reduce.cuh"
#include "../../core/scan.cuh"
#include "../../core/vec.cuh"
#include "../engine.h"

namespace moe_fp8 {

// Tile 128 x 128 of 2-byte inputs, 256 threads, two blocks an SM; thread t: rows 8 (t / 16) .. +7, columns 8 (t % 16) .. +7
// (a half-warp reads one 256-byte tile row). The next tile arrives by async copies into the other of two smem stages.
constexpr int kDualTile = 128;
constexpr int kDualThreads = 256;
constexpr int kDualChunks = kDualTile / 8;  // 8-column chunks (and 8-row groups) a tile

// Ticket u -> (second pass?, expert, tile): A(0..L-1), then A(L) B(0), A(L+1) B(1), ..., then B(E-L..E-1), each the
// tiles of one expert, so an expert is re-read from L2 while the L after it are read first (lag L: launcher, L2 budget).
struct DualTask {
  bool second;
  int expert, tile;
};

// (32-bit: the launcher keeps the ticket count below 2^31; a 64-bit division costs tens
// of instructions, and this runs twice a tile.)
MOE_FP8_HD DualTask dual_task(int u, int tiles, int experts, int lag) {
  const int head = lag * tiles;
  if (u < head) return {false, u / tiles, u % tiles};
  const int v = u - head, body = 2 * tiles * (experts - lag);
  if (v < body) {
    const int j = lag + v / (2 * tiles), w = v % (2 * tiles);
    return w < tiles ? DualTask{false, j, w} : DualTask{true, j - lag, w - tiles};
  }
  const int t = v - body;
  return {true, experts - lag + t / tiles, t % tiles};
}

template <Fp8Format F>
MOE_FP8_DEVICE uint2 dual_pack8(const float (&f)[8], float s) {
  uint32_t w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t lo = scaled_fp8x2<F>(f[4 * h], f[4 * h + 1], s);
    const uint32_t hi = scaled_fp8x2<F>(f[4 * h + 2], f[4 * h + 3], s);
    w[h] = lo | (hi << 16);
  }
  return make_uint2(w[0], w[1]);
}

constexpr int kDualStageBytes = kDualTile * kDualTile * 2;  // one 2-byte input tile
constexpr int kDualSmemBytes = 2 * kDualStageBytes + kDualTile * kDualTile;  // two stages, the q_cols tile
// One tile of one pass, resolved from its ticket by a schedule: its input rows, the outputs and amax words it owns, what
// it waits for. Tile-local indices: input row i < nr is row r0 + i of the schedule's row space, column j < nc is c0 + j;
// q_cols rows count from the tile's first q row.
struct DualJob {
  bool second;              // the second pass (else the first)
  bool first_row_tile;      // the tile writes its columns' scales
  bool first_col_tile;      // ... its rows' scales
  int nr, nc;               // valid input rows, columns
  uint32_t need;            // first-pass tiles of the tile's set (expert or group)
  uint32_t* done;           // that set's counter of finished first-pass tiles
  uint32_t* amax_rows;      // of row i at [i]
  uint32_t* amax_cols;      // of column j at [j]
  float* s_rows;            // [i]
  float* s_cols;            // [j]
  uint8_t* q_rows;          // (i, j) at q_rows + i * q_rows_stride + j
  int64_t q_rows_stride;
  uint8_t* q_cols;          // (j, q row i) at q_cols + j * q_cols_stride + i
  int64_t q_cols_stride;
};

// The kernel's static shared memory (s_colmax, s_enc, s_ticket below): with the dynamic part,
// what a device must give one block (dual_smem_ok).
constexpr int kDualStaticSmemBytes = 16 * (kDualThreads / 32) * (kDualTile / 4) + 16 * 2 * (kDualTile / 4) + 4 * 3;

inline bool dual_smem_ok(int device) {
  return max_dynamic_smem_per_block(device) >= kDualSmemBytes + kDualStaticSmemBytes;
}

// Max over the 16 lanes of a half-warp (the column chunks of one row group).
MOE_FP8_DEVICE uint32_t dual_max16(uint32_t m) {
#pragma unroll
  for (int s = 1; s < kDualChunks; s <<= 1) m = umax(m, warp_shfl_xor(m, s));
  return m;
}

// Pass A of a tile in `in` (rows 8 rg.., columns 8 cc..): row maxima over its columns, then its half-warp; column maxima
// over its rows, the row group 16 lanes away, the eight warps via shared memory; folded in by atomic max of abs bits
// (NaN-propagating, order-free: the plain amax). Ends with the release of the set's counter.
template <InputKind K>
MOE_FP8_DEVICE void dual_first_pass(const uint8_t* in, const DualJob& j, int rg, int cc,
                                    uint4 (*s_colmax)[kDualTile / 4]) {
  uint32_t rmax[8], cmax[8];
  if constexpr (K == InputKind::kBF16) {
    // On the bf16 patterns, two at a time: |x| is the pattern without its sign bit,
    // and for non-negative bf16 the unsigned order is the order of the fp32 bits it
    // widens to (NaN above +Inf), so packed 16-bit maxima give the amax bits.
    uint32_t cm[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint4 v = *reinterpret_cast<const uint4*>(in + k * (2 * kDualTile));
      const uint32_t w[4] = {v.x & 0x7FFF7FFFu, v.y & 0x7FFF7FFFu, v.z & 0x7FFF7FFFu, v.w & 0x7FFF7FFFu};
      const uint32_t rm = umax_u16x2(umax_u16x2(w[0], w[1]), umax_u16x2(w[2], w[3]));
#pragma unroll
      for (int q = 0; q < 4; ++q) cm[q] = umax_u16x2(cm[q], w[q]);
      rmax[k] = umax(rm & 0xFFFFu, rm >> 16) << 16;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      cmax[2 * q] = cm[q] << 16;
      cmax[2 * q + 1] = cm[q] & 0xFFFF0000u;
    }
  } else {
    // fp16: on the widened values (the fp32 bits of a NaN are not ordered as its
    // fp16 pattern), as the single ops reduce them.
#pragma unroll
    for (int q = 0; q < 8; ++q) cmax[q] = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint4 v = *reinterpret_cast<const uint4*>(in + k * (2 * kDualTile));
      rmax[k] = 0;
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const uint32_t b = abs_bits(uint4_elem<K>(v, q));
        cmax[q] = umax(cmax[q], b);
        rmax[k] = umax(rmax[k], b);
      }
    }
  }
  uint32_t mine = 0;  // lane cc < 8: the max of row 8 rg + cc
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint32_t m = dual_max16(rmax[k]);
    mine = cc == k ? m : mine;
  }
  if (cc < 8 && 8 * rg + cc < j.nr) atomicMax(j.amax_rows + 8 * rg + cc, mine);
  {
#pragma unroll
    for (int q = 0; q < 8; ++q) cmax[q] = umax(cmax[q], warp_shfl_xor(cmax[q], kDualChunks));
    if (rg % 2 == 0) {
      s_colmax[rg / 2][2 * cc] = make_uint4(cmax[0], cmax[1], cmax[2], cmax[3]);
      s_colmax[rg / 2][2 * cc + 1] = make_uint4(cmax[4], cmax[5], cmax[6], cmax[7]);
    }
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < j.nc) {
      uint32_t m = 0;
#pragma unroll
      for (int w = 0; w < kDualThreads / 32; ++w) m = umax(m, reinterpret_cast<const uint32_t*>(s_colmax[w])[threadIdx.x]);
      atomicMax(j.amax_cols + threadIdx.x, m);
    }
  }
  __syncthreads();  // every atomic of the tile is issued (the release below is cumulative)
  if (threadIdx.x == 0) atomic_add_release(j.done, 1u);
}

// Pass B of a tile in `in`: the multipliers of its 128 rows and 128 columns (one a thread; amax arrays read through L2,
// other blocks wrote them with atomics), their scales, both outputs. Uses the q_cols tile and s_enc; ends before the
// barrier that frees them.
template <InputKind K, Fp8Format F, class Rule>
MOE_FP8_DEVICE void dual_second_pass(const uint8_t* in, const DualJob& j, int rg, int cc, float4 (*s_enc)[kDualTile / 4],
                                     uint8_t* q_cols_tile) {
  {
    const int i = threadIdx.x % kDualTile;
    const bool col = threadIdx.x >= kDualTile;
    const bool valid = i < (col ? j.nc : j.nr);
    const auto sc = Rule::template from_amax_bits<F>(valid ? load_l2((col ? j.amax_cols : j.amax_rows) + i) : 0u);
    reinterpret_cast<float*>(s_enc[col ? 1 : 0])[i] = sc.encode;
    if (valid && (col ? j.first_row_tile : j.first_col_tile)) (col ? j.s_cols : j.s_rows)[i] = sc.stored;
  }
  __syncthreads();
  const float4 er0 = s_enc[0][2 * rg], er1 = s_enc[0][2 * rg + 1];
  const float4 ec0 = s_enc[1][2 * cc], ec1 = s_enc[1][2 * cc + 1];
  const float enc_r[8] = {er0.x, er0.y, er0.z, er0.w, er1.x, er1.y, er1.z, er1.w};
  const float enc_c[8] = {ec0.x, ec0.y, ec0.z, ec0.w, ec1.x, ec1.y, ec1.z, ec1.w};
  // Both outputs, two rows at a time.
  const uint64_t out_policy = l2_policy(false);  // not read again here: evicted first, before the inputs
  const bool col_ok = 8 * cc < j.nc;             // this thread's eight columns
  uint8_t* qr = j.q_rows + (8 * rg) * j.q_rows_stride + 8 * cc;
  uint32_t wc[8][2];  // q_cols: column q's bytes of this thread's eight rows
#pragma unroll
  for (int k = 0; k < 8; k += 2) {
    const uint4 v0 = *reinterpret_cast<const uint4*>(in + k * (2 * kDualTile));
    const uint4 v1 = *reinterpret_cast<const uint4*>(in + (k + 1) * (2 * kDualTile));
    float f0[8], f1[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      f0[q] = uint4_elem<K>(v0, q);
      f1[q] = uint4_elem<K>(v1, q);
    }
    // q_rows straight out: a half-warp stores 128 contiguous bytes of one row.
    if (8 * rg + k < j.nr && col_ok) store_8_hint(qr + k * j.q_rows_stride, dual_pack8<F>(f0, enc_r[k]), out_policy);
    if (8 * rg + k + 1 < j.nr && col_ok) {
      store_8_hint(qr + (k + 1) * j.q_rows_stride, dual_pack8<F>(f1, enc_r[k + 1]), out_policy);
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const uint32_t two = scaled_fp8x2<F>(f0[q], f1[q], enc_c[q]);
      if (k % 4 == 0) {
        wc[q][k / 4] = two;
      } else {
        wc[q][k / 4] |= two << 16;
      }
    }
  }
  // Column row c holds 16 eight-byte slots (row groups), slot g at g ^ (c / 8 % 16):
  // the 16 column chunks of a half-warp's store hit 16 different slots.
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    *reinterpret_cast<uint2*>(q_cols_tile + (8 * cc + q) * kDualTile + 8 * (rg ^ cc)) = make_uint2(wc[q][0], wc[q][1]);
  }
  __syncthreads();
  // q_cols out: 16-byte chunks, eight threads a 128-byte row; chunk ch (slots 2 ch, 2 ch + 1) is physical chunk
  // ch ^ (s / 2), its halves swapped when s is odd. A partial or unaligned chunk (a tile's last rows) goes byte by byte.
  constexpr int kOutChunks = kDualTile / 16;
#pragma unroll
  for (int n = 0; n < kDualTile * kOutChunks / kDualThreads; ++n) {
    const int idx = threadIdx.x + n * kDualThreads;
    const int row = idx / kOutChunks, ch = idx % kOutChunks;
    if (row < j.nc && 16 * ch < j.nr) {
      const int sw = (row / 8) % kDualChunks;
      uint4 q = *reinterpret_cast<const uint4*>(q_cols_tile + row * kDualTile + 16 * (ch ^ (sw / 2)));
      if (sw % 2) q = make_uint4(q.z, q.w, q.x, q.y);
      uint8_t* dst = j.q_cols + row * j.q_cols_stride + 16 * ch;
      if (16 * ch + 16 <= j.nr && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
        store_16_hint(dst, q, out_policy);
      } else {
        for (int b = 0; b < 16 && 16 * ch + b < j.nr; ++b) {
          const uint32_t w = b < 4 ? q.x : (b < 8 ? q.y : (b < 12 ? q.z : q.w));  // (no local array)
          dst[b] = static_cast<uint8_t>(w >> (8 * (b % 4)));
        }
      }
    }
  }
}

// The persistent two-pass loop over a schedule's tickets (dual_task); Sched gives total(), job(u), prologue(). A block
// waits only in its current ticket, for first-pass tiles below it, and the lowest unfinished ticket is some running
// block's current one: no deadlock at any grid size.
template <InputKind K, Fp8Format F, class Rule, class Sched>
__global__ void __launch_bounds__(kDualThreads, 2) quantize_dual_kernel(Sched sched) {
  static_assert(sizeof(typename DeviceInput<K>::storage) == 2, "the dual kernel reads 2-byte inputs");
  extern __shared__ uint4 smem_dual[];
  uint8_t* stages = reinterpret_cast<uint8_t*>(smem_dual);  // [2][128 rows][256 bytes]
  uint8_t* q_cols_tile = stages + 2 * kDualStageBytes;      // [128 columns][16 slots of 8 rows], swizzled
  // Pass A: a column's max per row-group pair (per warp); pass B: the tile's row and
  // column multipliers.
  __shared__ uint4 s_colmax[kDualThreads / 32][kDualTile / 4];
  __shared__ float4 s_enc[2][kDualTile / 4];  // [0]: rows, [1]: columns
  __shared__ int s_ticket[3];
  const int total = sched.total();
  uint32_t* ticket = sched.ticket();
  const int cc = threadIdx.x % kDualChunks, rg = threadIdx.x / kDualChunks;
  auto issue = [&](int u, uint8_t* stage) { sched.issue(u, total, stage, rg, cc); };
  // Tickets run two ahead: the current tile, the next (its copy in flight while this
  // one is worked on), and the one after (its number arriving meanwhile).
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i) {
      s_ticket[i] = static_cast<int>(atomicAdd(ticket, 1u));
    }
  }
  __syncthreads();
  issue(s_ticket[0], stages);
  async_copy_commit();
  sched.template prologue<F, Rule>();
  for (int it = 0;; ++it) {
    const int u = s_ticket[it % 3];
    if (u >= total) break;  // (every later ticket is past the end too)
    issue(s_ticket[(it + 1) % 3], stages + ((it + 1) & 1) * kDualStageBytes);
    async_copy_commit();
    uint32_t after_next = 0;
    if (threadIdx.x == 0) {
      after_next = atomicAdd(ticket, 1u);  // stored at the end of the iteration
    }
    const DualJob j = sched.job(u);
    if (j.second && threadIdx.x == 0) {
      while (load_acquire(j.done) < j.need) spin_pause();
    }
    async_copy_wait<1>();  // this thread's part of the current stage has landed
    __syncthreads();       // ... and every thread's; the set's amaxes are final (pass B)
    const uint8_t* in = stages + (it & 1) * kDualStageBytes + (8 * rg) * (2 * kDualTile) + 16 * cc;
    if (!j.second) {
      dual_first_pass<K>(in, j, rg, cc, s_colmax);
    } else {
      dual_second_pass<K, F, Rule>(in, j, rg, cc, s_enc, q_cols_tile);
    }
    if (threadIdx.x == 0) s_ticket[(it + 2) % 3] = static_cast<int>(after_next);
    __syncthreads();  // the stage, the q_cols tile and s_enc are free again; the ticket after next is visible
  }
  async_copy_wait<0>();
}

// ---- a weight's two orientations (DualArgs) -----------------------------------------
struct DualExpertsSchedule {
  DualArgs a;
  int tiles_r, tiles_c;
  MOE_FP8_DEVICE int tiles() const { return tiles_r * tiles_c; }
  MOE_FP8_DEVICE int total() const { return 2 * static_cast<int>(a.experts) * tiles(); }
  MOE_FP8_DEVICE uint32_t* ticket() const { return a.work + a.experts * (a.rows + a.cols) + a.experts; }
  template <Fp8Format F, class Rule>
  MOE_FP8_DEVICE void prologue() const {}
  // The input tile of ticket u into a stage (zeros past the matrix). The second pass's
  // read is the tile's last use: marked evict-first in L2 (the first pass's keeps the
  // normal priority: an evict-last hint was no better, record 030).
  MOE_FP8_DEVICE void issue(int u, int total, uint8_t* stage, int rg, int cc) const {
    if (u >= total) return;
    const DualTask task = dual_task(u, tiles(), static_cast<int>(a.experts), static_cast<int>(a.lag));
    const uint64_t policy = l2_policy(false);
    const int64_t e = task.expert;
    const int64_t r0 = static_cast<int64_t>(task.tile / tiles_c) * kDualTile;
    const int64_t c = static_cast<int64_t>(task.tile % tiles_c) * kDualTile + 8 * cc;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t r = r0 + 8 * rg + k;
      uint8_t* dst = stage + (8 * rg + k) * (2 * kDualTile) + 16 * cc;
      if (r < a.rows && c < a.cols) {
        // (no dynamic index into the parameter arrays: that makes a stack copy)
        const uint16_t* p = r < a.row_split
                                ? static_cast<const uint16_t*>(a.x[0]) + e * a.x_se[0] + r * a.x_sr[0] + c
                                : static_cast<const uint16_t*>(a.x[1]) + e * a.x_se[1] + (r - a.row_split) * a.x_sr[1] + c;
        if (task.second) {
          async_copy_16_hint(dst, p, policy);
        } else {
          async_copy_16(dst, p);
        }
      } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);  // past the matrix: never the amax
      }
    }
  }
  MOE_FP8_DEVICE DualJob job(int u) const {
    const DualTask t = dual_task(u, tiles(), static_cast<int>(a.experts), static_cast<int>(a.lag));
    const int64_t e = t.expert;
    const int64_t r0 = static_cast<int64_t>(t.tile / tiles_c) * kDualTile;
    const int64_t c0 = static_cast<int64_t>(t.tile % tiles_c) * kDualTile;
    DualJob j;
    j.second = t.second;
    j.first_row_tile = r0 == 0;
    j.first_col_tile = c0 == 0;
    j.nr = static_cast<int>(a.rows - r0 < kDualTile ? a.rows - r0 : kDualTile);
    j.nc = static_cast<int>(a.cols - c0 < kDualTile ? a.cols - c0 : kDualTile);
    j.need = static_cast<uint32_t>(tiles());
    uint32_t* amax_rows = a.work;
    uint32_t* amax_cols = amax_rows + a.experts * a.rows;
    j.done = amax_cols + a.experts * a.cols + e;
    j.amax_rows = amax_rows + e * a.rows + r0;
    j.amax_cols = amax_cols + e * a.cols + c0;
    j.s_rows = a.s_rows + e * a.rows + r0;
    j.s_cols = a.s_cols + e * a.cols + c0;
    j.q_rows = a.q_rows + (e * a.rows + r0) * a.cols + c0;
    j.q_rows_stride = a.cols;
    j.q_cols = a.q_cols + (e * a.cols + c0) * a.rows + r0;
    j.q_cols_stride = a.rows;
    return j;
  }
};

template <InputKind K, Fp8Format F, class Rule>
int launch_quantize_dual(DualArgs a, int64_t resident, int64_t l2_budget, gpuStream_t stream) {
  const int64_t tiles_r = ceil_div(a.rows, kDualTile), tiles_c = ceil_div(a.cols, kDualTile);
  const int64_t tiles = tiles_r * tiles_c;
  // 32-bit tickets, with room for the two each block takes past the end
  if (2 * a.experts * tiles + 3 * resident >= (int64_t{1} << 31)) return -1;
  const int64_t expert_bytes = a.rows * a.cols * 2;
  // Enough lag that the blocks of one expert's second pass seldom wait for its first,
  // no more than the L2 budget holds.
  int64_t lag = ceil_div(resident, tiles);
  const int64_t fit = l2_budget / expert_bytes - 1;
  lag = lag > fit ? fit : lag;
  lag = lag < 1 ? 1 : (lag > a.experts ? a.experts : lag);
  a.lag = lag;
  const int64_t blocks = resident < 2 * a.experts * tiles ? resident : 2 * a.experts * tiles;
  const DualExpertsSchedule sched{a, static_cast<int>(tiles_r), static_cast<int>(tiles_c)};
  return launch_kernel(quantize_dual_kernel<K, F, Rule, DualExpertsSchedule>, dim3(static_cast<unsigned>(blocks)),
                       dim3(kDualThreads), kDualSmemBytes, stream, 1, sched);
}

}  // namespace moe_fp8
