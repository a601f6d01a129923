// Host-side GPU runtime: launches (dynamic shared memory, clusters), device queries cached
// per device, and the work counters of dynamic-unit kernels. Its CUDA and HIP branches are
// the only platform tests outside portability.h (scripts/check_hip.sh).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

#include "portability.h"

#if defined(__CUDACC__) || defined(__HIPCC__)

namespace moe_fp8 {

// Let `kernel` take smem_bytes of dynamic shared memory (static shared memory counts
// against the default 48 KB too: opt in for any dynamic size). Returns the error.
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
// A launch configuration whose one attribute is the cluster shape; cfg.attrs points into
// the object, so it is filled in place and never copied.
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

// Launch a kernel in clusters of shape `cluster` (1x1x1: none) with a
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

// Fill n bytes at p with v on `stream`. Returns the error.
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

// The value make() gives for key, kept for the process's life once it gives one (a
// failed query, an empty answer, is asked again). One cache a call site (each lambda is
// its own type); make() runs outside the lock, so two threads may both ask.
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
// by device: the memory clock query is slow (record 024).
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

// Work counters: blocks take their units from a counter in device memory instead of a
// fixed stride, so faster multiprocessors take more (record 028). A counter is two uint32,
// {units handed out, blocks done}, zero when given; the launch's last block zeroes it.
constexpr int kWorkCounters = 16384;  // a device's pool, allocated and zeroed by its first call

// Not covered: one graph instantiated twice and replayed at once on two streams, or a
// destroyed stream's handle reused while its launch runs. A failed pool is not retried.
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

// One counter a stream, or one of its own for each launch captured into a graph (its
// address is baked in); null where the pool is spent or could not be made (the caller
// walks by its stride) and for the per-thread default stream (a different stream a thread).
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

// Device side: the last block of a launch to finish with a work counter zeroes it for
// the next launch. Called by one thread of each block after its last ticket came back.
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
