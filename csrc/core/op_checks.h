// Host-side input checks for every family's torch glue, messages "<op>: expected <what>, got <what>" (DESIGN §3). Order,
// so no step sees garbage: tensors (rank, dtype, one device); integer arguments and sizes from overflow-safe arithmetic
// (never a silent wrap); index-tensor content, on the CPU always, on a GPU with MOE_FP8_DEBUG=1 (the kernels clamp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/GradMode.h>
#include <c10/util/safe_numerics.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "groups.h"

namespace moe_fp8 {

constexpr int64_t kInt32Max = 2147483647;

// ---- tensors ----------------------------------------------------------------------

inline void check_rank(const at::Tensor& x, int64_t rank, const char* op, const char* name) {
  TORCH_CHECK(x.dim() == rank, op, ": expected ", name, " to be a ", rank, "-D tensor, got ", x.dim(), "-D");
}

// A named tensor argument, for the checks that look at several tensors of one call.
// An undefined tensor (an absent optional) is skipped.
struct TensorArg {
  const char* name;
  const at::Tensor& tensor;
};

// Every tensor of one call is on the device of `ref` (DESIGN §3): a CPU (or meta)
// offs with CUDA data is an error, never a fake-kernel result.
//   check_same_device(op, {"x", x}, {{"offs", offs}, {"padded_starts", ps}});
inline void check_same_device(const char* op, const TensorArg& ref, std::initializer_list<TensorArg> others) {
  for (const TensorArg& a : others) {
    if (!a.tensor.defined()) continue;
    TORCH_CHECK(a.tensor.device() == ref.tensor.device(), op, ": expected ", a.name, " on ", ref.tensor.device(),
                " (the device of ", ref.name, "), got ", a.tensor.device());
  }
}

// An int32 1-D index tensor on the device of x.
inline void check_index_tensor(const at::Tensor& t, const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt, op, ": expected ", name, " of dtype int32, got ", t.scalar_type());
  check_rank(t, 1, op, name);
  check_same_device(op, {"x", x}, {{name, t}});
}

// An in-place op writes x: like torch's in-place ops, refuse a self-overlapping x (an
// expanded view: several elements share memory, so the result would depend on the
// order of writes) and, with grad mode on, a leaf that requires grad.
inline void check_writable(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(at::has_internal_overlap(x) != at::MemOverlap::Yes, op, ": expected ", name,
              " without internal overlap (each element its own memory, as torch's in-place ops require), got sizes ",
              x.sizes(), " and strides ", x.strides());
  TORCH_CHECK(!(c10::GradMode::is_enabled() && x.requires_grad() && x.is_leaf()), op, ": expected ", name,
              " that is not a leaf requiring grad (an in-place write would bypass autograd), got a leaf with "
              "requires_grad=True");
}

// ---- integer arguments and the sizes computed from them -----------------------------

// a * b and a + b, or a clear error where the exact value does not fit in int64.
inline int64_t checked_mul(int64_t a, int64_t b, const char* op, const char* what) {
  int64_t r = 0;
  TORCH_CHECK(!c10::mul_overflows(a, b, &r), op, ": expected ", what, " to fit in int64, got ", a, " * ", b,
              " (overflows)");
  return r;
}
inline int64_t checked_add(int64_t a, int64_t b, const char* op, const char* what) {
  int64_t r = 0;
  TORCH_CHECK(!c10::add_overflows(a, b, &r), op, ": expected ", what, " to fit in int64, got ", a, " + ", b,
              " (overflows)");
  return r;
}

// A size argument in [0, max].
inline void check_size_arg(int64_t v, const char* op, const char* name, int64_t max = INT64_MAX) {
  TORCH_CHECK(v >= 0 && v <= max, op, ": expected ", name, " in [0, ", max, "], got ", v);
}

// A value stored as int32 (an offset, a padded size) fits: an error, never a
// saturated or wrapped value.
inline void check_fits_int32(int64_t v, const char* op, const char* what) {
  TORCH_CHECK(v >= 0 && v <= kInt32Max, op, ": expected ", what, " to fit in int32 (at most 2^31-1), got ", v);
}

// The bytes of a tensor of `sizes` with elements of `element_size` bytes fit in
// int64; checked before allocating, so a huge size argument is a clear error.
inline void check_alloc(std::initializer_list<int64_t> sizes, int64_t element_size, const char* op,
                        const char* name) {
  int64_t n = element_size;
  for (int64_t s : sizes) n = checked_mul(n, s, op, name);
}

// A power of two in [1, 1024].
inline void check_alignment(int64_t alignment, const char* op) {
  TORCH_CHECK(alignment >= 1 && alignment <= 1024 && (alignment & (alignment - 1)) == 0, op,
              ": expected alignment to be a power of two in [1, 1024], got ", alignment);
}

// At most 2^31-1 groups (group indices are int).
inline void check_groups(const at::Tensor& offs, const char* op) {
  TORCH_CHECK(offs.numel() <= kInt32Max, op, ": expected at most 2^31-1 groups in offs, got ", offs.numel());
}

// padded_rows_bound(rows, groups, alignment) (groups.h), overflow-free and checked to fit int32 (every padded start and
// end is at most it, stored as int32). Static: no sync, whatever offs holds. Call check_alignment first.
inline int64_t checked_padded_rows(int64_t rows, int64_t groups, int64_t alignment, const char* op) {
  const int64_t slack = checked_mul(groups, alignment, op, "num_groups * alignment");
  const int64_t sum = checked_add(rows, slack, op, "the padded rows");
  TORCH_CHECK(sum <= kInt32Max, op, ": expected the padded layout of ", rows, " rows in ", groups,
              " groups aligned to ", alignment, " to fit in int32 (rows + groups * alignment <= 2^31-1, padded "
              "offsets are int32), got ", sum);
  const int64_t bound = padded_rows_bound(rows, groups, alignment);
  check_fits_int32(bound, op, "the padded rows");
  return bound;
}

// ---- content of index tensors ------------------------------------------------------

// MOE_FP8_DEBUG=1 turns on content checks of GPU index tensors (they sync).
inline bool debug_checks() {
  static const bool on = [] {
    const char* v = std::getenv("MOE_FP8_DEBUG");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

// Whether the content of a (possibly GPU) index tensor is to be checked: always on
// the CPU, on a GPU only with MOE_FP8_DEBUG=1.
inline bool check_content(const at::Tensor& t) { return t.is_cpu() || debug_checks(); }

// offs: int32 (G,) cumulative group ends in [0, rows], non-decreasing (DESIGN §3).
// The content is checked on the CPU, and on a GPU with MOE_FP8_DEBUG=1; the kernels
// clamp, so bad content on a GPU never reaches memory out of bounds.
inline void check_offs(const at::Tensor& offs, const at::Tensor& x, int64_t rows, const char* op) {
  check_index_tensor(offs, x, op, "offs");
  check_groups(offs, op);
  if (!check_content(offs)) return;
  const at::Tensor host = offs.cpu().contiguous();  // host-sync-ok: CPU or MOE_FP8_DEBUG only
  const int32_t* o = host.data_ptr<int32_t>();
  for (int64_t g = 0; g < host.numel(); ++g) {
    TORCH_CHECK(o[g] >= 0 && o[g] <= rows, op, ": expected offs[", g, "] in [0, ", rows, "], got ", o[g]);
    TORCH_CHECK(g == 0 || o[g] >= o[g - 1], op, ": expected non-decreasing offs, got offs[", g, "] = ", o[g],
                " < offs[", g - 1, "] = ", o[g - 1]);
  }
}

// padded_starts: int32 (G,) like offs; content (CPU, or MOE_FP8_DEBUG=1): group g, padded to round_up(n_g, alignment),
// starts at a multiple of alignment, after the previous padded group, inside padded_rows. G = 0 is valid (null data, never
// "unpadded"). gap_free: each group starts where the previous one's padded rows end (from 0). Call check_offs first.
inline void check_padded_starts(const at::Tensor& pstart, const at::Tensor& offs, int64_t tokens,
                                int64_t padded_rows, const at::Tensor& x, const char* op, int64_t alignment = 1,
                                bool gap_free = false) {
  check_index_tensor(pstart, x, op, "padded_starts");
  TORCH_CHECK(pstart.numel() == offs.numel(), op, ": expected padded_starts of shape (", offs.numel(),
              ",) like offs, got (", pstart.numel(), ",)");
  if (!check_content(pstart)) return;
  const at::Tensor p = pstart.cpu().contiguous();  // host-sync-ok: CPU or MOE_FP8_DEBUG only
  const at::Tensor o = offs.cpu().contiguous();    // host-sync-ok: CPU or MOE_FP8_DEBUG only
  int64_t prev_end = 0;
  for (int64_t g = 0; g < p.numel(); ++g) {
    int64_t s, e;
    group_range(o.data_ptr<int32_t>(), static_cast<int>(g), tokens, &s, &e);
    const int64_t ps = p.data_ptr<int32_t>()[g];
    const int64_t size = round_up(e - s, alignment);
    TORCH_CHECK(ps % alignment == 0 && ps >= prev_end && ps + size <= padded_rows, op, ": expected padded_starts[",
                g, "] to place group ", g, " (", e - s, " rows, ", size, " padded) at a multiple of ", alignment,
                ", at or after row ", prev_end, " (the end of the previous group) and inside ", padded_rows,
                " padded rows, got ", ps);
    TORCH_CHECK(!gap_free || ps == prev_end, op, ": expected padded_starts without gaps (each group where the ",
                "previous one's padded rows end, as padded_group_offsets makes them), got padded_starts[", g, "] = ",
                ps, " where ", prev_end, " follows");
    prev_end = ps + size;
  }
}

}  // namespace moe_fp8
