// FP8 rowwise grouped GEMMs (DESIGN §5), Hopper sm_90a only: our CUTLASS kernels in place of
// torch._scaled_grouped_mm, same operands and math (e4m3, fast accumulation, D = bf16((acc * scale_a) * scale_b)), a
// configuration picked per call by shape. Per-group tables are built on the device from `offs`: no host sync.
#include "rowwise_grouped_sm90.cuh"

#include <torch/library.h>

#include <algorithm>

#include "../core/groups.h"
#include "../core/op_checks.h"
#include "grouped_gemm_common.h"

#if MOE_FP8_RW_GEMM_SM90  // (else this file defines nothing)
namespace moe_fp8 {
namespace {

using namespace gemm_common;   // NOLINT: the shared checks and helpers
using namespace rowwise_gemm;  // NOLINT: the kernel types and tables

constexpr int64_t kTokenAlign = 16;  // 2d2d group starts: 16 fp8 bytes
constexpr int kConfigCount = 6;      // the entries of MOE_FP8_RW_CONFIGS

// Carve the tables of `groups` groups out of one byte tensor (16-byte aligned arrays).
Tables carve_tables(at::Tensor& storage, int64_t groups, const at::TensorOptions& opts) {
  auto bytes = [&](int64_t each) { return round_up(each * std::max<int64_t>(groups, 1), 16); };
  Tables t;
  const int64_t sizes[] = {bytes(sizeof(*t.shape)),   bytes(sizeof(*t.a)),        bytes(sizeof(*t.b)),
                           bytes(sizeof(*t.d)),       bytes(sizeof(*t.scale_a)),  bytes(sizeof(*t.scale_b)),
                           bytes(sizeof(*t.stride_a)), bytes(sizeof(*t.stride_b)), bytes(sizeof(*t.stride_d))};
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  storage = at::empty({total}, opts.dtype(at::kByte));
  char* p = static_cast<char*>(storage.data_ptr());
  int i = 0;
  auto take = [&](auto*& field) {
    field = reinterpret_cast<std::remove_reference_t<decltype(field)>>(p);
    p += sizes[i++];
  };
  take(t.shape);
  take(t.a);
  take(t.b);
  take(t.d);
  take(t.scale_a);
  take(t.scale_b);
  take(t.stride_a);
  take(t.stride_b);
  take(t.stride_d);
  return t;
}

// ---- 2d3d tables: group g is rows [s, e) of a and out, expert g of b ----------------------
struct Args2d3d {
  const uint8_t* a;      // [M, K] row-major (row stride lda)
  const float* scale_a;  // [M]
  const uint8_t* b;      // [E, K, N] per expert column-major (column stride ldb, expert stride sbe)
  const float* scale_b;  // [E, N] (expert stride ssb)
  const int32_t* offs;   // [E] group ends
  void* out;             // [M, N] row-major bf16
  int64_t M, N, K, lda, ldb, sbe, ssb;
  int groups;
};

// "TN" GEMM (M_g, N, K): A = a rows, B = b[g]. group_range clamps every group into [0, M], so bad offs never reach
// memory out of bounds.
__global__ void build_tables_2d3d(Tables t, Args2d3d p) {
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  if (thread < p.groups) {
    const int g = static_cast<int>(thread);
    int64_t s, e;
    group_range(p.offs, g, p.M, &s, &e);
    t.shape[g] = {static_cast<int>(e - s), static_cast<int>(p.N), static_cast<int>(p.K)};
    t.a[g] = reinterpret_cast<const ElementAB*>(p.a + s * p.lda);
    t.b[g] = reinterpret_cast<const ElementAB*>(p.b + g * p.sbe);
    t.d[g] = static_cast<ElementD*>(p.out) + s * p.N;
    t.scale_a[g] = p.scale_a + s;
    t.scale_b[g] = p.scale_b + g * p.ssb;
    t.stride_a[g] = cute::make_stride(p.lda, cute::Int<1>{}, cute::Int<0>{});
    t.stride_b[g] = cute::make_stride(p.ldb, cute::Int<1>{}, cute::Int<0>{});
    t.stride_d[g] = cute::make_stride(p.N, cute::Int<1>{}, cute::Int<0>{});
  }
  // Rows past the last group belong to no group: zeros (never uninitialized memory).
  const int64_t tail = p.groups > 0 ? clamp_offset(p.offs[p.groups - 1], p.M) : 0;
  zero_bf16(p.out, tail * p.N, p.M * p.N, thread, threads);
}

// ---- 2d2d tables: group g is tokens [s, e), a multiple of 16 at its start ----------------
struct Args2d2d {
  const uint8_t* a;      // [N, M] row-major (row stride lda)
  const float* scale_a;  // [E, N] (group stride ssa)
  const uint8_t* b;      // [M, K] column-major (column stride ldb)
  const float* scale_b;  // [E, K] (group stride ssb)
  const int32_t* offs;   // [E] group ends
  void* out;             // [E, N, K] row-major bf16, or fp32 added to (accumulate)
  int64_t M, N, K, lda, ldb, ssa, ssb;
  int groups;
  int blocks_per_group;
  bool accumulate;  // out += the product: an empty group leaves its output as it is
};

// "TN" GEMM (N, K, T_g): A = a[:, tokens of g], B = b[tokens of g, :]. Empty groups' outputs are zeroed here (left as
// they are when accumulating; the tables' d then points at fp32).
__global__ void build_tables_2d2d(Tables t, Args2d2d p) {
  const int g = static_cast<int>(blockIdx.x / p.blocks_per_group);
  const int x = static_cast<int>(blockIdx.x % p.blocks_per_group);
  if (g >= p.groups) return;
  int64_t s, e;
  group_range(p.offs, g, p.M, &s, &e);
  // A group that does not start at a multiple of 16 tokens (bad offs) is empty, like a
  // group with no tokens, so no misaligned address is formed.
  const bool live = e > s && s % kTokenAlign == 0;
  if (x == 0 && threadIdx.x == 0) {
    // An empty group gets no tiles (M = 0); its output is zeroed below.
    t.shape[g] = {live ? static_cast<int>(p.N) : 0, static_cast<int>(p.K), live ? static_cast<int>(e - s) : 0};
    t.a[g] = reinterpret_cast<const ElementAB*>(p.a + (live ? s : 0));
    t.b[g] = reinterpret_cast<const ElementAB*>(p.b + (live ? s : 0));
    const int64_t bytes = p.accumulate ? sizeof(float) : sizeof(ElementD);  // an element of out
    t.d[g] = reinterpret_cast<ElementD*>(static_cast<char*>(p.out) + g * p.N * p.K * bytes);
    t.scale_a[g] = p.scale_a + g * p.ssa;
    t.scale_b[g] = p.scale_b + g * p.ssb;
    t.stride_a[g] = cute::make_stride(p.lda, cute::Int<1>{}, cute::Int<0>{});
    t.stride_b[g] = cute::make_stride(p.ldb, cute::Int<1>{}, cute::Int<0>{});
    t.stride_d[g] = cute::make_stride(p.K, cute::Int<1>{}, cute::Int<0>{});
  }
  if (!live && !p.accumulate) {
    const int64_t per_group = p.N * p.K;
    zero_bf16(p.out, g * per_group, (g + 1) * per_group, int64_t(x) * blockDim.x + threadIdx.x,
              int64_t(p.blocks_per_group) * blockDim.x);
  }
}

void run(int config, const Tables& t, int groups, const at::Tensor& like, const GpuLaunch& gpu, const char* op) {
  const int sms = sm_count(gpu.device());
  int i = 0;
#define MOE_FP8_RW_CASE(name)                            \
  if (config == i++) {                                   \
    run_##name(t, groups, sms, like, gpu, op);            \
    return;                                              \
  }
  MOE_FP8_RW_CONFIGS(MOE_FP8_RW_CASE)
#undef MOE_FP8_RW_CASE
  TORCH_CHECK(false, op, ": expected a configuration in [0, ", i, "), got ", config);
}

// The picks (bench/bench_rowwise_gemm.py --sweep; record 030): wgrad cooperative 128x256, cluster 2x1 (a 256-wide
// tile halves A's reads); forward / dgrad pingpong 128x128, cluster 1x2 for mean groups under 2048 rows (its
// epilogue overlaps the other warp group's MMAs), else cooperative 128x256.
constexpr int kCoop128x256C21 = 2, kPong128x128C12 = 5;  // places in MOE_FP8_RW_CONFIGS

int pick_config_2d3d(int64_t mean_rows) { return mean_rows >= 2048 ? kCoop128x256C21 : kPong128x128C12; }

void check_common(const char* op, const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                  const at::Tensor& scale_b, const at::Tensor& offs, int64_t b_rank, at::ScalarType out_dtype,
                  int64_t config) {
  check_rank(a, 2, op, "a");
  check_rank(b, b_rank, op, "b");
  TORCH_CHECK(a.scalar_type() == at::kFloat8_e4m3fn, op, ": expected a of dtype float8_e4m3fn, got ", a.scalar_type());
  TORCH_CHECK(b.scalar_type() == at::kFloat8_e4m3fn, op, ": expected b of dtype float8_e4m3fn, got ", b.scalar_type());
  TORCH_CHECK(scale_a.scalar_type() == at::kFloat, op, ": expected scale_a of dtype float32, got ",
              scale_a.scalar_type());
  TORCH_CHECK(scale_b.scalar_type() == at::kFloat, op, ": expected scale_b of dtype float32, got ",
              scale_b.scalar_type());
  check_rank(offs, 1, op, "offs");
  TORCH_CHECK(offs.scalar_type() == at::kInt, op, ": expected offs of dtype int32, got ", offs.scalar_type());
  check_same_device(op, {"a", a}, {{"scale_a", scale_a}, {"b", b}, {"scale_b", scale_b}, {"offs", offs}});
  check_groups(offs, op);
  TORCH_CHECK(out_dtype == at::kBFloat16, op, ": expected out_dtype bfloat16, got ", out_dtype);
  TORCH_CHECK(config >= -1 && config < kConfigCount, op, ": expected config -1 (the pick by shape) or in [0, ",
              kConfigCount, "), got ", config);
}

// Forward / dgrad: out (M, N) bf16, rows of group g = (a[rows of g] * scale_a[rows]) @ (b[g] * scale_b[g]);
// a (M, K) row-major, scale_a (M,), b (E, K, N) column-major per expert, scale_b (E, N).
at::Tensor rowwise_grouped_mm_2d3d(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                                   const at::Tensor& scale_b, const at::Tensor& offs, at::ScalarType out_dtype,
                                   int64_t config) {
  constexpr const char* op = "rowwise_grouped_mm_2d3d";
  check_common(op, a, scale_a, b, scale_b, offs, 3, out_dtype, config);
  const int64_t M = a.size(0), K = a.size(1), E = b.size(0), N = b.size(2);
  TORCH_CHECK(b.size(1) == K, op, ": expected b of shape (E, K, N) with K = ", K, " (the columns of a), got ",
              b.sizes());
  check_shape(op, "scale_a", scale_a, {M});
  check_shape(op, "scale_b", scale_b, {E, N});
  TORCH_CHECK(offs.numel() == E, op, ": expected offs of shape (", E, ",) (one group per expert of b), got (",
              offs.numel(), ",)");
  check_unit_stride(op, "a", a, 1, "row-major");
  check_unit_stride(op, "scale_a", scale_a, 0, "contiguous");
  check_unit_stride(op, "b", b, 1, "column-major per expert");
  check_unit_stride(op, "scale_b", scale_b, 1, "row-major");
  TORCH_CHECK(K % 16 == 0, op, ": expected K (the columns of a) to be a multiple of 16 (16-byte rows for TMA), got ",
              K);
  TORCH_CHECK(N % 8 == 0, op, ": expected N (the columns of b) to be a multiple of 8 (16-byte bf16 output rows), got ",
              N);
  const int64_t lda = stride_or(a, 0, K), ldb = stride_or(b, 2, K), sbe = stride_or(b, 0, 0);
  const int64_t ssb = stride_or(scale_b, 0, 0);
  check_ld(op, "a.stride(0)", lda, K, 16);
  check_ld(op, "b.stride(2)", ldb, K, 16);
  TORCH_CHECK(sbe % 16 == 0, op, ": expected b.stride(0) to be a multiple of 16 (16-byte aligned experts), got ",
              sbe);
  check_fits_int32(M, op, "M");
  check_fits_int32(N, op, "N");
  check_fits_int32(K, op, "K");
  check_offs(offs, a, M, op);
  check_hopper(a, op, /*built=*/true);  // (the file is empty in a build without the kernels)

  at::Tensor out = at::empty({M, N}, a.options().dtype(at::kBFloat16));
  if (M == 0 || N == 0) return out;
  if (K == 0 || E == 0) return out.zero_();  // an empty contraction, or no group: all rows are zero
  check_aligned(op, "a", a);
  check_aligned(op, "b", b);
  const GpuLaunch gpu(a.device().index());
  Args2d3d p;
  p.a = static_cast<const uint8_t*>(a.data_ptr());
  p.scale_a = scale_a.data_ptr<float>();
  p.b = static_cast<const uint8_t*>(b.data_ptr());
  p.scale_b = scale_b.data_ptr<float>();
  const at::Tensor offs_c = offs.contiguous();  // the kernels index offs[g]: a strided view is copied
  p.offs = offs_c.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.M = M;
  p.N = N;
  p.K = K;
  p.lda = lda;
  p.ldb = ldb;
  p.sbe = sbe;
  p.ssb = ssb;
  p.groups = static_cast<int>(E);
  at::Tensor storage;
  Tables tables = carve_tables(storage, E, a.options());
  // Tiles along N where the mean group's A (fp8 bytes) reaches 32 MiB (record 030).
  tables.raster_along_n = ceil_div(M, E) * K >= (int64_t{32} << 20);
  constexpr int kThreads = 256;
  // Enough threads for the tables, and up to two blocks an SM for the zero tail.
  const int64_t blocks = std::max<int64_t>(ceil_div(E, kThreads),
                                           std::min<int64_t>(ceil_div(M * N / 8, kThreads), 2 * sm_count(gpu.device())));
  build_tables_2d3d<<<static_cast<unsigned>(blocks), kThreads, 0, gpu.stream()>>>(tables, p);
  gpu.check(static_cast<int>(cudaGetLastError()), op);
  run(config >= 0 ? static_cast<int>(config) : pick_config_2d3d(ceil_div(M, E)), tables, p.groups, a, gpu, op);
  return out;
}

// With MOE_FP8_DEBUG=1 (a sync) or CPU offs: every non-empty group starts at a multiple of 16.
void check_group_starts(const at::Tensor& offs, int64_t rows, const char* op) {
  if (!check_content(offs)) return;
  const at::Tensor host = offs.cpu().contiguous();  // host-sync-ok: MOE_FP8_DEBUG only
  const int32_t* o = host.data_ptr<int32_t>();
  for (int64_t g = 0; g < host.numel(); ++g) {
    int64_t s, e;
    group_range(o, static_cast<int>(g), rows, &s, &e);
    TORCH_CHECK(e == s || s % kTokenAlign == 0, op, ": expected every non-empty token group to start at a multiple of ",
                kTokenAlign, " tokens (16-byte aligned for TMA), got group ", g, " starting at token ", s);
  }
}

// Wgrad: out[g] (E, N, K) = (a[:, tokens of g] * scale_a[g]) @ (b[tokens of g, :] * scale_b[g]); a (N, M) row-major,
// b (M, K) column-major; non-empty groups start at multiples of 16 tokens (TMA; else empty, MOE_FP8_DEBUG=1 raises).
// `add`: the product is added to out (fp32) in place (config -1 only: the cooperative 128x256 tile, 2x1 cluster).
at::Tensor run_2d2d(const char* op, const at::Tensor* add, const at::Tensor& a, const at::Tensor& scale_a,
                    const at::Tensor& b, const at::Tensor& scale_b, const at::Tensor& offs, at::ScalarType out_dtype,
                    int64_t config) {
  check_common(op, a, scale_a, b, scale_b, offs, 2, out_dtype, add != nullptr ? -1 : config);
  const int64_t N = a.size(0), M = a.size(1), K = b.size(1), E = offs.numel();
  TORCH_CHECK(b.size(0) == M, op, ": expected b of shape (M, K) with M = ", M, " (the columns of a), got ", b.sizes());
  check_shape(op, "scale_a", scale_a, {E, N});
  check_shape(op, "scale_b", scale_b, {E, K});
  check_unit_stride(op, "a", a, 1, "row-major");
  check_unit_stride(op, "b", b, 0, "column-major");
  check_unit_stride(op, "scale_a", scale_a, 1, "row-major");
  check_unit_stride(op, "scale_b", scale_b, 1, "row-major");
  TORCH_CHECK(K % 8 == 0, op, ": expected K (the columns of b) to be a multiple of 8 (16-byte bf16 output rows), got ",
              K);
  const int64_t lda = stride_or(a, 0, round_up(M, 16)), ldb = stride_or(b, 1, round_up(M, 16));
  const int64_t ssa = stride_or(scale_a, 0, 0), ssb = stride_or(scale_b, 0, 0);
  check_ld(op, "a.stride(0)", lda, M, 16);
  check_ld(op, "b.stride(1)", ldb, M, 16);
  check_fits_int32(M, op, "M");
  check_fits_int32(N, op, "N");
  check_fits_int32(K, op, "K");
  if (add != nullptr) {
    check_add_out(op, *add, a, {E, N, K});
  } else {
    check_alloc({E, N, K}, 2, op, "out");
  }
  check_offs(offs, a, M, op);
  check_group_starts(offs, M, op);
  check_hopper(a, op, /*built=*/true);  // (the file is empty in a build without the kernels)

  at::Tensor out = add != nullptr ? *add : at::empty({E, N, K}, a.options().dtype(at::kBFloat16));
  if (out.numel() == 0) return out;
  if (M == 0) return add != nullptr ? out : out.zero_();  // no tokens: every group is empty
  check_aligned(op, "a", a);
  check_aligned(op, "b", b);
  if (add != nullptr) check_aligned(op, "out", out);
  const GpuLaunch gpu(a.device().index());
  Args2d2d p;
  p.a = static_cast<const uint8_t*>(a.data_ptr());
  p.scale_a = scale_a.data_ptr<float>();
  p.b = static_cast<const uint8_t*>(b.data_ptr());
  p.scale_b = scale_b.data_ptr<float>();
  const at::Tensor offs_c = offs.contiguous();  // the kernels index offs[g]: a strided view is copied
  p.offs = offs_c.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.M = M;
  p.N = N;
  p.K = K;
  p.lda = lda;
  p.ldb = ldb;
  p.ssa = ssa;
  p.ssb = ssb;
  p.groups = static_cast<int>(E);
  p.accumulate = add != nullptr;
  at::Tensor storage;
  const Tables tables = carve_tables(storage, E, a.options());
  constexpr int kThreads = 256;
  // Blocks per group: enough to zero an empty group's (N, K) quickly; the blocks of the
  // live groups return at once (one of them writes the group's tables).
  p.blocks_per_group = static_cast<int>(std::min<int64_t>(ceil_div(N * K / 8, kThreads), 16));
  const int64_t blocks = E * p.blocks_per_group;
  TORCH_CHECK(blocks <= kInt32Max, op, ": expected at most ", kInt32Max / 16, " groups, got ", E);
  build_tables_2d2d<<<static_cast<unsigned>(blocks), kThreads, 0, gpu.stream()>>>(tables, p);
  gpu.check(static_cast<int>(cudaGetLastError()), op);
  if (add != nullptr) {
    run_AddCoop128x256C21(tables, p.groups, sm_count(gpu.device()), a, gpu, op);
  } else {
    run(config >= 0 ? static_cast<int>(config) : kCoop128x256C21, tables, p.groups, a, gpu, op);
  }
  return out;
}

at::Tensor rowwise_grouped_mm_2d2d(const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& b,
                                   const at::Tensor& scale_b, const at::Tensor& offs, at::ScalarType out_dtype,
                                   int64_t config) {
  return run_2d2d("rowwise_grouped_mm_2d2d", nullptr, a, scale_a, b, scale_b, offs, out_dtype, config);
}

void rowwise_grouped_mm_2d2d_add_(const at::Tensor& out, const at::Tensor& a, const at::Tensor& scale_a,
                                  const at::Tensor& b, const at::Tensor& scale_b, const at::Tensor& offs) {
  run_2d2d("rowwise_grouped_mm_2d2d_add_", &out, a, scale_a, b, scale_b, offs, at::kBFloat16, -1);
}

}  // namespace
}  // namespace moe_fp8
#endif  // MOE_FP8_RW_GEMM_SM90

// Registered only in a build with the kernels: without them (nvcc before 12.3) the op
// has no CUDA kernel, moe_fp8_ext.rowwise_gemm.available() says False and the recipe
// keeps PyTorch's GEMM.
#if MOE_FP8_RW_GEMM_SM90
TORCH_LIBRARY_IMPL(moe_fp8, CUDA, m) {
  m.impl("rowwise_grouped_mm_2d3d", TORCH_FN(moe_fp8::rowwise_grouped_mm_2d3d));
  m.impl("rowwise_grouped_mm_2d2d", TORCH_FN(moe_fp8::rowwise_grouped_mm_2d2d));
  m.impl("rowwise_grouped_mm_2d2d_add_", TORCH_FN(moe_fp8::rowwise_grouped_mm_2d2d_add_));
}
#endif
