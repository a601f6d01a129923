"""Kernel time of the MXFP8 scale swizzles against torchao's Triton rearranges, on the
inputs of bench_mxfp8.py's swizzle table, from Nsight Compute (each kernel alone, caches
flushed before it; the event-timed table includes what runs around the kernels):

  ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \\
      python scripts/tools/profile_swizzles.py > ncu.csv
  python scripts/tools/profile_swizzles.py --parse ncu.csv

The profiled region is one call of ours then one of torchao's per input, each call
preceded by a marker kernel (torch.cuda._sleep) so the parse can tell the calls apart:
a call's time is the sum of its kernels (torchao's includes the zero fill of its output).
"""

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))


def run():
    from bench_mxfp8 import swizzle_cases  # noqa: E402  (bench/ on the path)
    from common import try_peer

    cases = []
    for name, shape, g, _, ours, peer_make in swizzle_cases():
        peer = try_peer(peer_make)
        ours()
        cases.append((f"{name} {shape} G={g}", ours, peer))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _, ours, peer in cases:
        torch.cuda._sleep(1)
        ours()
        torch.cuda._sleep(1)
        if peer is not None:
            peer()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    for label, _, peer in cases:
        print("CASE", label, "peer" if peer is not None else "no-peer")


def parse(path):
    with open(path) as f:
        lines = f.read().splitlines()
    cases = [ln.split(" ", 1)[1].rsplit(" ", 1) for ln in lines if ln.startswith("CASE ")]
    rows = list(csv.DictReader(ln for ln in lines if ln.startswith('"')))
    calls, cur = [], None
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        ns = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", r.get("Unit", "nsecond"))
        ns *= {"usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9}.get(unit, 1.0)
        if "spin" in r["Kernel Name"]:
            cur = []
            calls.append(cur)
        elif cur is not None:
            cur.append((r["Kernel Name"][:40], ns / 1000.0))
    print("| input | ours µs (kernels) | torchao µs (kernels) | ours faster |")
    print("|---|---|---|---|")
    i = 0
    for label, has_peer in cases:
        ours = calls[i]
        i += 1
        theirs = None
        if has_peer == "peer":
            theirs = calls[i]
        i += 1
        t_o = sum(t for _, t in ours)
        t_p = sum(t for _, t in theirs) if theirs else None
        fmt = lambda ks: " + ".join(f"{t:.1f}" for _, t in ks)  # noqa: E731
        print(f"| {label} | {t_o:.1f} ({fmt(ours)}) | "
              + (f"{t_p:.1f} ({fmt(theirs)}) | {t_p / t_o:.2f}x |" if theirs else "n/a | n/a |"))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parse", metavar="NCU_CSV", help="print the table from ncu's CSV output")
    a = ap.parse_args()
    parse(a.parse) if a.parse else run()
