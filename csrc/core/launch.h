// Torch glue around every GPU launch, for the .cu files only: the device guard, the
// current stream of the tensor's device, and the launch-error check with the op's
// name. Kernel headers stay torch-free; this is the one place that joins them.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "device_runtime.h"
#include "portability.h"

namespace moe_fp8 {

// Holds the device guard for the scope of one op and hands out its current stream:
//   const GpuLaunch gpu(x.device().index());
//   gpu.check(launch_foo(..., gpu.stream()), "foo");
class GpuLaunch {
 public:
  explicit GpuLaunch(int device)
      : device_(device),
        guard_(static_cast<c10::DeviceIndex>(device)),
        stream_(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream()) {}

  gpuStream_t stream() const { return stream_; }
  int device() const { return device_; }

  // err is what a launcher returned (0 on success).
  void check(int err, const char* what) const {
    TORCH_CHECK(err == 0, "moe_fp8: ", what, " kernel launch failed: ", gpu_error_string(err));
  }

 private:
  int device_;
  c10::cuda::CUDAGuard guard_;
  gpuStream_t stream_;
};

}  // namespace moe_fp8
