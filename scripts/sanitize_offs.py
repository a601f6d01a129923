"""Run under compute-sanitizer: every op with garbage offs and odd shapes, so that
memcheck sees any out-of-bounds access (scripts/gpu_ci.sh runs it)."""

import torch

import moe_fp8_ext

F8 = torch.float8_e4m3fn
x = torch.randn(4099, 77, device="cuda", dtype=torch.bfloat16)
y = torch.randn(4099, 64, device="cuda", dtype=torch.bfloat16)
for offs in ([700, -5, 100, 2**31 - 1, 30, -2**31], [4099 * 3] * 3, [-1] * 5, [5000, 4098, 4099, 0]):
    o = torch.tensor(offs, dtype=torch.int32, device="cuda")
    moe_fp8_ext.quantize_jagged_colwise(x, o, F8)
    moe_fp8_ext.quantize_jagged_colwise_dual(x, y, o, torch.float8_e4m3fnuz)
moe_fp8_ext.quantize_rowwise(x, F8)
moe_fp8_ext.quantize_rowwise(x.t(), F8)
w = torch.randn(3, 1000, 33, device="cuda", dtype=torch.bfloat16)
moe_fp8_ext.quantize_experts_fwd(w, F8)
moe_fp8_ext.quantize_experts_bwd(w, F8)
moe_fp8_ext.quantize_experts_fwd(w.transpose(1, 2).contiguous().transpose(1, 2), F8)
torch.cuda.synchronize()
print("sanitize_offs: done")
