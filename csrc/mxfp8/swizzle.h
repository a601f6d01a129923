// The MXFP8 scale swizzles (DESIGN §7): byte matrices to and from the blocked layout (128x4 tiles of 512 bytes),
// plain, per expert, or with token groups along the rows (M groups) or block columns (K groups). Torch-free: structs,
// group tables and index math shared by the CPU loops and the GPU kernels, so both produce the same bytes.
#pragma once

#include <cstdint>

#include "../core/numerics.h"
#include "../core/portability.h"
#include "../quant/policies.h"

namespace moe_fp8 {

constexpr int kSwizzleBlock = 32;  // tokens per scale (K groups: offs are in tokens)
// GPU: up to this many groups each block builds its 3 int32 tables in shared memory (24 KB, beside the to_blocked
// stage of 17 KB, 34 KB for K groups); above it the op passes a scratch of 3G + 1 int32 a one-block kernel fills first.
constexpr int kSwizzleSmemGroups = 2048;
// The largest blocked buffer (bytes) the to_blocked ops write: 2^31 tiles of 512 bytes,
// so the GPU's tile arithmetic stays 32-bit.
constexpr int64_t kSwizzleMaxBlockedBytes = (int64_t(1) << 31) * 512 - 1;

enum class SwizzleGroups : int {
  kNone = 0,     // one matrix (R, C) or E of them (E, R, C), each blocked on its own
  kMGroups = 1,  // token groups along the rows: group g from row start[g]
  kKGroups = 2,  // token groups along the columns: group g's columns are a blocked
                 // matrix of their own at flat offset ceil128(R) * start[g]
};

// Group tables (int32), built from offs by the host or by each GPU block. Bad offs (unchecked on the GPU) give some
// in-bounds bytes: every read and write is bounded by the tensors' sizes, never by the tables.
struct SwizzleTables {
  const int32_t* ends = nullptr;   // offs[g] clamped to [0, swizzle_limit]; group g as group_range gives it
  const int32_t* start = nullptr;  // G + 1 entries: exclusive prefix of the padded sizes (swizzle_padded_size)
  const int32_t* reach = nullptr;  // K groups, from_blocked only: max over j <= g of swizzle_reach(group j)
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

// ---- to_blocked: runs of tiles ----------------------------------------------------------

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

// Columns col0 .. col0 + 3 of a plain row (p: the row's column col0, column stride sc)
// as one little-endian word, 0 past `cols`; one (or two, unaligned) word loads where
// `vec4` allows, else byte by byte.
MOE_FP8_HD uint32_t swizzle_load_quad(const uint8_t* p, int64_t sc, int64_t col0, int64_t cols, bool vec4) {
  if (vec4 && col0 + 4 <= cols) return swizzle_load4(p);
  uint32_t w = 0;
  for (int j = 0; j < 4; ++j) {
    if (col0 + j < cols) w |= static_cast<uint32_t>(p[j * sc]) << (8 * j);
  }
  return w;
}

// The to_blocked work is cut into runs: up to kSwizzleRunTiles consecutive 4-column
// quads (a 512-byte tile each) of one tile row, 128 blocked rows. On the GPU a thread
// block writes a run (swizzle_kernels.cuh); the CPU walks the same runs.
constexpr int kSwizzleRunTiles = 32;

// Run counts: kNone E x tile rows x runs of a tile row; M groups: the buffer's tile
// rows (the last one may be partial) x runs; K groups: tile rows x runs over all
// block-column quads of the buffer (a run may span groups; each quad finds its own).
struct SwizzleRunPlan {
  uint32_t tcols = 0;     // quads (tiles) of a tile row
  uint32_t per_row = 0;   // runs of a tile row
  uint32_t trows = 0;     // tile rows of one matrix (kNone, K groups) or of the buffer (M groups)
  int64_t runs = 0;
};

MOE_FP8_HD SwizzleRunPlan swizzle_run_plan(const SwizzleArgs& a) {
  SwizzleRunPlan p;
  if (a.blocked_bytes <= 0 || a.blocked_cols <= 0) return p;
  p.tcols = static_cast<uint32_t>(a.blocked_cols / 4);
  p.per_row = (p.tcols + kSwizzleRunTiles - 1) / kSwizzleRunTiles;
  if (a.groups == SwizzleGroups::kMGroups) {
    const int64_t rows = a.blocked_bytes / a.blocked_cols;  // M + 128 G (not a multiple of 128)
    p.trows = static_cast<uint32_t>((rows + 127) / 128);
    p.runs = int64_t{p.trows} * p.per_row;
  } else {
    p.trows = static_cast<uint32_t>(round_up(a.R, 128) / 128);
    p.runs = (a.groups == SwizzleGroups::kNone ? a.E : 1) * int64_t{p.trows} * p.per_row;
  }
  return p;
}

// One quad of the run: the plain rows it reads (`src` is the run's first row at column
// 0 of the quad's matrix or group), its first column and the column count there, the
// valid rows from src, and its tile of the buffer (-1: past the run).
struct SwizzleRunQuad {
  const uint8_t* src = nullptr;
  int64_t col0 = 0, cols = 0, rows = 0;
  int64_t tile = -1;
  int64_t plain_col = 0;  // col0's column of the plain matrix (K groups: the group's first + col0)
};

MOE_FP8_HD SwizzleRunQuad swizzle_run_quad(const SwizzleArgs& a, const SwizzleTables& t, const SwizzleRunPlan& p,
                                           uint32_t run, uint32_t qi) {
  SwizzleRunQuad q;
  const uint32_t row_run = run % p.per_row, band_all = run / p.per_row;
  const uint32_t quad = row_run * kSwizzleRunTiles + qi;
  if (a.groups == SwizzleGroups::kKGroups) {
    // band_all is the tile row; quad counts block-column quads over the whole buffer
    if (quad >= p.tcols) return q;
    const int64_t row = int64_t{band_all} * 128;
    q.rows = a.R - row < 128 ? a.R - row : 128;
    const int g = swizzle_last_le(t.start, t.groups, int64_t{quad} * 4);
    // A group placed past the buffer (only from bad offs: the op's bound holds every
    // valid layout) counts as past every group, so the tiles stay a one-to-one map of
    // the buffer: every byte written once, whatever offs holds.
    if (g >= 0 && int64_t{quad} * 4 < t.start[g + 1] && t.start[g + 1] <= int64_t{p.tcols} * 4) {
      int64_t lo, hi;
      swizzle_group(t, g, &lo, &hi);
      const uint32_t w = static_cast<uint32_t>(t.start[g + 1] - t.start[g]) / 4;
      const uint32_t gq = w > 0 ? w : 1;  // a width under 4 only from start clamped at INT32_MAX (bad offs)
      const uint32_t first = static_cast<uint32_t>(t.start[g]) / 4, lq = quad - first;
      q.src = a.plain_in + (lo / kSwizzleBlock) * a.sc + row * a.sr;
      q.col0 = int64_t{lq} * 4;
      q.cols = hi > lo ? ceil_div(hi - lo, kSwizzleBlock) : 0;
      q.plain_col = lo / kSwizzleBlock + q.col0;
      q.tile = int64_t{p.trows} * first + int64_t{band_all} * gq + lq;
    } else {  // quads past every group: zero tiles, tile rows down each quad
      q.src = a.plain_in;
      q.tile = int64_t{quad} * p.trows + band_all;
    }
    return q;
  }
  if (quad >= p.tcols) return q;
  q.col0 = int64_t{quad} * 4;
  q.cols = a.C;
  q.plain_col = q.col0;
  q.tile = int64_t{band_all} * p.tcols + quad;
  if (a.groups == SwizzleGroups::kNone) {
    const uint32_t e = band_all / p.trows, band = band_all - e * p.trows;
    const int64_t row = int64_t{band} * 128;
    q.src = a.plain_in + e * a.se + row * a.sr;
    q.rows = a.R - row < 128 ? a.R - row : 128;
    return q;
  }
  // M groups: the group whose padded rows hold this tile row (none: padding, zeros)
  const int64_t row = int64_t{band_all} * 128;
  const int g = swizzle_last_le(t.start, t.groups, row);
  q.src = a.plain_in;
  if (g >= 0 && row < t.start[g + 1]) {
    int64_t lo, hi;
    swizzle_group(t, g, &lo, &hi);
    const int64_t local = row - t.start[g];
    const int64_t left = hi - lo - local;
    q.src = a.plain_in + (lo + local) * a.sr;
    q.rows = left < 0 ? 0 : (left < 128 ? left : 128);
  }
  return q;
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
