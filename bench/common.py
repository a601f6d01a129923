"""Shared benchmark helpers: median timing with CUDA events (triton's do_bench),
the device-to-device copy baseline measured in the same run, and table output."""

import datetime
import os
import statistics
import time
from typing import Callable, List, Optional, Sequence

import torch


def bench_us(fn: Callable[[], object], warmup_ms: int = 30, rep_ms: int = 200) -> float:
    """Median time of fn() in microseconds."""
    from triton.testing import do_bench

    return 1000.0 * do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def host_us(fn: Callable[[], object], n: int = 40, rounds: int = 7, warmup: int = 20):
    """(median, min) over `rounds` rounds of the host time per call of `n` calls in a
    row, each round from an idle GPU (synchronized before it), after `warmup` calls. The
    hosts of the GPU machines are noisy: the same step's mean over 300 calls read 362 and
    765 µs in two runs there, so the rounds' minimum is the figure to compare (noise only
    adds), the median what a call typically takes."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times), min(times)


def bench_interleaved_us(fns: Sequence[Callable[[], object]], rounds: int = 5, rep_ms: int = 60):
    """Several callables measured in alternation: `rounds` short do_bench runs each
    (fn 0, fn 1, ..., then again), so clock and thermal drift over the run reach every
    callable alike (the same op timed twice back to back has differed by 5%). Returns
    (median µs of each, median over the rounds of each one's time / fn 0's time of the
    same round)."""
    from statistics import median

    runs = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            runs[i].append(bench_us(fn, warmup_ms=10, rep_ms=rep_ms))
    ratios = [median(t / t0 for t, t0 in zip(r, runs[0])) for r in runs]
    return [median(r) for r in runs], ratios


def copy_fn(total_bytes: int) -> Callable[[], object]:
    """A device-to-device copy that reads and writes total_bytes in all (total_bytes / 2
    each way): the bandwidth roofline for the same traffic."""
    n = max(total_bytes // 2, 1)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def bench_vs_copy_us(ours: Callable[[], object], total_bytes: int, peer: Optional[Callable[[], object]] = None):
    """ours, a device copy of the same traffic (as copy_us) and the peer (if any), timed
    in alternation (bench_interleaved_us). Returns (ours µs, copy µs, peer µs or None,
    peer / ours: the median of the per-round ratios, or None)."""
    fns = [ours, copy_fn(total_bytes)] + ([peer] if peer else [])
    ts, ratios = bench_interleaved_us(fns)
    return ts[0], ts[1], (ts[2] if peer else None), (ratios[2] if peer else None)


_copy_cache = {}


def copy_us(total_bytes: int) -> float:
    """Time of a device-to-device copy that reads and writes total_bytes in all
    (total_bytes / 2 each way), the bandwidth roofline for the same traffic."""
    if total_bytes not in _copy_cache:
        _copy_cache[total_bytes] = bench_us(copy_fn(total_bytes))
    return _copy_cache[total_bytes]


def torchao_gmm():
    """torchao 0.18's FP8 rowwise grouped GEMM (the autograd function torchtitan's FP8
    MoE path calls): (A, B_t, offs) -> bf16, e4m3fn, scales not rounded to powers of 2."""
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    return lambda a, b_t, offs: _to_fp8_rowwise_then_scaled_grouped_mm(a, b_t, offs, torch.bfloat16,
                                                                       torch.float8_e4m3fn, False)


def try_peer(make: Callable[[], Callable[[], object]]) -> Optional[Callable[[], object]]:
    """A peer's callable, or None when it cannot run here (not installed, refuses
    the shape); the reason is printed once."""
    try:
        fn = make()
        fn()
        torch.cuda.synchronize()
        return fn
    except Exception as e:  # a missing or failing peer must not stop our numbers
        print(f"  (peer unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]})")
        return None


def fmt(v: Optional[float], spec: str = "{:.1f}") -> str:
    return "n/a" if v is None else spec.format(v)


# The grouped_mm issue's (M, K, N, E) shapes: the benchmark's single grouped linear.
GROUPED_MM_SHAPES = [(16384, 7168, 2048, 8), (32768, 5120, 1536, 16), (65536, 2048, 1408, 64), (131072, 7168, 2048, 8)]


def linear_problem(m: int, k: int, n: int, e: int):
    """One grouped linear on the GPU, as every grouped_mm benchmark draws it: A (m, k)
    and W (e, n, k) bf16 leaves that require grad (W ~ N(0, 0.02); B_t = W^T),
    router-like group ends (multiples of 16) and an output gradient (m, n)."""
    from workloads import balanced_offs

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    offs = balanced_offs(m, e, device="cuda")
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    return a, w, offs, grad


def peak_mib(step):
    """Peak CUDA memory of step() above what was allocated before it, MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """20·log10(‖ref‖ / ‖ref − x‖) in dB, in fp32."""
    ref, x = ref.float(), x.float()
    return (20 * torch.log10(ref.norm() / (ref - x).norm())).item()


def print_table(title: str, header: Sequence[str], rows: List[Sequence[str]], out_name: str) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    text = "\n".join(
        [
            f"### {title}",
            f"{dev}, torch {torch.__version__}, {datetime.date.today().isoformat()}",
            "",
            line(header),
            "|" + "|".join("-" * (w + 2) for w in widths) + "|",
            *[line(r) for r in rows],
            "",
        ]
    )
    print(text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, out_name), "a") as f:
            f.write(text + "\n")
    return text


def write_json(name: str, data, argv, launcher: str = "python") -> None:
    """$OUT/<name>.json: the run's device, torch, commit ($BENCH_COMMIT, else git's),
    date and command (``launcher`` and argv) beside ``data`` (bench/report.py renders
    RESULTS.md from it)."""
    import json
    import subprocess
    import sys

    commit = os.environ.get("BENCH_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
        except OSError:
            commit = None
    doc = dict(benchmark=name, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               torch=torch.__version__, commit=commit, date=datetime.date.today().isoformat(),
               command=" ".join([launcher, os.path.relpath(argv[0])] + list(argv[1:])), data=data)
    out = os.environ.get("OUT", ".")
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)


KERNEL_FAMILIES = [  # (label, regex on the kernel name), first match wins
    ("fp8 grouped GEMM", r"f8f8bf16|fp8.*grouped|scaled.*grouped|cutlass.*(e4m3|f8)|GroupProblemShape.*e4m3|Blockwise"),
    ("bf16 grouped GEMM", r"grouped|cutlass|sm90_xmma|gemm|nvjet"),
    ("swiglu (ours)", r"swiglu"),
    ("quantization (ours)", r"quantize|tiles|rows_kernel|cols_kernel"),
    ("token groups / offs", r"copy_rows|padded_offsets|zero_rows|permute|invert|build_tables"),
    ("gradient copy / accumulate", r"copy_kernel|CatArrayBatched|add_kernel|AddFunctor"),
    ("elementwise / reduce (torch)", r"elementwise|vectorized|unrolled|silu|reduce_kernel|fill|cumsum|scan"),
]


def profile_step(name, step, top=10, families=KERNEL_FAMILIES, show=True):
    """torch.profiler's GPU kernel time of one step, summed by kernel family. A short burst (5 steps after 3): near
    the boost clock, where the timed loops run at the power cap's lower clock (decision record 041). ``families``:
    (label, regex) pairs, the first match a kernel's family; ``show``: print the table."""
    import collections
    import re

    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    fam, kern = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            label = next((lb for lb, pat in families if re.search(pat, ev.name, re.I)), "other")
            fam[label] += ev.device_time / 5e3
            kern[ev.name[:100]] += ev.device_time / 5e3
    total = sum(fam.values())
    if show:
        print(f"\n#### {name}: GPU kernel time per step {total:.2f} ms")
        print("| family | ms | share |\n|---|---|---|")
        for k, v in fam.most_common():
            print(f"| {k} | {v:.3f} | {100 * v / total:.1f}% |")
        print(f"top {top} kernels:")
        for k, v in kern.most_common(top):
            print(f"  {v:7.3f} ms  {k}")
    return {"total_ms": total, "families": dict(fam), "kernels": dict(kern.most_common(top))}
