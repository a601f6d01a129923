// Two of the FP8 rowwise grouped GEMM configurations (rowwise_grouped_sm90.cuh), in a
// file of their own so the CUTLASS instantiations compile in parallel.
#include "rowwise_grouped_sm90.cuh"

namespace moe_fp8 {
namespace rowwise_gemm {
#if MOE_FP8_RW_GEMM_SM90
void run_Coop128x256C21(const Tables& t, int groups, int sm_count, const at::Tensor& like, const GpuLaunch& gpu, const char* op) {
  run_config<Coop128x256C21>(t, groups, sm_count, like, gpu, op);
}
void run_AddCoop128x256C21(const Tables& t, int groups, int sm_count, const at::Tensor& like, const GpuLaunch& gpu,
                           const char* op) {
  run_config<AddCoop128x256C21>(t, groups, sm_count, like, gpu, op);
}
void run_Coop256x128C21(const Tables& t, int groups, int sm_count, const at::Tensor& like, const GpuLaunch& gpu, const char* op) {
  run_config<Coop256x128C21>(t, groups, sm_count, like, gpu, op);
}
#endif
}  // namespace rowwise_gemm
}  // namespace moe_fp8
