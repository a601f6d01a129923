"""Where the time of one grouped_mm forward + backward goes: torch.profiler's
per-kernel CUDA time for bf16 and fp8_rowwise on one shape.
Run: python bench/profile_grouped_mm.py [M K N E]"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import moe_fp8_ext
from moe_fp8_ext.moe import balanced_offs

m, k, n, e = (int(v) for v in sys.argv[1:5]) if len(sys.argv) == 5 else (16384, 7168, 2048, 8)
a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
offs = balanced_offs(m, e, device="cuda")
grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
for recipe in ("bf16", "fp8_rowwise"):
    step = lambda: moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs, recipe=recipe).backward(grad)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(f"== {recipe} ({m}, {k}, {n}, {e}): per-kernel CUDA time over 10 steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
