// CUDA/HIP platform shims of device code: qualifiers, warps, fp8 conversion, async copies,
// atomics, clusters. Host-side launches and device queries: device_runtime.h. Nothing else
// tests the platform (scripts/check_hip.sh).
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MOE_FP8_HD __host__ __device__ __forceinline__
#define MOE_FP8_DEVICE __device__ __forceinline__
#else
#define MOE_FP8_HD inline
#define MOE_FP8_DEVICE inline
#endif

// The CUDA device architecture being compiled (e.g. 900), 0 in host and HIP code: for
// headers that pick CUDA instructions (float_ops.h) without a platform test of their own.
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__)
#define MOE_FP8_CUDA_ARCH __CUDA_ARCH__
#else
#define MOE_FP8_CUDA_ARCH 0
#endif

#if defined(__CUDACC__) || defined(__HIPCC__)

#if defined(USE_ROCM)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#include <cuda_fp8.h>
#endif
#endif

namespace moe_fp8 {

#if defined(USE_ROCM)
constexpr int kWarpSize = 64;  // wave64 on CDNA (MI300/MI350)
constexpr bool kRocm = true;  // for run-time defaults that differ (no #ifdef outside this file)
using gpuStream_t = hipStream_t;
#else
constexpr int kWarpSize = 32;
constexpr bool kRocm = false;
using gpuStream_t = cudaStream_t;
#endif

MOE_FP8_DEVICE uint32_t warp_shfl_xor(uint32_t v, int lane_mask) {
#if defined(USE_ROCM)
  return __shfl_xor(v, lane_mask, kWarpSize);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, kWarpSize);
#endif
}
MOE_FP8_DEVICE uint32_t warp_shfl(uint32_t v, int src_lane) {
#if defined(USE_ROCM)
  return __shfl(v, src_lane, kWarpSize);
#else
  return __shfl_sync(0xffffffffu, v, src_lane, kWarpSize);
#endif
}

MOE_FP8_DEVICE float half_bits_to_float(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

// Hardware float -> fp8 of two values (low byte first), round to nearest even, any NaN
// 0x7F; callers clamp first. sm89+: cvt.rn.satfinite (e4m3fn); gfx940-942: v_cvt_pk_fp8_f32
// (e4m3fnuz); gfx950: the same, e4m3fn, NaN sign cleared. Else numerics.h's software encoder.
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define MOE_FP8_HW_E4M3FN 1
// cvt.rn.satfinite saturates to +-448 and writes NaN as 0x7F: callers may skip the clamp.
#define MOE_FP8_HW_E4M3FN_SATFINITE 1
MOE_FP8_DEVICE uint16_t hw_cvt_e4m3fn_x2(float lo, float hi) {
  return static_cast<uint16_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}
#elif defined(USE_ROCM) && defined(__HIP_DEVICE_COMPILE__) && defined(__has_builtin)
#if __has_builtin(__builtin_amdgcn_cvt_pk_fp8_f32)
#if defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__)
#define MOE_FP8_HW_E4M3FNUZ 1
MOE_FP8_DEVICE uint16_t hw_cvt_e4m3fnuz_x2(float lo, float hi) {
  return static_cast<uint16_t>(__builtin_amdgcn_cvt_pk_fp8_f32(lo, hi, 0, false) & 0xFFFF);
}
#elif defined(__gfx950__)
#define MOE_FP8_HW_E4M3FN 1
MOE_FP8_DEVICE uint16_t hw_cvt_e4m3fn_x2(float lo, float hi) {
  const uint32_t h = __builtin_amdgcn_cvt_pk_fp8_f32(lo, hi, 0, false) & 0xFFFF;
  return static_cast<uint16_t>(h & ~(((h & 0x7F7Fu) + 0x0101u) & 0x8080u));  // 0xFF (-NaN) -> 0x7F
}
#endif
#endif
#endif

// Byte k of the result is byte (sel >> 4k) & 7 of (a, b), a's first (CUDA's __byte_perm).
MOE_FP8_DEVICE uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t ab = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k) r |= static_cast<uint32_t>((ab >> (8 * ((sel >> (4 * k)) & 7))) & 0xFFu) << (8 * k);
  return r;
#endif
}

// Lane-wise unsigned max of two 16-bit lanes (one instruction on CUDA sm90).
MOE_FP8_DEVICE uint32_t umax_u16x2(uint32_t a, uint32_t b) {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__)
  return __vmaxu2(a, b);
#else
  const uint32_t alo = a & 0xFFFFu, blo = b & 0xFFFFu, ahi = a >> 16, bhi = b >> 16;
  return (alo > blo ? alo : blo) | ((ahi > bhi ? ahi : bhi) << 16);
#endif
}

// 16-byte global -> shared copy bypassing registers (cp.async, sm80+ CUDA; else a plain
// copy). Completed for this thread by async_copy_wait*; other threads need a barrier.
MOE_FP8_DEVICE void async_copy_16(void* smem_dst, const void* gmem_src) {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
#else
  *static_cast<uint4*>(smem_dst) = *static_cast<const uint4*>(gmem_src);
#endif
}

// 4-byte global -> shared copy bypassing registers, or zeros when !valid (no read; src is
// then rounded down to 4 bytes, as cp.async wants an aligned address whatever it reads).
// Completed like async_copy_16.
MOE_FP8_DEVICE void async_copy_4_or_zero(uint32_t* smem_dst, const void* gmem_src, bool valid) {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const uintptr_t src = reinterpret_cast<uintptr_t>(gmem_src) & (valid ? ~uintptr_t{0} : ~uintptr_t{3});
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
#else
  *smem_dst = valid ? *static_cast<const uint32_t*>(gmem_src) : 0u;
#endif
}

// An L2 eviction policy (sm80+ CUDA; 0 elsewhere): evict last if `keep`, else evict first.
MOE_FP8_DEVICE uint64_t l2_policy(bool keep) {
  uint64_t p = 0;
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (keep) {
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
  } else {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  }
#else
  (void)keep;
#endif
  return p;
}

// async_copy_16 with an L2 eviction policy.
MOE_FP8_DEVICE void async_copy_16_hint(void* smem_dst, const void* gmem_src, uint64_t policy) {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "l"(policy)
               : "memory");
#else
  (void)policy;
  *static_cast<uint4*>(smem_dst) = *static_cast<const uint4*>(gmem_src);
#endif
}

// 16- and 8-byte global stores with an L2 eviction policy.
MOE_FP8_DEVICE void store_16_hint(void* gmem_dst, uint4 v, uint64_t policy) {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;\n" ::"l"(gmem_dst), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w), "l"(policy)
               : "memory");
#else
  (void)policy;
  *static_cast<uint4*>(gmem_dst) = v;
#endif
}
MOE_FP8_DEVICE void store_8_hint(void* gmem_dst, uint2 v, uint64_t policy) {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("st.global.L2::cache_hint.v2.u32 [%0], {%1, %2}, %3;\n" ::"l"(gmem_dst), "r"(v.x), "r"(v.y), "l"(policy)
               : "memory");
#else
  (void)policy;
  *static_cast<uint2*>(gmem_dst) = v;
#endif
}
// This thread's async copies so far arrive on the shared-memory mbarrier `bar` once they have landed, as one of
// its expected arrivals (sm80+ CUDA: the dSwiGLU GEMM's store warp; nothing elsewhere).
MOE_FP8_DEVICE void async_copy_arrive(void* bar) {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(b) : "memory");
#else
  (void)bar;
#endif
}
MOE_FP8_DEVICE void async_copy_wait_all() {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Close the current group of async copies; wait until at most `kPending` groups remain.
MOE_FP8_DEVICE void async_copy_commit() {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int kPending>
MOE_FP8_DEVICE void async_copy_wait() {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// A short pause in a spin-wait loop (a block waiting for another block's flag).
MOE_FP8_DEVICE void spin_pause() {
#if defined(USE_ROCM)
  __builtin_amdgcn_s_sleep(1);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  __nanosleep(64);
#endif
}

// A load served by L2, not a stale L1 line: words other blocks wrote, read after a flag.
MOE_FP8_DEVICE uint32_t load_l2(const uint32_t* p) {
#if defined(USE_ROCM)
  return *static_cast<const volatile uint32_t*>(p);
#else
  return __ldcg(p);
#endif
}

// A flag between blocks: a release add and an acquire load (device scope).
MOE_FP8_DEVICE void atomic_add_release(uint32_t* p, uint32_t v) {
#if defined(USE_ROCM)
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
#else
  __threadfence();
  atomicAdd(p, v);
#endif
}
MOE_FP8_DEVICE uint32_t load_acquire(const uint32_t* p) {
#if defined(USE_ROCM)
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  const uint32_t v = *static_cast<const volatile uint32_t*>(p);
  __threadfence();
  return v;
#endif
}

// A minimum of resident blocks an SM for __launch_bounds__ on CUDA (a register cap); on
// ROCm it would be a waves-per-eu target the compiler must meet, so it asks for nothing.
#if defined(USE_ROCM)
#define MOE_FP8_CUDA_MIN_BLOCKS(n) 1
#else
#define MOE_FP8_CUDA_MIN_BLOCKS(n) (n)
#endif

// Thread-block clusters with distributed shared memory (sm90+ CUDA), no-ops elsewhere.
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MOE_FP8_HAS_CLUSTERS 1
MOE_FP8_DEVICE void cluster_sync() { cooperative_groups::this_cluster().sync(); }
template <typename T>
MOE_FP8_DEVICE T* cluster_map_shared(T* smem_ptr, unsigned rank) {
  return cooperative_groups::this_cluster().map_shared_rank(smem_ptr, rank);
}
// cluster_sync's halves: arrive releases this thread's writes, wait acquires everyone's;
// each thread alternates them, its warp converged.
MOE_FP8_DEVICE void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
MOE_FP8_DEVICE void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
#else
#define MOE_FP8_HAS_CLUSTERS 0
MOE_FP8_DEVICE void cluster_sync() {}
template <typename T>
MOE_FP8_DEVICE T* cluster_map_shared(T* smem_ptr, unsigned) { return smem_ptr; }
MOE_FP8_DEVICE void cluster_arrive() {}
MOE_FP8_DEVICE void cluster_wait() {}
#endif

}  // namespace moe_fp8

#endif  // __CUDACC__ || __HIPCC__

// Host code, and devices without the instructions: the software encoder only.
#ifndef MOE_FP8_HW_E4M3FN
#define MOE_FP8_HW_E4M3FN 0
#endif
#ifndef MOE_FP8_HW_E4M3FNUZ
#define MOE_FP8_HW_E4M3FNUZ 0
#endif
#ifndef MOE_FP8_HW_E4M3FN_SATFINITE
#define MOE_FP8_HW_E4M3FN_SATFINITE 0
#endif
