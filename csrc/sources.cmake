# The source table of moe_fp8_ext: every file the extension compiles, for the CPU,
# CUDA and HIP builds alike. CMakeLists.txt includes this file;
# scripts/check_cuda_compile.sh parses it (so keep ONE quoted entry per line).
#
#   "<path under csrc/>   <kind>   [<archs>]   [<needs>]"
#
#   kind   CPU  plain C++, always compiled (hipify may rename it foo_hip.cpp).
#          GPU  a .cu file: nvcc compiles it for <archs> ∩ MOE_FP8_CUDA_ARCHS; on ROCm
#               its hipified copy (foo.hip) is compiled for <archs> ∩ MOE_FP8_HIP_ARCHS.
#   archs  GPU only, comma-separated, default "cuda,hip":
#            cuda       every requested CUDA arch      90a, 100a, ...  that CUDA arch only
#            hip        every requested AMD arch       gfx942, ...     that AMD arch only
#          Arch names match exactly (90a is not 90). A file listing no AMD arch is
#          CUDA-only and skipped on ROCm. A file with no requested arch left is skipped
#          with a message; every GPU file defines MOE_FP8_HAS_<NAME> (1 compiled, 0
#          skipped; NAME = the file name without extension, upper-cased) for all sources.
#   needs  cutlass: add the CUTLASS headers (MOE_FP8_CUTLASS_INCLUDE) to this file.
#
# Adding a file is one line, e.g. a Hopper-only CUTLASS GEMM:
#   "gemm/blockwise_grouped_sm90.cu   GPU   90a    cutlass"
set(MOE_FP8_SOURCE_TABLE
  "bindings.cpp                      CPU"
  "core/tuning.cpp                   CPU"
  "rowwise/rowwise_ops.cpp           CPU"
  "rowwise/rowwise_cpu.cpp           CPU"
  "mxfp8/mxfp8_ops.cpp               CPU"
  "mxfp8/mxfp8_cpu.cpp               CPU"
  "mxfp8/swizzle_ops.cpp             CPU"
  "mxfp8/swizzle_cpu.cpp             CPU"
  "blockwise/blockwise_ops.cpp       CPU"
  "blockwise/blockwise_cpu.cpp       CPU"
  "grouping/grouping_ops.cpp         CPU"
  "grouping/grouping_cpu.cpp         CPU"
  "swiglu/swiglu_ops.cpp             CPU"
  "swiglu/swiglu_cpu.cpp             CPU"
  "rowwise/rowwise.cu                GPU   cuda,hip"
  "mxfp8/mxfp8.cu                    GPU   cuda,hip"
  "mxfp8/swizzle.cu                  GPU   cuda,hip"
  "blockwise/blockwise.cu            GPU   cuda,hip"
  "grouping/grouping.cu              GPU   cuda,hip"
  "swiglu/swiglu.cu                  GPU   cuda,hip"
  "gemm/blockwise_grouped_sm90.cu    GPU   90a    cutlass"
  "gemm/rowwise_grouped_sm90.cu          GPU   90a    cutlass"
  "gemm/rowwise_grouped_sm90_cfg0.cu     GPU   90a    cutlass"
  "gemm/rowwise_grouped_sm90_cfg1.cu     GPU   90a    cutlass"
  "gemm/rowwise_grouped_sm90_cfg2.cu     GPU   90a    cutlass"
)
