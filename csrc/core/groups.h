// Token-group index math for every family (DESIGN §3, §8): group ranges from `offs` (int32 cumulative ends) clamped into
// [0, rows], so no offs content addresses memory out of bounds; the padded group layout (pad_token_groups, the jagged
// quantizations' padded q) with its static size; row lookups in both directions.
#pragma once

#include <cstdint>

#include "numerics.h"

namespace moe_fp8 {

MOE_FP8_HD int64_t clamp_offset(int64_t v, int64_t rows) { return v < 0 ? 0 : (v > rows ? rows : v); }

// Token group g: rows [start, end), clamped. A decreasing offs gives an empty
// group, never a negative one.
MOE_FP8_HD void group_range(const int32_t* offs, int g, int64_t rows, int64_t* start, int64_t* end) {
  const int64_t s = g == 0 ? 0 : clamp_offset(offs[g - 1], rows);
  const int64_t e = clamp_offset(offs[g], rows);
  *start = s;
  *end = e < s ? s : e;
}

// Rows of the padded layout: a static bound that holds every group padded up
// (DESIGN §8), whatever the group sizes are.
MOE_FP8_HD int64_t padded_rows_bound(int64_t rows, int64_t groups, int64_t alignment) {
  return round_up(rows + groups * alignment, alignment);
}

// First group g whose end offs[g] is past row r (clamped offs), or `groups` if none.
MOE_FP8_HD int group_of_row(const int32_t* offs, int groups, int64_t rows, int64_t r) {
  int lo = 0, hi = groups;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;  // (lo + hi overflows past 2^30 groups)
    if (clamp_offset(offs[mid], rows) <= r) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Last index g in [0, n) with table[g] <= v (tables are non-decreasing in valid use;
// any content gives an index in range); -1 when none.
MOE_FP8_HD int last_at_most(const int32_t* table, int n, int64_t v) {
  int lo = 0, hi = n;  // first index with table[idx] > v
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;  // (lo + hi overflows past 2^30 groups)
    if (table[mid] <= v) lo = mid + 1;
    else hi = mid;
  }
  return lo - 1;
}

// The groups of a padded layout: `offs` (G cumulative ends into `rows` tokens) and
// `pstart` (G start rows in the padded tensor of `padded_rows` rows). Group g's
// padded rows start at pstart[g]; with an alignment a, it owns round_up(n_g, a) rows.
struct GroupLayout {
  const int32_t* offs = nullptr;
  const int32_t* pstart = nullptr;
  int groups = 0;
  int64_t rows = 0;
  int64_t padded_rows = 0;
};

// Group g's padded rows [q_start, q_start + q_len) with alignment a: round_up(n_g, a)
// rows from pstart[g], clamped into the layout (no content reaches past it).
MOE_FP8_HD void padded_group_rows(const GroupLayout& l, int g, int64_t alignment, int64_t* q_start, int64_t* q_len) {
  int64_t start, end;
  group_range(l.offs, g, l.rows, &start, &end);
  const int64_t s = clamp_offset(l.pstart[g], l.padded_rows);
  const int64_t n = round_up(end - start, alignment);
  *q_start = s;
  *q_len = n < l.padded_rows - s ? n : l.padded_rows - s;
}

// pad: source token of padded row r, or -1 (padding, or past the last group).
MOE_FP8_HD int64_t pad_source_row(const GroupLayout& l, int64_t r) {
  const int g = last_at_most(l.pstart, l.groups, r);
  if (g < 0) return -1;
  int64_t start, end;
  group_range(l.offs, g, l.rows, &start, &end);
  const int64_t j = r - l.pstart[g];
  return j < end - start ? start + j : -1;
}

// unpad: padded row of token i, or -1 (a token past offs[G-1]).
MOE_FP8_HD int64_t unpad_source_row(const GroupLayout& l, int64_t i) {
  const int g = group_of_row(l.offs, l.groups, l.rows, i);
  if (g >= l.groups) return -1;
  int64_t start, end;
  group_range(l.offs, g, l.rows, &start, &end);
  if (i < start || i >= end) return -1;
  const int64_t src = static_cast<int64_t>(l.pstart[g]) + (i - start);
  return src >= 0 && src < l.padded_rows ? src : -1;
}

}  // namespace moe_fp8
