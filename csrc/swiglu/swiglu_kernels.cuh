// The SwiGLU family's GPU kernel and launcher (DESIGN §10), torch-free (raw pointers, sizes, a stream): compiled for
// any target and hipified as is. The written values and the fp8 codes come from the same rounded values, so q is
// quantize_rowwise of the written tensor, bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../core/device_runtime.h"
#include "../core/dispatch.h"
#include "../core/float_ops.h"
#include "../core/numerics.h"
#include "../core/portability.h"
#include "../core/reduce.cuh"
#include "../core/vec.cuh"
#include "swiglu.h"

namespace moe_fp8 {

template <InputKind K, int kVec>
struct SwigluVecs {
  using T = typename SwigluElem<K>::storage;
  Array<T, kVec> o[2];  // forward: o[0] = h; backward: grad_h1, grad_h3
  Array<T, kVec> h;     // backward: the forward value (stored only with a.h_out)
};

// One vector's inputs: h1, h3 and (backward) g.
template <InputKind K, int kVec>
struct SwigluIn {
  using T = typename SwigluElem<K>::storage;
  Array<T, kVec> h1, h3, g;
};

template <InputKind K, bool kBwd, int kVec>
MOE_FP8_DEVICE SwigluIn<K, kVec> swiglu_load(const SwigluArgs& a, int64_t row, int64_t v) {
  using T = typename SwigluElem<K>::storage;
  const T* hr = static_cast<const T*>(a.h13) + row * a.h13_stride + v * kVec;
  SwigluIn<K, kVec> in;
  in.h1 = load_elems<T, kVec>(hr, 1);
  in.h3 = load_elems<T, kVec>(hr + a.hidden, 1);
  if constexpr (kBwd) in.g = load_elems<T, kVec>(static_cast<const T*>(a.grad) + row * a.grad_stride + v * kVec, 1);
  return in;
}

// The bf16 forward takes R(silu(h1)) from the table (silu_round_bf16).
template <InputKind K, bool kBwd>
constexpr bool kSwigluTable = K == InputKind::kBF16 && !kBwd;

// Else silu_quot_fast for the whole vector on CUDA, and the IEEE path for all of it where an element is outside the
// fast path's sure range (a branch a vector, taken only for NaN, Inf or h1 < -40). kH: the backward also computes h, a
// compile-time choice (a run-time one costs the plain backward registers and occupancy; record 030).
template <InputKind K, bool kBwd, int kVec, bool kH = false>
MOE_FP8_DEVICE SwigluVecs<K, kVec> swiglu_compute(const SwigluIn<K, kVec>& in, const uint16_t* table) {
  using E = SwigluElem<K>;
  if constexpr (kSwigluTable<K, kBwd>) {
    SwigluVecs<K, kVec> r;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      r.o[0].v[i] = E::from_float(f_mul(silu_round_bf16(in.h1.v[i], table), E::to_float(in.h3.v[i])));
    }
    return r;
  }
  SiluQuot sq[kVec];
#if MOE_FP8_HAS_FAST_DIV
  bool ok = true;
#pragma unroll
  for (int i = 0; i < kVec; ++i) sq[i] = silu_quot_fast<kBwd>(E::to_float(in.h1.v[i]), ok);
  if (!ok) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) sq[i] = silu_quot<kBwd>(E::to_float(in.h1.v[i]));
  }
#else
#pragma unroll
  for (int i = 0; i < kVec; ++i) sq[i] = silu_quot<kBwd>(E::to_float(in.h1.v[i]));
#endif
  SwigluVecs<K, kVec> r;
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    if constexpr (kBwd) {
      swiglu_backward_elem<K>(sq[i], in.g.v[i], in.h1.v[i], in.h3.v[i], &r.o[0].v[i], &r.o[1].v[i],
                              kH ? &r.h.v[i] : nullptr);
    } else {
      r.o[0].v[i] = swiglu_elem<K>(sq[i], in.h3.v[i]);
    }
  }
  return r;
}

template <InputKind K, bool kBwd, int kVec, bool kH = false>
MOE_FP8_DEVICE void swiglu_store(const SwigluArgs& a, int64_t row, int64_t v, const SwigluVecs<K, kVec>& r) {
  using T = typename SwigluElem<K>::storage;
  if constexpr (kH) store_elems<T, kVec>(static_cast<T*>(a.h_out) + row * a.h_out_stride + v * kVec, r.h);
  if (a.out == nullptr) return;
  T* orow = static_cast<T*>(a.out) + row * a.out_stride + v * kVec;
  store_elems<T, kVec>(orow, r.o[0]);
  if constexpr (kBwd) store_elems<T, kVec>(orow + a.hidden, r.o[1]);
}

// The backward's outputs as written by swiglu_store (grad_h13 must be written).
template <InputKind K, int kVec>
MOE_FP8_DEVICE SwigluVecs<K, kVec> swiglu_reload(const SwigluArgs& a, int64_t row, int64_t v) {
  using T = typename SwigluElem<K>::storage;
  const T* orow = static_cast<const T*>(a.out) + row * a.out_stride + v * kVec;
  SwigluVecs<K, kVec> r;
  r.o[0] = load_elems<T, kVec>(orow, 1);
  r.o[1] = load_elems<T, kVec>(orow + a.hidden, 1);
  return r;
}

template <InputKind K, Fp8Format F, bool kBwd, int kVec>
MOE_FP8_DEVICE void swiglu_store_q(const SwigluArgs& a, int64_t row, int64_t v, const SwigluVecs<K, kVec>& r,
                                   const float (&encode)[2]) {
#pragma unroll
  for (int h = 0; h < (kBwd ? 2 : 1); ++h) {
    store_elems<uint8_t, kVec>(a.q[h] + row * a.q_stride + v * kVec, quantize_elems<F, DeviceInput<K>>(r.o[h], encode[h]));
  }
}

// Vectors a thread holds (kRegs): warp rows kSwigluRegs; block rows of the quantizing
// and the backward kernels kSwigluBlockRegs while the row fits that many a thread of
// kSwigluMaxThreads threads, else kSwigluRegs (record 030).
constexpr int kSwigluRegs = 4;
constexpr int kSwigluBlockRegs = 2;
// At most 256 threads a block, so that a thread may hold up to 255 registers (the
// register cache of a backward row is ~80 of them; 1024-thread bounds cap it at 64 and
// spill).
constexpr int kSwigluMaxThreads = 256;
constexpr int kSwigluTableBytes = kSiluTableEntries * 2;
static_assert(kSwigluTableBytes % 16 == 0, "the table is copied in 16-byte vectors");

// Fills the bf16 forward's table (silu_table_entry). A template, so that the header
// may be included by more than one translation unit.
template <int kUnused = 0>
__global__ void swiglu_silu_table_kernel(uint16_t* table) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < kSiluTableEntries) table[i] = silu_table_entry(i);
}

// kQuant: also the rowwise fp8 of each output half (format F); kH: the quantizing backward also writes h (a.h_out).
// kWarpRow: a warp a row (amax by warp shuffle, no block barrier), else a block. A thread's loads of a row all issue
// before any store (a maybe-aliasing store would serialize them). No prefetch or async ring: issue bound (record 030).
template <InputKind K, Fp8Format F, bool kBwd, bool kQuant, int kVec, bool kWarpRow, bool kH, int kRegs>
__global__ void __launch_bounds__(kSwigluMaxThreads) swiglu_rows_kernel(SwigluArgs a) {
  using In = DeviceInput<K>;
  using T = typename SwigluElem<K>::storage;
  constexpr int kHalves = kBwd ? 2 : 1;
  __shared__ uint32_t s_red[kHalves][kMaxWarpsPerBlock + 1];
  const int64_t nvec = a.hidden / kVec;
  const int lanes = kWarpRow ? kWarpSize : static_cast<int>(blockDim.x);
  const int lane = kWarpRow ? static_cast<int>(threadIdx.x) % kWarpSize : static_cast<int>(threadIdx.x);
  const int64_t rows_per_block = kWarpRow ? blockDim.x / kWarpSize : 1;
  const int64_t step = static_cast<int64_t>(gridDim.x) * rows_per_block;
  const int64_t cached = static_cast<int64_t>(kRegs) * lanes;
  SwigluIn<K, kVec> in[kRegs];
  // Dynamic shared memory: the bf16 forward's table (kSwigluTableBytes, copied from a.silu_table), then the quantizing
  // forward's cache of h, this row's (warp rows: this warp's row's) cached vectors, each read back only by the thread
  // that wrote it (no barrier).
  extern __shared__ uint4 s_dyn[];
  constexpr bool kTable = kSwigluTable<K, kBwd>;
  constexpr int kTableVecs = kTable ? kSwigluTableBytes / 16 : 0;
  const uint16_t* table = reinterpret_cast<const uint16_t*>(s_dyn);
  if constexpr (kTable) {
    const uint4* src = reinterpret_cast<const uint4*>(a.silu_table);
    for (int i = static_cast<int>(threadIdx.x); i < kTableVecs; i += static_cast<int>(blockDim.x)) s_dyn[i] = src[i];
    __syncthreads();
  }
  Array<T, kVec>* h_cache = reinterpret_cast<Array<T, kVec>*>(s_dyn + kTableVecs) +
                            (kWarpRow ? static_cast<int64_t>(threadIdx.x / kWarpSize) * cached : 0);
  auto load_row = [&](int64_t row) {
#pragma unroll
    for (int j = 0; j < kRegs; ++j) {
      const int64_t v = lane + static_cast<int64_t>(j) * lanes;
      if (row < a.rows && v < nvec) in[j] = swiglu_load<K, kBwd, kVec>(a, row, v);
    }
  };
  int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block + (kWarpRow ? threadIdx.x / kWarpSize : 0);
  // Block rows: every thread of a block runs the same trip count (block_max barriers).
  for (; row < a.rows; row += step) {
    load_row(row);  // all of this thread's loads of the row in flight together, before any store
    uint32_t amax[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < kRegs; ++j) {
      const int64_t v = lane + static_cast<int64_t>(j) * lanes;
      if (v < nvec) {
        const SwigluVecs<K, kVec> r = swiglu_compute<K, kBwd, kVec, kH>(in[j], table);
        swiglu_store<K, kBwd, kVec, kH>(a, row, v, r);
        if constexpr (kQuant) {
#pragma unroll
          for (int h = 0; h < kHalves; ++h) amax[h] = amax_bits_of<In>(r.o[h], amax[h]);
          if constexpr (!kBwd) h_cache[v] = r.o[0];
        }
      }
    }
    // Vectors past the register cache: read and computed where they are used (twice in a quantizing forward).
    for (int64_t v = lane + cached; v < nvec; v += lanes) {
      const SwigluVecs<K, kVec> r = swiglu_compute<K, kBwd, kVec, kH>(swiglu_load<K, kBwd, kVec>(a, row, v), table);
      swiglu_store<K, kBwd, kVec, kH>(a, row, v, r);
      if constexpr (kQuant) {
#pragma unroll
        for (int h = 0; h < kHalves; ++h) amax[h] = amax_bits_of<In>(r.o[h], amax[h]);
      }
    }
    if constexpr (kQuant) {
      if constexpr (kBwd) {
        if (a.joint) amax[0] = amax[1] = umax(amax[0], amax[1]);  // one scale over the whole row
      }
      float encode[2];
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const uint32_t m = kWarpRow ? warp_max_from(amax[h], 1) : block_max(amax[h], s_red[h]);
        const QuantScale sc = scale_from_amax_bits(m, Fp8Spec<F>::kMax, a.pow2);
        encode[h] = sc.encode;
        if (lane == 0) a.scale[h][row] = sc.decode;
      }
      if constexpr (kBwd) {
        // Encode what this thread has just written (grad_h13, an L1/L2 hit, visible to
        // the thread that wrote it): no register cache, so as many warps as the plain
        // kernel.
        for (int64_t v = lane; v < nvec; v += lanes) {
          swiglu_store_q<K, F, kBwd, kVec>(a, row, v, swiglu_reload<K, kVec>(a, row, v), encode);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kRegs; ++j) {
          const int64_t v = lane + static_cast<int64_t>(j) * lanes;
          if (v < nvec) {
            SwigluVecs<K, kVec> r;
            r.o[0] = h_cache[v];
            swiglu_store_q<K, F, kBwd, kVec>(a, row, v, r, encode);
          }
        }
        for (int64_t v = lane + cached; v < nvec; v += lanes) {
          const SwigluVecs<K, kVec> r = swiglu_compute<K, kBwd, kVec>(swiglu_load<K, kBwd, kVec>(a, row, v), table);
          swiglu_store_q<K, F, kBwd, kVec>(a, row, v, r, encode);
        }
      }
    }
  }
}

// Whether every access of the vector path is aligned (kVec elements of T = 16 bytes).
template <typename T, int kVec>
inline bool swiglu_vector_ok(const SwigluArgs& a) {
  auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  bool ok = a.hidden % kVec == 0 && a.h13_stride % kVec == 0 && aligned(a.h13) && aligned(a.out) && aligned(a.grad) &&
            aligned(a.h_out);
  if (a.grad != nullptr) ok = ok && a.grad_stride % kVec == 0;
  if (a.out != nullptr) ok = ok && a.out_stride % kVec == 0;
  if (a.h_out != nullptr) ok = ok && a.h_out_stride % kVec == 0;
  for (int h = 0; h < 2; ++h) {
    ok = ok && (a.q[h] == nullptr || reinterpret_cast<uintptr_t>(a.q[h]) % kVec == 0);
  }
  if (a.quant) ok = ok && a.q_stride % kVec == 0;
  return ok;
}

// Rows of at most kSwigluRegs * warp-size vectors (1024 bf16 a half on CUDA) take a warp each, kWarpRowsPerBlock
// rows a block; longer rows a block each, sized so that the row fits the register cache (kRegs above; at most
// kSwigluMaxThreads threads).
constexpr int kWarpRowsPerBlock = 8;

template <InputKind K, Fp8Format F, bool kBwd, bool kQuant, int kVec, bool kWarpRow, bool kH, int kRegs>
int launch_swiglu_rows(const SwigluArgs& a, dim3 grid, dim3 block, gpuStream_t stream) {
  using T = typename SwigluElem<K>::storage;
  constexpr bool kTable = kSwigluTable<K, kBwd>;
  auto kernel = swiglu_rows_kernel<K, F, kBwd, kQuant, kVec, kWarpRow, kH, kRegs>;
  // The quantizing forward's h cache (kRegs vectors a thread, at most 16 KB a block)
  // after the bf16 forward's table.
  const size_t smem = (kQuant && !kBwd ? static_cast<size_t>(block.x) * kRegs * sizeof(Array<T, kVec>) : 0) +
                      (kTable ? kSwigluTableBytes : 0);
  if constexpr (kTable) {
    // Each block copies the table once: persistent blocks, as many as fit.
    if (a.silu_table == nullptr) return 1;
    const dim3 fill_grid(static_cast<unsigned>(ceil_div(kSiluTableEntries, 256)));
    const int err = launch_kernel(swiglu_silu_table_kernel<>, fill_grid, dim3(256), 0, stream, 1, a.silu_table);
    if (err != 0) return err;
    const int64_t most = int64_t{multiprocessor_count()} * resident_blocks(kernel, static_cast<int>(block.x), smem);
    grid.x = static_cast<unsigned>(std::min<int64_t>(grid.x, most));
  }
  return launch_kernel(kernel, grid, block, smem, stream, 1, a);
}

template <InputKind K, Fp8Format F, bool kBwd, bool kQuant, int kVec, bool kH>
int launch_swiglu_vec(const SwigluArgs& a, gpuStream_t stream) {
  const int64_t nvec = a.hidden / kVec;
  if (nvec <= int64_t{kSwigluRegs} * kWarpSize) {
    const dim3 block(kWarpRowsPerBlock * kWarpSize);
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(ceil_div(a.rows, kWarpRowsPerBlock), int64_t{1} << 20)));
    return launch_swiglu_rows<K, F, kBwd, kQuant, kVec, true, kH, kSwigluRegs>(a, grid, block, stream);
  }
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(a.rows, int64_t{1} << 20)));
  if constexpr (kQuant || kBwd) {
    if (nvec <= int64_t{kSwigluBlockRegs} * kSwigluMaxThreads) {
      const dim3 block(static_cast<unsigned>(round_up(ceil_div(nvec, kSwigluBlockRegs), kWarpSize)));
      return launch_swiglu_rows<K, F, kBwd, kQuant, kVec, false, kH, kSwigluBlockRegs>(a, grid, block, stream);
    }
  }
  const int64_t want = round_up(ceil_div(nvec, kSwigluRegs), kWarpSize);
  const dim3 block(static_cast<unsigned>(std::min<int64_t>(want, kSwigluMaxThreads)));
  return launch_swiglu_rows<K, F, kBwd, kQuant, kVec, false, kH, kSwigluRegs>(a, grid, block, stream);
}

template <InputKind K, Fp8Format F, bool kBwd, bool kQuant, bool kH = false>
int launch_swiglu_t(const SwigluArgs& a, gpuStream_t stream) {
  using T = typename SwigluElem<K>::storage;
  constexpr int kVec = 16 / sizeof(T);
  if (swiglu_vector_ok<T, kVec>(a)) return launch_swiglu_vec<K, F, kBwd, kQuant, kVec, kH>(a, stream);
  return launch_swiglu_vec<K, F, kBwd, kQuant, 1, kH>(a, stream);
}

// The whole family: runtime (input kind, fp8 format, direction, quantize) to the kernel instantiation (no quantization:
// the format is unused). block_max reuses its shared words row after row safely: a thread writes them for the next row
// only after the barrier every thread reaches after reading this row's result.
inline int launch_swiglu(InputKind in, Fp8Format fmt, const SwigluArgs& a, gpuStream_t stream) {
  if (a.rows == 0 || (a.hidden == 0 && !a.quant)) return 0;
  // The quantizing backward encodes from the grad_h13 it writes: it must be given one
  // (an empty grad_h13, hidden == 0, has a null pointer and nothing to encode).
  if (a.backward && a.quant && a.out == nullptr && a.hidden > 0) return 1;
  // h comes with the quantizing backward only (the one op that asks for it).
  if (a.h_out != nullptr && !(a.backward && a.quant)) return 1;
  const bool quant = a.quant;
  int err = 0;
  dispatch_input_fp8(in, quant ? fmt : Fp8Format::kE4M3FN, [&](auto kc, auto fc) {
    constexpr InputKind K = decltype(kc)::value;
    constexpr Fp8Format F = decltype(fc)::value;
    constexpr Fp8Format kAny = Fp8Format::kE4M3FN;  // one instantiation without quantization
    if (a.backward) {
      if (!quant) err = launch_swiglu_t<K, kAny, true, false>(a, stream);
      else if (a.h_out != nullptr) err = launch_swiglu_t<K, F, true, true, true>(a, stream);
      else err = launch_swiglu_t<K, F, true, true>(a, stream);
    } else {
      err = quant ? launch_swiglu_t<K, F, false, true>(a, stream) : launch_swiglu_t<K, kAny, false, false>(a, stream);
    }
  });
  return err;
}

}  // namespace moe_fp8
