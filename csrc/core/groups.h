// Token-group index math shared by every family (DESIGN §3, §8): group ranges from
// `offs` (int32 cumulative group ends) clamped into [0, rows], so that no content of
// offs can address memory out of bounds, and the static size of a padded layout.
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

}  // namespace moe_fp8
