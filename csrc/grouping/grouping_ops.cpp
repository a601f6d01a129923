// Torch glue of the token-group family (DESIGN §8), shared by the CPU and CUDA
// registrations: checks, output allocation and the mapping of every op onto the
// row-copy shape of grouping.h. No op syncs with the host unless MOE_FP8_DEBUG=1.
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "../core/op_checks.h"
#include "grouping.h"
#include "grouping_ops.h"

namespace moe_fp8 {
namespace {

// The rows of a 2-D tensor as byte rows: the inner dimension must be dense, so a
// tensor with a strided inner dimension is made contiguous first (a copy).
at::Tensor byte_rows(const at::Tensor& x, const char* op, const char* name) {
  check_rank(x, 2, op, name);
  if (x.size(1) <= 1 || x.stride(1) == 1) return x;
  return x.contiguous();
}

RowCopy row_copy(const at::Tensor& src, const at::Tensor& dst) {
  const int64_t es = src.element_size();
  RowCopy c;
  c.src = static_cast<const uint8_t*>(src.data_ptr());
  c.src_rows = src.size(0);
  c.src_stride = src.stride(0) * es;
  c.dst = static_cast<uint8_t*>(dst.data_ptr());
  c.dst_rows = dst.size(0);
  c.dst_stride = dst.stride(0) * es;
  c.row_bytes = src.size(1) * es;
  return c;
}

void run_copy_rows(const at::Tensor& src, const at::Tensor& dst, const RowMapArgs& m, const char* op) {
  if (dst.numel() == 0 && !(m.kind == RowMapKind::kPad && m.compute_pstart)) return;
  const RowCopy c = row_copy(src, dst);
  if (src.is_cpu()) {
    copy_rows_cpu(c, m);
    return;
  }
#ifdef MOE_FP8_WITH_CUDA
  copy_rows_cuda(c, m, src.device().index());
#else
  TORCH_CHECK(false, op, ": expected a CPU tensor (this build has no GPU support), got ", src.device());
#endif
}

RowMapArgs group_map(RowMapKind kind, const at::Tensor& offs, const int32_t* pstart, int64_t tokens,
                     int64_t padded_rows) {
  RowMapArgs m;
  m.kind = kind;
  m.layout.offs = offs.data_ptr<int32_t>();
  m.layout.pstart = pstart;
  m.layout.groups = static_cast<int>(offs.numel());
  m.layout.rows = tokens;
  m.layout.padded_rows = padded_rows;
  return m;
}

void check_groups(const at::Tensor& offs, const char* op) {
  TORCH_CHECK(offs.numel() <= INT32_MAX, op, ": expected at most 2^31-1 groups, got ", offs.numel());
}

}  // namespace

// padded_starts as a pad / unpad layout: int32 (G,), and on the CPU (or with
// MOE_FP8_DEBUG=1) each group's rows inside [0, padded_rows) in order.
void check_padded_starts(const at::Tensor& pstart, const at::Tensor& offs, int64_t tokens, int64_t padded_rows,
                         const at::Tensor& x, const char* op) {
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
    TORCH_CHECK(ps >= prev_end && ps + (e - s) <= padded_rows, op, ": expected padded_starts[", g,
                "] to place group ", g, " (", e - s, " rows) after the previous group and inside ", padded_rows,
                " padded rows, got ", ps);
    prev_end = ps + (e - s);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pad_token_groups(const at::Tensor& x_in, const at::Tensor& offs,
                                                                int64_t alignment) {
  constexpr const char* op = "pad_token_groups";
  const at::Tensor x = byte_rows(x_in, op, "x");
  check_alignment(alignment, op);
  check_offs(offs, x, x.size(0), op);
  check_groups(offs, op);
  const int64_t M = x.size(0), G = offs.numel();
  const int64_t R = padded_rows_bound(M, G, alignment);
  const at::Tensor offs_c = offs.contiguous();
  at::Tensor xp = at::empty({R, x.size(1)}, x.options());
  at::Tensor pstart = at::empty({G}, offs.options());
  at::Tensor pend = at::empty({G}, offs.options());
  RowMapArgs m = group_map(RowMapKind::kPad, offs_c, nullptr, M, R);
  m.compute_pstart = true;
  m.alignment = alignment;
  m.pstart_out = pstart.data_ptr<int32_t>();
  m.pend_out = pend.data_ptr<int32_t>();
  if (G > 0 || R > 0) run_copy_rows(x, xp, m, op);
  return {xp, pstart, pend};
}

at::Tensor pad_token_groups_at(const at::Tensor& x_in, const at::Tensor& offs, const at::Tensor& padded_starts,
                               int64_t num_padded_rows) {
  constexpr const char* op = "pad_token_groups_at";
  const at::Tensor x = byte_rows(x_in, op, "x");
  TORCH_CHECK(num_padded_rows >= 0, op, ": expected num_padded_rows >= 0, got ", num_padded_rows);
  check_offs(offs, x, x.size(0), op);
  check_groups(offs, op);
  check_padded_starts(padded_starts, offs, x.size(0), num_padded_rows, x, op);
  const at::Tensor offs_c = offs.contiguous(), ps = padded_starts.contiguous();
  at::Tensor xp = at::empty({num_padded_rows, x.size(1)}, x.options());
  run_copy_rows(x, xp, group_map(RowMapKind::kPad, offs_c, ps.data_ptr<int32_t>(), x.size(0), num_padded_rows), op);
  return xp;
}

at::Tensor unpad_token_groups(const at::Tensor& xp_in, const at::Tensor& offs, const at::Tensor& padded_starts,
                              int64_t num_tokens) {
  constexpr const char* op = "unpad_token_groups";
  const at::Tensor xp = byte_rows(xp_in, op, "x_padded");
  TORCH_CHECK(num_tokens >= 0, op, ": expected num_tokens >= 0, got ", num_tokens);
  check_offs(offs, xp, num_tokens, op);
  check_groups(offs, op);
  check_padded_starts(padded_starts, offs, num_tokens, xp.size(0), xp, op);
  const at::Tensor offs_c = offs.contiguous(), ps = padded_starts.contiguous();
  at::Tensor x = at::empty({num_tokens, xp.size(1)}, xp.options());
  run_copy_rows(xp, x, group_map(RowMapKind::kUnpad, offs_c, ps.data_ptr<int32_t>(), num_tokens, xp.size(0)), op);
  return x;
}

std::tuple<at::Tensor, at::Tensor> padded_group_offsets(const at::Tensor& offs, int64_t num_tokens,
                                                        int64_t alignment) {
  constexpr const char* op = "padded_group_offsets";
  check_alignment(alignment, op);
  TORCH_CHECK(num_tokens >= 0, op, ": expected num_tokens >= 0, got ", num_tokens);
  check_offs(offs, offs, num_tokens, op);
  check_groups(offs, op);
  const at::Tensor offs_c = offs.contiguous();
  const int G = static_cast<int>(offs.numel());
  at::Tensor pstart = at::empty({G}, offs.options());
  at::Tensor pend = at::empty({G}, offs.options());
  if (offs.is_cpu()) {
    padded_offsets_cpu(offs_c.data_ptr<int32_t>(), G, num_tokens, alignment, pstart.data_ptr<int32_t>(),
                       pend.data_ptr<int32_t>());
  } else {
#ifdef MOE_FP8_WITH_CUDA
    padded_offsets_cuda(offs_c.data_ptr<int32_t>(), G, num_tokens, alignment, pstart.data_ptr<int32_t>(),
                        pend.data_ptr<int32_t>(), offs.device().index());
#else
    TORCH_CHECK(false, op, ": expected a CPU tensor (this build has no GPU support), got ", offs.device());
#endif
  }
  return {pstart, pend};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_indices(const at::Tensor& counts, int64_t experts_per_rank,
                                                               int64_t num_ranks, int64_t alignment, int64_t max_len) {
  constexpr const char* op = "permute_indices";
  TORCH_CHECK(experts_per_rank >= 1 && num_ranks >= 1, op,
              ": expected experts_per_rank >= 1 and num_ranks >= 1, got ", experts_per_rank, " and ", num_ranks);
  TORCH_CHECK(experts_per_rank * num_ranks <= (1 << 20), op, ": expected num_ranks * experts_per_rank <= 2^20, got ",
              experts_per_rank * num_ranks);
  check_alignment(alignment, op);
  TORCH_CHECK(max_len >= 0 && max_len <= INT32_MAX, op, ": expected max_len in [0, 2^31-1], got ", max_len);
  check_index_tensor(counts, counts, op, "tokens_per_expert_group");
  TORCH_CHECK(counts.numel() == experts_per_rank * num_ranks, op, ": expected tokens_per_expert_group of shape (",
              experts_per_rank * num_ranks, ",) = num_ranks * experts_per_rank, got (", counts.numel(), ",)");
  const at::Tensor c = counts.contiguous();
  at::Tensor indices = at::empty({max_len}, counts.options());
  at::Tensor sizes = at::empty({experts_per_rank}, counts.options());
  at::Tensor ends = at::empty({experts_per_rank}, counts.options());
  PermuteArgs p;
  p.counts = c.data_ptr<int32_t>();
  p.experts = static_cast<int>(experts_per_rank);
  p.ranks = static_cast<int>(num_ranks);
  p.alignment = alignment;
  p.max_len = max_len;
  p.indices = indices.data_ptr<int32_t>();
  p.padded_sizes = sizes.data_ptr<int32_t>();
  p.padded_ends = ends.data_ptr<int32_t>();
  if (counts.is_cpu()) {
    permute_indices_cpu(p);
  } else {
#ifdef MOE_FP8_WITH_CUDA
    permute_indices_cuda(p, counts.device().index());
#else
    TORCH_CHECK(false, op, ": expected a CPU tensor (this build has no GPU support), got ", counts.device());
#endif
  }
  if (check_content(counts)) {
    const at::Tensor h = c.cpu();  // host-sync-ok: CPU or MOE_FP8_DEBUG only
    for (int64_t i = 0; i < h.numel(); ++i) {
      TORCH_CHECK(h.data_ptr<int32_t>()[i] >= 0, op, ": expected non-negative token counts, got ",
                  h.data_ptr<int32_t>()[i], " at ", i);
    }
    const int64_t need = ends.cpu().data_ptr<int32_t>()[experts_per_rank - 1];  // host-sync-ok: as above
    TORCH_CHECK(need <= max_len, op, ": expected max_len >= ", need,
                " (the padded rows of all experts; num_tokens + experts_per_rank * alignment always suffices), got ",
                max_len);
  }
  return {indices, sizes, ends};
}

void zero_rows_past_groups_(const at::Tensor& x, const at::Tensor& offs) {
  constexpr const char* op = "zero_rows_past_groups_";
  check_rank(x, 2, op, "x");
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, op, ": expected x with a unit stride along dim 1, got strides ",
              x.strides());
  check_offs(offs, x, x.size(0), op);
  check_groups(offs, op);
  if (x.numel() == 0) return;
  const at::Tensor offs_c = offs.contiguous();
  const int64_t es = x.element_size();
  auto* base = static_cast<uint8_t*>(x.data_ptr());
  if (x.is_cpu()) {
    zero_rows_past_groups_cpu(base, x.size(0), x.stride(0) * es, x.size(1) * es, offs_c.data_ptr<int32_t>(),
                              static_cast<int>(offs.numel()));
    return;
  }
#ifdef MOE_FP8_WITH_CUDA
  zero_rows_past_groups_cuda(base, x.size(0), x.stride(0) * es, x.size(1) * es, offs_c.data_ptr<int32_t>(),
                             static_cast<int>(offs.numel()), x.device().index());
#else
  TORCH_CHECK(false, op, ": expected a CPU tensor (this build has no GPU support), got ", x.device());
#endif
}

namespace {

// indices: int32 (n,), entries -1 (a padding slot) or in [0, rows); checked on the
// CPU or with MOE_FP8_DEBUG=1. `unique`: no row may appear twice.
void check_indices(const at::Tensor& indices, const at::Tensor& x, int64_t rows, bool unique, const char* op) {
  check_index_tensor(indices, x, op, "indices");
  if (!check_content(indices)) return;
  const at::Tensor h = indices.cpu().contiguous();  // host-sync-ok: CPU or MOE_FP8_DEBUG only
  std::vector<bool> seen(unique ? static_cast<size_t>(rows) : 0, false);
  for (int64_t j = 0; j < h.numel(); ++j) {
    const int32_t i = h.data_ptr<int32_t>()[j];
    TORCH_CHECK(i >= -1 && i < rows, op, ": expected indices in [-1, ", rows, "), got ", i, " at ", j);
    if (unique && i >= 0) {
      TORCH_CHECK(!seen[i], op, ": expected every row at most once in indices, got row ", i, " twice");
      seen[i] = true;
    }
  }
}

at::Tensor gather_rows_unchecked(const at::Tensor& x, const at::Tensor& idx, const char* op) {
  at::Tensor y = at::empty({idx.numel(), x.size(1)}, x.options());
  RowMapArgs m;
  m.kind = RowMapKind::kGather;
  m.indices = idx.data_ptr<int32_t>();
  run_copy_rows(x, y, m, op);
  return y;
}

}  // namespace

at::Tensor gather_rows(const at::Tensor& x_in, const at::Tensor& indices) {
  constexpr const char* op = "gather_rows";
  const at::Tensor x = byte_rows(x_in, op, "x");
  check_indices(indices, x, x.size(0), /*unique=*/false, op);
  return gather_rows_unchecked(x, indices.contiguous(), op);
}

at::Tensor scatter_rows(const at::Tensor& y_in, const at::Tensor& indices, int64_t num_rows) {
  constexpr const char* op = "scatter_rows";
  const at::Tensor y = byte_rows(y_in, op, "y");
  TORCH_CHECK(num_rows >= 0 && num_rows <= INT32_MAX, op, ": expected num_rows in [0, 2^31-1], got ", num_rows);
  TORCH_CHECK(indices.dim() == 1 && indices.numel() == y.size(0), op, ": expected indices of shape (", y.size(0),
              ",) (a row of y each), got ", indices.sizes());
  check_indices(indices, y, num_rows, /*unique=*/true, op);
  const at::Tensor idx = indices.contiguous();
  // The inverse map (row -> slot, -1 when no slot holds it) turns the scatter into a
  // gather: every output row is written exactly once, so no zero fill pass.
  at::Tensor inverse = at::empty({num_rows}, indices.options());
  if (y.is_cpu()) {
    inverse.fill_(-1);
    const int32_t* ip = idx.data_ptr<int32_t>();
    int32_t* inv = inverse.data_ptr<int32_t>();
    for (int64_t j = 0; j < idx.numel(); ++j) {
      if (ip[j] >= 0 && ip[j] < num_rows) inv[ip[j]] = static_cast<int32_t>(j);
    }
  } else {
#ifdef MOE_FP8_WITH_CUDA
    invert_indices_cuda(idx.data_ptr<int32_t>(), idx.numel(), inverse.data_ptr<int32_t>(), num_rows,
                        y.device().index());
#else
    TORCH_CHECK(false, op, ": expected a CPU tensor (this build has no GPU support), got ", y.device());
#endif
  }
  return gather_rows_unchecked(y, inverse, op);
}

}  // namespace moe_fp8
