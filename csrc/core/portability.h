// Everything that differs between CUDA and HIP lives here, and only here:
// host/device qualifiers, warp size and shuffles, half-precision bit conversion,
// hardware fp8 conversion availability, and thread-block clusters (sm90+ only).
// Kernel headers include this file and stay free of #ifdef USE_ROCM.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MOE_FP8_HD __host__ __device__ __forceinline__
#define MOE_FP8_DEVICE __device__ __forceinline__
#else
#define MOE_FP8_HD inline
#define MOE_FP8_DEVICE inline
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
// Wave64 on CDNA (MI300/MI350); kernels size their reductions from this.
constexpr int kWarpSize = 64;
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

// 64-bit values through the 32-bit shuffles above, as two halves.
MOE_FP8_DEVICE int64_t warp_shfl_i64(int64_t v, int src_lane) {
  const uint64_t u = static_cast<uint64_t>(v);
  const uint32_t lo = warp_shfl(static_cast<uint32_t>(u), src_lane);
  const uint32_t hi = warp_shfl(static_cast<uint32_t>(u >> 32), src_lane);
  return static_cast<int64_t>((static_cast<uint64_t>(hi) << 32) | lo);
}

MOE_FP8_DEVICE int64_t warp_shfl_xor_i64(int64_t v, int lane_mask) {
  const uint64_t u = static_cast<uint64_t>(v);
  const uint32_t lo = warp_shfl_xor(static_cast<uint32_t>(u), lane_mask);
  const uint32_t hi = warp_shfl_xor(static_cast<uint32_t>(u >> 32), lane_mask);
  return static_cast<int64_t>((static_cast<uint64_t>(hi) << 32) | lo);
}

MOE_FP8_DEVICE float half_bits_to_float(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

// Hardware float -> fp8 conversion of two values (low byte first), round to nearest
// even; callers clamp to +-max first, so saturation never matters. Where no
// instruction exists the bit-exact software encoder of numerics.h is used. Every NaN
// must come out as the positive NaN 0x7F (e4m3fn; numerics.h fixes fnuz bytes).
//  * CUDA sm89+: cvt.rn.satfinite.e4m3x2.f32 gives OCP e4m3fn, 0x7F for any NaN (as
//    cuda_fp8.hpp's reference path of the same conversion, which turns a NaN input
//    into 0x7FFFFFFF first; the inputs are also products, canonical NaNs on NVIDIA).
//  * gfx940/941/942 (MI300): v_cvt_pk_fp8_f32 gives e4m3fnuz (bias 8).
//  * gfx950 (MI350): the same instruction gives OCP e4m3fn; its NaN sign unverified,
//    so the wrapper clears the sign bit of NaN bytes.
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define MOE_FP8_HW_E4M3FN 1
// cvt.rn.satfinite saturates finite values to +-448 and writes NaN as 0x7F, exactly
// what the clamp and the software encoder do, so callers may skip the clamp.
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

// Byte k of the result is byte (sel >> 4k) & 7 of the pair (a, b), a's bytes first
// (CUDA's __byte_perm, one PRMT; the selector's sign-replicate bit is not used).
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

// 16-byte global -> shared copy that bypasses registers (cp.async, sm80+ CUDA), so a
// block can have its whole tile in flight; a plain copy elsewhere. Completed for the
// calling thread by async_copy_wait_all(); other threads need a barrier after it.
MOE_FP8_DEVICE void async_copy_16(void* smem_dst, const void* gmem_src) {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
#else
  *static_cast<uint4*>(smem_dst) = *static_cast<const uint4*>(gmem_src);
#endif
}

// 4-byte global -> shared copy that bypasses registers (cp.async, sm80+ CUDA), or zeros
// when !valid (no global read then): many in flight per thread without registers or
// branches. Completed like async_copy_16. src must be 4-byte aligned when valid; when
// not, it is rounded down to 4 bytes (no byte is read, but cp.async takes an address
// aligned to its copy size whatever the size it reads).
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

// L2 eviction priorities (sm80+ CUDA; 0 and ignored elsewhere): a policy for data that
// is not read again soon (evict first) or is (evict last), for the two calls below.
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

MOE_FP8_DEVICE void async_copy_wait_all() {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Close the current group of async copies; wait until at most `kPending` of this
// thread's groups are still in flight.
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

// A load served by L2 (not a possibly stale L1 line): for words other blocks wrote
// with atomics, read after a flag.
MOE_FP8_DEVICE uint32_t load_l2(const uint32_t* p) {
#if defined(USE_ROCM)
  return *static_cast<const volatile uint32_t*>(p);
#else
  return __ldcg(p);
#endif
}

// A flag between blocks: a release add (every write the block made before a barrier
// is visible to whoever acquires the new value) and an acquire load.
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

// A minimum of resident blocks an SM for __launch_bounds__, where it is only a register
// cap tuned on CUDA: ROCm turns it into an amdgpu-waves-per-eu target that the compiler
// must meet (a -Werror failure when it cannot), so there it asks for nothing.
#if defined(USE_ROCM)
#define MOE_FP8_CUDA_MIN_BLOCKS(n) 1
#else
#define MOE_FP8_CUDA_MIN_BLOCKS(n) (n)
#endif

// Thread-block clusters with distributed shared memory (sm90+ CUDA). Kernels use
// them to split one long reduction across several SMs while keeping every input
// byte on chip between the two passes.
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MOE_FP8_HAS_CLUSTERS 1
MOE_FP8_DEVICE void cluster_sync() { cooperative_groups::this_cluster().sync(); }
template <typename T>
MOE_FP8_DEVICE T* cluster_map_shared(T* smem_ptr, unsigned rank) {
  return cooperative_groups::this_cluster().map_shared_rank(smem_ptr, rank);
}
// The two halves of cluster_sync, so that work can run between them: every thread of
// the cluster arrives (its earlier writes, shared memory of other blocks included,
// released), then waits until all have arrived (acquiring them). Each thread
// alternates the two; the warp must be converged at both.
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

// Host side: let `kernel` take smem_bytes of dynamic shared memory (static shared
// memory counts against the default 48 KB too: opt in for any dynamic size). Returns
// the error.
template <typename... KArgs>
inline int allow_dynamic_smem(void (*kernel)(KArgs...), size_t smem_bytes) {
  if (smem_bytes == 0) return 0;
#if defined(USE_ROCM)
  return static_cast<int>(hipFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                              hipFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
#else
  return static_cast<int>(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
#endif
}

#if !defined(USE_ROCM)
// Host side: a launch configuration whose one attribute is the cluster shape. cfg.attrs
// points into the object, so it is filled in place and never copied.
struct ClusterLaunchConfig {
  cudaLaunchAttribute attr[1] = {};
  cudaLaunchConfig_t cfg = {};
  ClusterLaunchConfig(dim3 grid, dim3 block, size_t smem_bytes, gpuStream_t stream, dim3 cluster) {
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem_bytes;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster.x;
    attr[0].val.clusterDim.y = cluster.y;
    attr[0].val.clusterDim.z = cluster.z;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunchConfig(const ClusterLaunchConfig&) = delete;
  ClusterLaunchConfig& operator=(const ClusterLaunchConfig&) = delete;
};
#endif

// Host side: launch a kernel in clusters of shape `cluster` (1x1x1: none) with a
// dynamic shared-memory size above the 48 KB default. Returns the launch error.
template <typename... KArgs, typename... Args>
inline int launch_kernel_in_clusters(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                                     gpuStream_t stream, dim3 cluster, Args&&... args) {
  const int err = allow_dynamic_smem(kernel, smem_bytes);
  if (err != 0) return err;
#if defined(USE_ROCM)
  (void)cluster;  // callers pass none on ROCm (no clusters); see supports_clusters()
  hipLaunchKernelGGL(kernel, grid, block, smem_bytes, stream, std::forward<Args>(args)...);
  return static_cast<int>(hipGetLastError());
#else
  if (cluster.x * cluster.y * cluster.z <= 1) {
    kernel<<<grid, block, smem_bytes, stream>>>(std::forward<Args>(args)...);
    return static_cast<int>(cudaGetLastError());
  }
  const ClusterLaunchConfig c(grid, block, smem_bytes, stream, cluster);
  return static_cast<int>(cudaLaunchKernelEx(&c.cfg, kernel, std::forward<Args>(args)...));
#endif
}

// launch_kernel_in_clusters with an optional cluster shape along y.
template <typename... KArgs, typename... Args>
inline int launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                         gpuStream_t stream, int cluster_y, Args&&... args) {
  return launch_kernel_in_clusters(kernel, grid, block, smem_bytes, stream,
                                   dim3(1, static_cast<unsigned>(cluster_y > 1 ? cluster_y : 1), 1),
                                   std::forward<Args>(args)...);
}

// Host side: fill n bytes at p with v on `stream`. Returns the error.
inline int memset_async(void* p, int v, size_t n, gpuStream_t stream) {
#if defined(USE_ROCM)
  return static_cast<int>(hipMemsetAsync(p, v, n, stream));
#else
  return static_cast<int>(cudaMemsetAsync(p, v, n, stream));
#endif
}

inline const char* gpu_error_string(int err) {
#if defined(USE_ROCM)
  return hipGetErrorString(static_cast<hipError_t>(err));
#else
  return cudaGetErrorString(static_cast<cudaError_t>(err));
#endif
}

// How many blocks of `kernel` fit on one multiprocessor, and how many there are.
template <typename... KArgs>
inline int resident_blocks(void (*kernel)(KArgs...), int threads, size_t smem_bytes) {
  int n = 1;
#if defined(USE_ROCM)
  const bool ok = hipOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem_bytes) == hipSuccess;
#else
  const bool ok = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem_bytes) == cudaSuccess;
#endif
  return ok && n > 0 ? n : 1;
}

inline int multiprocessor_count() {
  int device = 0, n = 1;
#if defined(USE_ROCM)
  const bool ok = hipGetDevice(&device) == hipSuccess &&
                  hipDeviceGetAttribute(&n, hipDeviceAttributeMultiprocessorCount, device) == hipSuccess;
#else
  const bool ok = cudaGetDevice(&device) == cudaSuccess &&
                  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess;
#endif
  return ok && n > 0 ? n : 1;
}

// Host side: the value make() gives for key, kept for the life of the process once
// make() gives one (a device query that costs host time on every launch otherwise); an
// empty answer (a failed query) is not kept, so the next call asks again. One cache a
// call site: each caller's lambda is a type of its own. make() runs outside the lock, so
// two threads may both ask; both get the same answer.
template <typename Key, typename Make>
inline auto cached_by(const Key& key, Make&& make) -> decltype(make()) {
  using Value = typename decltype(make())::value_type;
  static std::mutex mu;
  static std::map<Key, Value> cache;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  const auto made = make();
  if (made) {
    std::lock_guard<std::mutex> lock(mu);
    cache.emplace(key, *made);
  }
  return made;
}

// How many clusters of `cluster_x` blocks (along x) of `kernel` can be resident on the
// current device at once; 0 where there are no clusters or the query fails. Cached by
// (device, kernel, threads, shared memory, cluster): the query costs host time.
template <typename... KArgs>
inline int resident_clusters_x(void (*kernel)(KArgs...), int threads, size_t smem_bytes, int cluster_x) {
#if defined(USE_ROCM)
  (void)kernel, (void)threads, (void)smem_bytes, (void)cluster_x;
  return 0;
#else
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const std::tuple<int, const void*, int, size_t, int> key{device, reinterpret_cast<const void*>(kernel), threads,
                                                           smem_bytes, cluster_x};
  return cached_by(key, [&]() -> std::optional<int> {
    if (allow_dynamic_smem(kernel, smem_bytes) != 0) return std::nullopt;
    const dim3 cluster(static_cast<unsigned>(cluster_x));
    const ClusterLaunchConfig c(cluster, dim3(static_cast<unsigned>(threads)), smem_bytes, nullptr, cluster);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &c.cfg) != cudaSuccess || n < 0) {
      (void)cudaGetLastError();  // a failed query leaves no sticky error behind
      return std::nullopt;
    }
    return n;
  }).value_or(0);
#endif
}

inline int current_device() {
  int device = 0;
#if defined(USE_ROCM)
  return hipGetDevice(&device) == hipSuccess ? device : 0;
#else
  return cudaGetDevice(&device) == cudaSuccess ? device : 0;
#endif
}

// Whether the current device can run cluster launches (CUDA sm90+).
inline bool supports_clusters(int device) {
#if defined(USE_ROCM)
  (void)device;
  return false;
#else
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
#endif
}

inline int64_t l2_cache_bytes(int device) {
  int bytes = 0;
#if defined(USE_ROCM)
  const bool ok = hipDeviceGetAttribute(&bytes, hipDeviceAttributeL2CacheSize, device) == hipSuccess;
#else
  const bool ok = cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, device) == cudaSuccess;
#endif
  return ok && bytes > 0 ? bytes : 0;
}

// The device's peak DRAM bandwidth per multiprocessor in bytes a nanosecond (two
// transfers a memory clock over the bus), or 0 where the device does not say. Cached
// by device: the memory clock query costs about half a millisecond of host time (seen
// on an H200 as +0.6 ms a call of the op that asked it every launch).
inline double dram_bytes_per_ns_per_sm(int device) {
  // a device that does not say is asked once too (its answer does not change)
  return *cached_by(device, [device]() -> std::optional<double> {
    int khz = 0, bits = 0, sms = 0;
#if defined(USE_ROCM)
    const bool ok = hipDeviceGetAttribute(&khz, hipDeviceAttributeMemoryClockRate, device) == hipSuccess &&
                    hipDeviceGetAttribute(&bits, hipDeviceAttributeMemoryBusWidth, device) == hipSuccess &&
                    hipDeviceGetAttribute(&sms, hipDeviceAttributeMultiprocessorCount, device) == hipSuccess;
    if (!ok) (void)hipGetLastError();  // a failed query leaves no error for the next launch's check
#else
    const bool ok = cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();  // a failed query leaves no error for the next launch's check
#endif
    return ok && khz > 0 && bits > 0 && sms > 0 ? 2.0 * khz * 1e-6 * (bits / 8.0) / sms : 0.0;
  });
}

inline int max_dynamic_smem_per_block(int device) {
  int bytes = 0;
#if defined(USE_ROCM)
  const bool ok = hipDeviceGetAttribute(&bytes, hipDeviceAttributeSharedMemPerBlockOptin, device) == hipSuccess;
#else
  const bool ok = cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess;
#endif
  return ok && bytes > 0 ? bytes : 48 * 1024;
}

// Host side: work counters, for kernels whose blocks take their units from a counter in
// device memory rather than by a fixed stride, so that the blocks of faster
// multiprocessors take more of them (on an H100 the multiprocessors of a grid-stride walk
// finished up to a third of the kernel's time apart: docs/EXPERIMENTS.md, "Dynamic units").
// A counter is two uint32 in device memory, {units handed out, blocks done}, zero when
// given; the launch's last block to finish sets both back to zero. One counter a stream
// (launches on one stream run one after another) and one of its own for each launch
// captured into a CUDA graph (the address is baked into the graph, whose launches are
// ordered with each other). From a pool of kWorkCounters a device, allocated and zeroed
// by the first call on that device (once; a capture in progress allows it); null where
// the pool is spent or could not be made, and the caller then walks by its fixed stride.
// The per-thread default stream's handle names a different stream on each host thread,
// so it gets none. Not covered: one captured graph instantiated twice and the two
// replayed at once on two streams (they share the counter), and a destroyed stream's
// handle given to a new stream while the old one's launch still runs. A pool that could
// not be made is not tried again (the device keeps the stride walk).
constexpr int kWorkCounters = 16384;

inline uint32_t* make_work_counters() {
  const size_t bytes = sizeof(uint32_t) * 2 * kWorkCounters;
  void* p = nullptr;
#if defined(USE_ROCM)
  hipStreamCaptureMode mode = hipStreamCaptureModeRelaxed;
  (void)hipThreadExchangeStreamCaptureMode(&mode);
  hipStream_t s = nullptr;
  bool ok = hipMalloc(&p, bytes) == hipSuccess && hipStreamCreateWithFlags(&s, hipStreamNonBlocking) == hipSuccess &&
            hipMemsetAsync(p, 0, bytes, s) == hipSuccess && hipStreamSynchronize(s) == hipSuccess;
  if (s != nullptr) (void)hipStreamDestroy(s);
  if (!ok) {
    if (p != nullptr) (void)hipFree(p);
    p = nullptr;
    (void)hipGetLastError();
  }
  (void)hipThreadExchangeStreamCaptureMode(&mode);
#else
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;  // allocation is allowed while this thread captures
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  cudaStream_t s = nullptr;
  bool ok = cudaMalloc(&p, bytes) == cudaSuccess && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess &&
            cudaMemsetAsync(p, 0, bytes, s) == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess;
  if (s != nullptr) (void)cudaStreamDestroy(s);
  if (!ok) {
    if (p != nullptr) (void)cudaFree(p);
    p = nullptr;
    (void)cudaGetLastError();
  }
  (void)cudaThreadExchangeStreamCaptureMode(&mode);  // back to the caller's mode
#endif
  return static_cast<uint32_t*>(p);
}

inline uint32_t* work_counter(gpuStream_t stream) {
  struct Pool {
    uint32_t* base = nullptr;
    bool tried = false;
    int next = 0;
    std::map<gpuStream_t, int> of_stream;
  };
  static std::mutex mu;
  static std::map<int, Pool> pools;
  const int device = current_device();
#if defined(USE_ROCM)
  hipStreamCaptureStatus status = hipStreamCaptureStatusNone;
  if (hipStreamIsCapturing(stream, &status) != hipSuccess) {
    (void)hipGetLastError();
    return nullptr;
  }
  const bool captured = status != hipStreamCaptureStatusNone;
#else
  if (stream == cudaStreamPerThread) return nullptr;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {  // e.g. the legacy stream while another captures
    (void)cudaGetLastError();
    return nullptr;
  }
  const bool captured = status != cudaStreamCaptureStatusNone;
#endif
  std::lock_guard<std::mutex> lock(mu);
  Pool& pool = pools[device];
  if (!captured) {
    const auto it = pool.of_stream.find(stream);
    if (it != pool.of_stream.end()) return pool.base + 2 * it->second;
  }
  if (!pool.tried) {
    pool.tried = true;
    pool.base = make_work_counters();
  }
  if (pool.base == nullptr || pool.next == kWorkCounters) return nullptr;
  const int slot = pool.next++;
  if (!captured) pool.of_stream.emplace(stream, slot);
  return pool.base + 2 * slot;
}

// Device side: the last block of a launch to finish with a work counter sets it back to
// zero for the next launch. Called by one thread of each block after the block's last
// ticket came back.
MOE_FP8_DEVICE void release_work_counter(uint32_t* work) {
  __threadfence();  // this block's tickets before its count as done
  if (atomicAdd(work + 1, 1u) == gridDim.x * gridDim.y * gridDim.z - 1) {
    __threadfence();
    static_cast<volatile uint32_t*>(work)[0] = 0;
    static_cast<volatile uint32_t*>(work)[1] = 0;
  }
}

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

namespace moe_fp8 {

// fp32 multiply, add and divide rounded once each and never contracted into a fused
// multiply-add, on host and device alike (code that must give the same bits on the
// CPU and the GPU, e.g. swiglu.h). nvcc contracts a * b + c unless the _rn intrinsics
// are used; clang (HIP device code, clang host builds) honours the pragma; host GCC
// builds compile with -ffp-contract=off (CMakeLists.txt).
MOE_FP8_HD float f_mul(float a, float b) {
#if defined(__CUDA_ARCH__) && !defined(USE_ROCM)
  return __fmul_rn(a, b);
#else
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  return a * b;
#endif
}

MOE_FP8_HD float f_add(float a, float b) {
#if defined(__CUDA_ARCH__) && !defined(USE_ROCM)
  return __fadd_rn(a, b);
#else
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  return a + b;
#endif
}

// 1 / a rounded once (the same bits as f_div(1, a), cheaper on CUDA).
MOE_FP8_HD float f_rcp(float a) {
#if defined(__CUDA_ARCH__) && !defined(USE_ROCM)
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

MOE_FP8_HD float f_div(float a, float b) {
#if defined(__CUDA_ARCH__) && !defined(USE_ROCM)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// RN(1 / d) and RN(x / d) by div.rn's fast path without its operand check and branch
// (CUDA device code only: MOE_FP8_HAS_FAST_DIV). rcp_rn_fast is MUFU.RCP and one
// Newton step, __frcp_rn's fast path (RN(1/d) for d in [1, 2^126)); div_rn_fast(x, d, y)
// with y = rcp_rn_fast(d) is div.rn's fast path after its reciprocal: q = RN(x y), the
// residual x - d q (exact in an fma) and one correction, RN(x / d) wherever div.rn's
// operand check passes. The caller keeps its operands in a range where that is sure
// (swiglu.h: silu_quot_fast) and takes f_div elsewhere.
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__)
#define MOE_FP8_HAS_FAST_DIV 1
MOE_FP8_DEVICE float rcp_rn_fast(float d) {
  float r0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(d));
  return __fmaf_rn(r0, __fmaf_rn(-d, r0, 1.0f), r0);
}

MOE_FP8_DEVICE float div_rn_fast(float x, float d, float y) {
  const float q0 = __fmul_rn(x, y);
  return __fmaf_rn(y, __fmaf_rn(-d, q0, x), q0);
}
#else
#define MOE_FP8_HAS_FAST_DIV 0
#endif

// fp32 to bf16 bits, round to nearest even (subnormals kept, overflow to Inf); a NaN's
// result is unspecified (callers that keep NaNs check for them first). One cvt on sm80+
// CUDA, the same rounding done on the bits elsewhere.
MOE_FP8_HD uint16_t bf16_bits_rn(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(USE_ROCM)
  uint16_t b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
#else
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
#endif
}

}  // namespace moe_fp8
