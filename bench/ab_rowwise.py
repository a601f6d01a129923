"""A/B timing of the rowwise quantization kernels alone (no peers), for comparing two
builds in the same run (scripts/ab_rowwise.sh builds an older commit beside this one).

    python bench/ab_rowwise.py TAG >> ab.log      # one line: "AB TAG {json}"
    python bench/ab_rowwise.py --table ab.log     # median table over the runs of each tag
"""
import json
import os
import statistics
import sys


def table(path):
    runs = {}
    for line in open(path):
        _, tag, js = line.split(" ", 2)
        runs.setdefault(tag, []).append(json.loads(js))
    old, new = sorted(runs)[::-1] if "new" in runs else sorted(runs)
    print(f"| kernel | {old} µs | {new} µs | {new}/{old} | {old} % copy | {new} % copy |")
    print("|---|---|---|---|---|---|")
    for key in runs[new][0]:
        o = statistics.median(r[key][0] for r in runs[old])
        n = statistics.median(r[key][0] for r in runs[new])
        co = statistics.median(r[key][1] for r in runs[old])
        cn = statistics.median(r[key][1] for r in runs[new])
        print(f"| {key} | {o:.1f} | {n:.1f} | {n / o:.3f} | {100 * co / o:.0f}% | {100 * cn / n:.0f}% |")


if len(sys.argv) == 3 and sys.argv[1] == "--table":
    table(sys.argv[2])
    sys.exit(0)

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import moe_fp8_ext  # noqa: E402
from common import bench_us, copy_us  # noqa: E402
from workloads import balanced_offs  # noqa: E402

F8 = torch.float8_e4m3fn
torch.manual_seed(0)
res = {}
for m, k in [(16384, 7168), (16384, 2048), (65536, 7168), (131072, 2048)]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    res[f"rowwise {m}x{k}"] = (bench_us(lambda: moe_fp8_ext.quantize_rowwise(x, F8)), copy_us(m * k * 3 + m * 4))
    del x
for e, k, n in [(8, 7168, 2048), (16, 5120, 1536), (64, 2048, 1408)]:
    b_t = (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02).transpose(1, 2)
    res[f"experts_fwd {e}x{k}x{n}"] = (bench_us(lambda: moe_fp8_ext.quantize_experts_fwd(b_t, F8)), copy_us(e * k * n * 3 + e * n * 4))
    res[f"experts_bwd {e}x{k}x{n}"] = (bench_us(lambda: moe_fp8_ext.quantize_experts_bwd(b_t, F8)), copy_us(e * k * n * 3 + e * k * 4))
    del b_t
for m, k, n, g in [(16384, 7168, 2048, 8), (32768, 5120, 1536, 16), (65536, 2048, 1408, 64)]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    go = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    offs = balanced_offs(m, g, device="cuda")
    res[f"jagged_dual {m}x{k}x{n} G{g}"] = (bench_us(lambda: moe_fp8_ext.quantize_jagged_colwise_dual(go, a, offs, F8)), copy_us(m * (k + n) * 3 + g * (k + n) * 4))
    del a, go
print("AB " + sys.argv[1] + " " + json.dumps(res))
