"""What is alive at the peak of one experts-layer step (forward + backward), bf16 module
math vs moe_fp8_ext.experts: the CUDA caching allocator's trace replayed to its peak,
live tensors listed by size with the line of Python that allocated each. The table
behind bench_experts' "peak MiB" columns.

  python scripts/memory_experts.py [tokens dim hidden experts] [--recipe fp8_rowwise]
"""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/bench")
from bench_experts import step_parser, steps  # noqa: E402


def where(frames):
    """The innermost frame in our code (or the benchmark's), else the innermost Python one."""
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    for f in py:
        name = f["filename"]
        if "moe_fp8_ext" in name or "bench_experts" in name:
            return f"{name.rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    return f"{py[0]['filename'].rsplit('/', 1)[-1]}:{py[0]['line']} {py[0]['name']}" if py else "?"


def peak_live(trace):
    live, total, best, best_live = {}, 0, -1, {}
    for ev in trace:
        a = ev["action"]
        if a == "alloc":
            live[ev["addr"]] = (ev["size"], where(ev.get("frames", [])))
            total += ev["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif a in ("free_requested",) and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    return best, best_live


def main():
    p = step_parser(__doc__)
    a = p.parse_args()
    fns, (m, d, h, e) = steps(a)
    for name, step in fns.items():
        step()
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=200000)
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = [ev for dev in snap["device_traces"] for ev in dev]
        best, live = peak_live(trace)
        print(f"\n### {name}: ({m}, {d}, {h}, {e}), peak of one fwd+bwd above the inputs {best / 2**20:.0f} MiB "
              f"({torch.cuda.get_device_name()})")
        by_site = {}
        for size, site in live.values():
            n, s = by_site.get(site, (0, 0))
            by_site[site] = (n + 1, s + size)
        for site, (n, s) in sorted(by_site.items(), key=lambda kv: -kv[1][1]):
            if s >= 2**20:
                print(f"  {s / 2**20:8.0f} MiB  x{n:<3d} {site}")


if __name__ == "__main__":
    main()
