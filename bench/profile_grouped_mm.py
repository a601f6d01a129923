"""Where the time of one grouped_mm forward + backward goes: torch.profiler's
GPU time per step and kernel for bf16 and fp8_rowwise on one shape.
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
    print(f"== {recipe} ({m}, {k}, {n}, {e}): GPU time per step, by kernel (10 steps profiled)")
    events = [(ev.device_time_total, ev.count, ev.key) for ev in prof.key_averages()]
    events = sorted((ev for ev in events if ev[0] > 0), reverse=True)
    for total_us, count, name in events[:12]:
        print(f"  {total_us / 10 / 1000:7.3f} ms  {count // 10:3d}x  {name[:100]}")
    print(f"  {sum(ev[0] for ev in events) / 10 / 1000:7.3f} ms  total")
