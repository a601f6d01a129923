// CI shim: the CPU torch wheel ships c10/cuda headers but not this generated one,
// which a CUDA build of torch has. It only says that c10_cuda is a shared library.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
