"""Where the time of one grouped_mm forward + backward goes, for bf16 and fp8_rowwise
(or the recipes named after the shape, bf16 first) on one shape: torch.profiler's GPU time per step and kernel, then the same step's
wall time three ways, so that time outside the kernels (launch gaps, host work) shows:

  kernels   the sum of the kernel times (profiler), per step
  eager     the benchmark's time (do_bench median of the step, as bench_grouped_mm)
  graph     the step captured once in a CUDA graph and replayed (no host work)
  host      host time to issue one step (no synchronization in between), and
            the host time by op (torch.profiler, CPU, after a warm-up step it does
            not record: the first op a profile records bears the profiler's
            start-up)

and one step's timeline (profiler, from an idle GPU): each kernel's start, duration and
the idle time before it, so that the time between the kernels shows where it falls.

The step is torch.autograd.grad of the output (the bench_grouped_mm timing).
Run: python bench/profile_grouped_mm.py [M K N E] [--recipes fp8_rowwise,fp8_blockwise]"""

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import moe_fp8_ext

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import bench_us, host_us, linear_problem  # noqa: E402

_p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_p.add_argument("shape", nargs="*", type=int, default=[16384, 7168, 2048, 8], help="M K N E (default 16384 7168 2048 8)")
_p.add_argument("--recipes", default="fp8_rowwise", help="comma-separated recipes after bf16 (default fp8_rowwise)")
_args = _p.parse_args()
if len(_args.shape) != 4:
    _p.error(f"expected the shape as M K N E, got {_args.shape}")
m, k, n, e = _args.shape
RECIPES = ["bf16"] + _args.recipes.split(",")
a, w, offs, grad = linear_problem(m, k, n, e)


def graph_us(step) -> float:
    """do_bench median of a CUDA-graph replay of step (inf when it cannot be captured)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        return bench_us(g.replay, warmup_ms=50, rep_ms=300)
    except Exception as ex:  # noqa: BLE001 (report it, do not stop the profile)
        print(f"  (graph capture failed: {type(ex).__name__}: {str(ex).splitlines()[0][:100]})")
        return float("inf")


def profiled(step, activity, steps):
    """torch.profiler over `steps` calls of step(), from an idle GPU to an idle GPU."""
    torch.cuda.synchronize()
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof


def timeline(step) -> None:
    """One step from an idle GPU: every GPU activity in start order, with the idle time
    before it (from the end of the activities before; the first one's is 0)."""
    prof = profiled(step, ProfilerActivity.CUDA, 1)
    acts = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda ev: ev.time_range.start)
    if not acts:
        print("  (no GPU activity recorded)")
        return
    print("  one step's timeline: start µs, duration µs, idle µs before it")
    t0, end, idle = acts[0].time_range.start, acts[0].time_range.start, 0.0
    for ev in acts:
        gap = max(ev.time_range.start - end, 0.0)
        idle += gap
        print(f"    {ev.time_range.start - t0:8.1f} {ev.time_range.elapsed_us():8.1f} {gap:7.1f}  {ev.name[:90]}")
        end = max(end, ev.time_range.end)
    print(f"    {end - t0:8.1f} µs first start to last end, {idle:.1f} µs idle between activities")


def make_step(recipe):
    return lambda: torch.autograd.grad(moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs, recipe=recipe), (a, w), grad)


# The timings first, with no profiler having run in the process yet.
summary = []
for recipe in RECIPES:
    step = make_step(recipe)
    for _ in range(5):
        step()
    eager, graph = bench_us(step, warmup_ms=50, rep_ms=300), graph_us(step)
    # host: the median of five rounds of three steps, each from an idle GPU (so that the
    # launch queue never fills: a full queue makes the host wait for the GPU)
    summary.append([recipe, 0.0, eager, graph, host_us(step, n=3, rounds=5, warmup=0)[0]])

for row in summary:
    recipe = row[0]
    step = make_step(recipe)
    prof = profiled(step, ProfilerActivity.CUDA, 10)
    print(f"== {recipe} ({m}, {k}, {n}, {e}): GPU time per step, by kernel (10 steps profiled)")
    events = [(ev.device_time_total, ev.count, ev.key) for ev in prof.key_averages()]
    events = sorted((ev for ev in events if ev[0] > 0), reverse=True)
    for total_us, count, name in events[:14]:
        print(f"  {total_us / 10 / 1000:7.3f} ms  {count // 10:3d}x  {name[:110]}")
    row[1] = sum(ev[0] for ev in events) / 10
    print(f"  {row[1] / 1000:7.3f} ms  total")
    timeline(step)
    # Host time by op over three steps after a warm-up step the profiler does not record.
    torch.cuda.synchronize()
    captured = []
    with profile(activities=[ProfilerActivity.CPU], schedule=torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1),
                 on_trace_ready=lambda p: captured.append(p.key_averages())) as prof:
        for _ in range(4):
            step()
            prof.step()
        torch.cuda.synchronize()
    print(f"== {recipe}: host time per step, by op (self time; 3 steps profiled after a warm-up step; Python between ops not shown)")
    ops = sorted(captured[0], key=lambda ev: ev.self_cpu_time_total, reverse=True)
    for ev in [ev for ev in ops if ev.key != "ProfilerStep*"][:12]:
        print(f"  {ev.self_cpu_time_total / 3:7.1f} µs  {ev.count // 3:3d}x  {ev.key[:100]}")

print(f"== per step, µs ({m}, {k}, {n}, {e})")
print(f"  {'recipe':12s} {'kernels':>8s} {'eager':>8s} {'graph':>8s} {'host':>8s}")
for recipe, kernels, eager, graph, host in summary:
    print(f"  {recipe:12s} {kernels:8.1f} {eager:8.1f} {graph:8.1f} {host:8.1f}")
(_, kb, eb, gb, _) = summary[0]
for recipe, kf, ef, gf, _ in summary[1:]:
    print(f"  {recipe} vs bf16: kernels {kb / kf:.2f}x, eager {eb / ef:.2f}x, graph {gb / gf:.2f}x")
