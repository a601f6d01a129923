// The MXFP8 scale swizzles (DESIGN §7): byte matrices to and from the blocked layout
// (128x4 tiles of 512 bytes), plain, per expert, with token groups along the rows (M
// groups) or along the block columns (K groups). Torch-free: the argument structs,
// the group tables and the index math shared by the CPU loops (swizzle_cpu.cpp) and
// the GPU kernels (swizzle_kernels.cuh), so both produce the same bytes.
//
// Group tables (int32, built from offs by the host or by each GPU block):
//   ends[g]   offs[g] clamped to [0, limit] (limit = rows for M groups, 32 * cols for
//             K groups); group g is [lo_g, hi_g) with lo_g = ends[g-1] (0 for g = 0)
//             and hi_g = max(ends[g], lo_g): what group_range does.
//   start[g]  exclusive prefix of the padded group sizes, g in [0, G] (start[G] the
//             total): ceil128(hi - lo) rows (M groups) or ceil4(n_g) block columns
//             (K groups, n_g = ceil((hi - lo) / 32), first column a_g = lo / 32).
//   reach[g]  K groups, from_blocked only: max over j <= g of a_j + n_j.
// Bad offs (GPU, not checked there) give some in-bounds bytes: every read and write
// is bounded by the tensors' sizes, never by the tables.
#pragma once

#include <cstdint>

#include "../core/numerics.h"
#include "../core/portability.h"
#include "../quant/policies.h"

namespace moe_fp8 {

constexpr int kSwizzleBlock = 32;  // tokens per scale (K groups: offs are in tokens)
// GPU: up to this many groups each block builds its tables in shared memory (3 int32
// tables: 48 KB); above it the op passes a scratch buffer of 3G + 1 int32 that a
// one-block kernel fills first.
constexpr int kSwizzleSmemGroups = 4096;
// The largest blocked buffer (bytes) the to_blocked ops write: 2^31 tiles of 512 bytes,
// so the GPU's tile arithmetic stays 32-bit.
constexpr int64_t kSwizzleMaxBlockedBytes = (int64_t(1) << 31) * 512 - 1;

enum class SwizzleGroups : int {
  kNone = 0,     // one matrix (R, C) or E of them (E, R, C), each blocked on its own
  kMGroups = 1,  // token groups along the rows: group g from row start[g]
  kKGroups = 2,  // token groups along the columns: group g's columns are a blocked
                 // matrix of their own at flat offset ceil128(R) * start[g]
};

struct SwizzleTables {
  const int32_t* ends = nullptr;
  const int32_t* start = nullptr;  // G + 1 entries
  const int32_t* reach = nullptr;  // K groups, from_blocked only
  int groups = 0;
};

// Plain (E, R, C) bytes with any strides <-> blocked bytes (contiguous).
//  to_blocked:   plain -> blocked, every byte of the blocked buffer written (padding 0)
//  from_blocked: blocked -> plain (contiguous (E, R, C)), every byte written
struct SwizzleArgs {
  const uint8_t* plain_in = nullptr;  // to_blocked: the source
  uint8_t* plain_out = nullptr;       // from_blocked: the destination (contiguous)
  int64_t se = 0, sr = 0, sc = 0;     // strides of plain_in, in bytes
  int64_t E = 1, R = 0, C = 0;        // plain shape (M groups: R = M; K groups: C = block columns)
  const uint8_t* blocked_in = nullptr;
  uint8_t* blocked_out = nullptr;
  int64_t blocked_bytes = 0;  // the whole blocked buffer
  int64_t blocked_cols = 0;   // its padded width (kNone, kMGroups: ceil4(C); kKGroups: ceil4(C) + 4G)
  SwizzleGroups groups = SwizzleGroups::kNone;
  const int32_t* offs = nullptr;  // kMGroups, kKGroups
  int num_groups = 0;
  // to_blocked: 4 valid bytes of a row may be read through the aligned 32-bit words that
  // hold them: sc == 1, sr, se and the base 4-aligned, and (K groups, whose first
  // columns are any column) C a multiple of 4, so those words never pass a row's end.
  bool vec4 = false;
};

// ---- group tables -----------------------------------------------------------------

MOE_FP8_HD int64_t swizzle_limit(const SwizzleArgs& a) {
  return a.groups == SwizzleGroups::kKGroups ? a.C * kSwizzleBlock : a.R;
}

MOE_FP8_HD void swizzle_group(const SwizzleTables& t, int g, int64_t* lo, int64_t* hi) {
  const int64_t s = g == 0 ? 0 : t.ends[g - 1];
  const int64_t e = t.ends[g];
  *lo = s;
  *hi = e < s ? s : e;
}

MOE_FP8_HD int32_t swizzle_clamp_end(int32_t o, int64_t limit) {
  return static_cast<int32_t>(o < 0 ? 0 : (o > limit ? limit : o));
}

// Group g's padded size (rows or block columns) and, for K groups, its reach a + n.
MOE_FP8_HD int64_t swizzle_padded_size(SwizzleGroups k, int64_t lo, int64_t hi) {
  if (k == SwizzleGroups::kMGroups) return round_up(hi - lo, 128);
  return round_up(ceil_div(hi - lo, kSwizzleBlock), 4);
}
MOE_FP8_HD int64_t swizzle_reach(int64_t lo, int64_t hi) {
  return lo / kSwizzleBlock + ceil_div(hi - lo, kSwizzleBlock);
}

// Last g in [0, G) with v[g] <= x (v non-decreasing), or -1.
MOE_FP8_HD int swizzle_last_le(const int32_t* v, int n, int64_t x) {
  int lo = 0, hi = n;  // answer in [lo - 1, hi - 1]
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (v[mid] <= x) lo = mid + 1;
    else hi = mid;
  }
  return lo - 1;
}
// First g in [0, G) with v[g] > x (v non-decreasing), or G.
MOE_FP8_HD int swizzle_first_gt(const int32_t* v, int n, int64_t x) { return swizzle_last_le(v, n, x) + 1; }

// ---- to_blocked: one 16-byte row of a 128x4 tile ------------------------------------

// The 4 bytes at p as one word (little-endian), from the aligned word(s) holding them:
// one load when p is 4-aligned, else two and a funnel shift. The caller guarantees
// that both aligned words are inside the tensor (SwizzleArgs::vec4).
MOE_FP8_HD uint32_t swizzle_load4(const uint8_t* p) {
  const uintptr_t m = reinterpret_cast<uintptr_t>(p) & 3;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p - m);
  if (m == 0) return w[0];
  const uint64_t both = (static_cast<uint64_t>(w[1]) << 32) | w[0];
  return static_cast<uint32_t>(both >> (8 * m));
}

// out[i * 4 + j] = plain (row0 + 32 i, col0 + j) of the matrix at src (sr, sc), or 0
// outside [0, rows) x [0, cols).
MOE_FP8_HD void swizzle_gather16(const uint8_t* src, int64_t sr, int64_t sc, int64_t row0, int64_t rows,
                                 int64_t col0, int64_t cols, bool vec4, uint8_t out[16]) {
  for (int i = 0; i < 4; ++i) {
    const int64_t r = row0 + 32 * i;
    if (r >= rows) {
      for (int j = 0; j < 4; ++j) out[i * 4 + j] = 0;
      continue;
    }
    const uint8_t* p = src + r * sr + col0 * sc;
    if (vec4 && col0 + 4 <= cols) {
      const uint32_t w = swizzle_load4(p);
      for (int j = 0; j < 4; ++j) out[i * 4 + j] = static_cast<uint8_t>(w >> (8 * j));
    } else {
      for (int j = 0; j < 4; ++j) out[i * 4 + j] = col0 + j < cols ? p[j * sc] : 0;
    }
  }
}

// The 16 bytes [16 u, 16 u + 16) of the blocked buffer (those past its end are 0 and
// not stored by the caller). Tile arithmetic is 32-bit (the ops keep the buffer under
// kSwizzleMaxBlockedBytes, so tile counts fit): a 64-bit division by a runtime value
// is a long software sequence on a GPU, and this runs once per 16 bytes.
MOE_FP8_HD void swizzle_to_blocked_chunk(const SwizzleArgs& a, const SwizzleTables& t, int64_t u, uint8_t out[16]) {
  const uint32_t tile = static_cast<uint32_t>(u / 32);  // 512-byte tile of the buffer
  const int64_t rr = u % 32;                            // its row r % 32
  const uint32_t tcols = static_cast<uint32_t>(a.blocked_cols / 4);
  if (a.groups == SwizzleGroups::kNone) {
    const uint32_t per = static_cast<uint32_t>(round_up(a.R, 128) / 128) * tcols;  // tiles per matrix
    const uint32_t e = tile / per, lt = tile - e * per;
    const uint32_t band = lt / tcols, quad = lt - band * tcols;
    swizzle_gather16(a.plain_in + e * a.se, a.sr, a.sc, int64_t{band} * 128 + rr, a.R, int64_t{quad} * 4, a.C,
                     a.vec4, out);
    return;
  }
  if (a.groups == SwizzleGroups::kMGroups) {
    const uint32_t band = tile / tcols, quad = tile - band * tcols;
    const int64_t row = int64_t{band} * 128;  // blocked row of the tile
    const int g = swizzle_last_le(t.start, t.groups, row);
    int64_t lo = 0, hi = 0;
    if (g >= 0 && row < t.start[g + 1]) swizzle_group(t, g, &lo, &hi);
    const int64_t local = row - (g >= 0 ? t.start[g] : 0);
    swizzle_gather16(a.plain_in + lo * a.sr, a.sr, a.sc, local + rr, hi - lo, int64_t{quad} * 4, a.C, a.vec4, out);
    return;
  }
  // K groups: tiles run down a group's ceil128(R)/128 tile rows per 4 block columns.
  const uint32_t trows = static_cast<uint32_t>(round_up(a.R, 128) / 128);
  const uint32_t quad = tile / trows;  // which 4 block columns of the buffer
  const int g = swizzle_last_le(t.start, t.groups, int64_t{quad} * 4);
  int64_t lo = 0, hi = 0;
  uint32_t gcols = 1, lt = 0;
  if (g >= 0 && int64_t{quad} * 4 < t.start[g + 1]) {
    swizzle_group(t, g, &lo, &hi);
    const uint32_t w = static_cast<uint32_t>(t.start[g + 1] - t.start[g]) / 4;
    gcols = w > 0 ? w : 1;  // a width under 4 only from start clamped at INT32_MAX (bad offs)
    lt = tile - trows * static_cast<uint32_t>(t.start[g] / 4);
  }
  const int64_t n = hi > lo ? ceil_div(hi - lo, kSwizzleBlock) : 0;
  const uint32_t band = lt / gcols, lq = lt - band * gcols;
  swizzle_gather16(a.plain_in + (lo / kSwizzleBlock) * a.sc, a.sr, a.sc, int64_t{band} * 128 + rr, a.R,
                   int64_t{lq} * 4, n, a.vec4, out);
}

// ---- from_blocked: one byte of the plain output --------------------------------------

// plain (e, r, c) (flat index i of the contiguous (E, R, C) output) from the blocked
// buffer, 0 where no group holds it.
MOE_FP8_HD uint8_t swizzle_from_blocked_byte(const SwizzleArgs& a, const SwizzleTables& t, int64_t i) {
  const int64_t c = i % a.C, rest = i / a.C;
  const int64_t r = rest % a.R, e = rest / a.R;
  int64_t idx = -1;
  if (a.groups == SwizzleGroups::kNone) {
    idx = e * round_up(a.R, 128) * a.blocked_cols + blocked_scale_index(r, c, a.blocked_cols);
  } else if (a.groups == SwizzleGroups::kMGroups) {
    // the first group whose end passes r (ends clamped, non-decreasing for valid offs)
    const int g = swizzle_first_gt(t.ends, t.groups, r);
    if (g < t.groups) {
      int64_t lo, hi;
      swizzle_group(t, g, &lo, &hi);
      if (lo <= r && r < hi) idx = blocked_scale_index(t.start[g] + r - lo, c, a.blocked_cols);
    }
  } else {
    // the first group reaching past column c that starts at or before it
    const int g = swizzle_first_gt(t.reach, t.groups, c);
    if (g < t.groups) {
      int64_t lo, hi;
      swizzle_group(t, g, &lo, &hi);
      const int64_t a0 = lo / kSwizzleBlock;
      if (a0 <= c && c < swizzle_reach(lo, hi)) {
        const int64_t w = t.start[g + 1] - t.start[g];
        idx = round_up(a.R, 128) * t.start[g] + blocked_scale_index(r, c - a0, w);
      }
    }
  }
  return idx >= 0 && idx < a.blocked_bytes ? a.blocked_in[idx] : 0;
}

// ---- host: the tables (CPU twin; the GPU builds the same ones per block) --------------

// tables: 3 * G + 1 int32 (ends, start, reach).
inline SwizzleTables swizzle_host_tables(const SwizzleArgs& a, int32_t* storage) {
  SwizzleTables t;
  const int G = a.num_groups;
  int32_t* ends = storage;
  int32_t* start = storage + G;
  int32_t* reach = storage + 2 * G + 1;
  const int64_t limit = swizzle_limit(a);
  for (int g = 0; g < G; ++g) ends[g] = swizzle_clamp_end(a.offs[g], limit);
  t.ends = ends;
  t.groups = G;
  int64_t run = 0, far = 0;
  for (int g = 0; g < G; ++g) {
    int64_t lo, hi;
    swizzle_group(t, g, &lo, &hi);
    start[g] = static_cast<int32_t>(run < INT32_MAX ? run : INT32_MAX);
    run += swizzle_padded_size(a.groups, lo, hi);
    const int64_t rch = swizzle_reach(lo, hi);
    far = rch > far ? rch : far;
    reach[g] = static_cast<int32_t>(far);
  }
  start[G] = static_cast<int32_t>(run < INT32_MAX ? run : INT32_MAX);
  t.start = start;
  t.reach = reach;
  return t;
}

}  // namespace moe_fp8
