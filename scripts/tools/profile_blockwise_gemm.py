"""One call of an FP8 blockwise grouped GEMM on issue 14's third shape, for Nsight Compute
(two warm-up calls first: profile the third CUTLASS launch):

  ncu --clock-control none --kernel-name regex:device_kernel --launch-skip 2 --launch-count 1 \\
      --set full --import-source no -o rep python scripts/tools/profile_blockwise_gemm.py [dgrad|forward|wgrad] [M K N E]
  ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv   # stalls per instruction
"""

import sys

import torch

import moe_fp8_ext
from moe_fp8_ext import blockwise_gemm as bg

E4M3 = torch.float8_e4m3fn
which = sys.argv[1] if len(sys.argv) > 1 else "dgrad"
m, k, n, e = (int(v) for v in sys.argv[2:6]) if len(sys.argv) > 5 else (65536, 2048, 1408, 64)
torch.manual_seed(0)
offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (m // e)  # balanced
w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16) * 0.02
b, sb, bt, sbt = moe_fp8_ext.quantize_blockwise_weight_dual(w, E4M3)  # (E, K, N) and (E, N, K)
gemm = bg.blockwise_grouped_mm_2d3d
if which == "wgrad":  # (N, M) x (M, K) grouped over the tokens, groups of m / e
    # (the GEMM treats a group that does not start at a multiple of 128 as empty)
    assert (m // e) % 128 == 0 and m % e == 0, f"wgrad: the groups (m / e = {m / e}) must be multiples of 128"
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    a, sa = moe_fp8_ext.quantize_blockwise_act_transposed_lhs(grad, E4M3, offs)
    b, sb = moe_fp8_ext.quantize_blockwise_act_rhs(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), E4M3, offs)
    gemm = bg.blockwise_grouped_mm_2d2d
elif which == "dgrad":
    a, sa = moe_fp8_ext.quantize_blockwise_act_lhs(torch.randn(m, n, device="cuda", dtype=torch.bfloat16), E4M3)
    b, sb = bt, sbt
else:
    a, sa = moe_fp8_ext.quantize_blockwise_act_lhs(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), E4M3)
for _ in range(3):
    gemm(a, sa, b, sb, offs)
torch.cuda.synchronize()
