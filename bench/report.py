"""Render bench/RESULTS.md from the benchmarks' JSON (bench/results/*.json, each the
latest run of one benchmark as bench/common.py's write_json writes it): the targets
table first, then every run's tables with its device, torch, commit, date and command.

    python bench/report.py            # writes bench/RESULTS.md
    python bench/report.py --check    # exits 1 if RESULTS.md is not what the JSON renders
"""

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# The open targets, as data: (what, benchmark, table, shape, variant, mode, column, op, bound).
TARGETS = [
    *[("GroupedExperts fresh step vs bf16", "bench_experts", "grouped_experts", s, v, "eager", "fresh_vs_bf16", ">=", t)
      for v, ts in (("fp8_blockwise", (1.40, 1.20, 1.25, 1.12)), ("fp8_rowwise", (1.40, 1.10, 1.15, 1.00)))
      for s, t in zip(("(32768, 7168, 2048, 8)", "(16384, 5120, 1536, 16)", "(65536, 2048, 1408, 64)",
                       "(65536, 2048, 768, 128)"), ts)],
    *[("GroupedExperts accumulating micro-batch vs bf16", "bench_experts", "grouped_experts", s, v + "+reuse", "eager",
       "accum_vs_bf16", ">=", t)
      for v, ts in (("fp8_blockwise", (1.40, 1.20, 1.25, 1.12)), ("fp8_rowwise", (1.40, 1.10, 1.15, 1.00)))
      for s, t in zip(("(32768, 7168, 2048, 8)", "(16384, 5120, 1536, 16)", "(65536, 2048, 1408, 64)",
                       "(65536, 2048, 768, 128)"), ts)],
    *[("GroupedExperts peak vs bf16", "bench_experts", "grouped_experts", s, v, "eager", "peak_vs_bf16", "<=", 1.0)
      for v in ("fp8_blockwise", "fp8_rowwise")
      for s in ("(32768, 7168, 2048, 8)", "(16384, 5120, 1536, 16)", "(65536, 2048, 1408, 64)",
                "(65536, 2048, 768, 128)")],
    *[("MoE layer fresh step vs bf16", "bench_experts", "moe", s, v, "eager", "fresh_vs_bf16", ">=", 1.15)
      for v in ("fp8_blockwise", "fp8_blockwise+shared", "fp8_blockwise+dispatch")
      for s in ("(16384, 2048, 1408, 64, top-6)", "(8192, 7168, 2048, 32, top-8)")],
]
TARGET_DEVICE = "H100"  # the targets' GPU: the table reads only runs on it


def _fmt(v):
    if isinstance(v, dict):
        return "; ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def _table(rows):
    if not rows:
        return ["(no rows)"]
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return out


def load(folder):
    """{benchmark: run}, each benchmark's latest run (by date, then file name) first."""
    docs = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            docs.append(json.load(f))
    return {d["benchmark"]: d for d in sorted(docs, key=lambda d: (d["benchmark"].split()[0], d["benchmark"]))}


def targets_table(runs):
    lines = ["| target | shape | variant | measured | bound | met | commit |", "|---|---|---|---|---|---|---|"]
    for what, bench, table, shape, variant, mode, col, op, bound in TARGETS:
        hit, where = None, None
        for name, doc in runs.items():  # the benchmark's latest run first, then earlier ones that have the row
            mine = name.startswith(bench) and TARGET_DEVICE in doc.get("device", "")
            rows = doc.get("data", {}).get(table, []) if mine else []
            hit = next((r for r in rows if r["shape"] == shape and r["variant"] == variant and r["mode"] == mode), None)
            if hit is not None:
                where = doc["commit"]
                break
        v = None if hit is None else hit.get(col)
        met = "not run" if v is None else ("yes" if (v >= bound if op == ">=" else v <= bound) else "**no**")
        lines.append(f"| {what} | {shape} | {variant} | {_fmt(v)} | {op} {bound:.2f} | {met} | {where or ''} |")
    return lines


def compiled_table(runs):
    """Compiled at least as fast as eager, within noise (3%): each variant's fresh step
    (GroupedExperts and the MoE layer), from every run that has compiled rows (each shape from the first that has it), and
    the compiled step's peak against compiled bf16's (issue 65's peak target, compiled)."""
    lines = ["| shape | variant | eager ms | compiled ms | eager / compiled | met (>= 0.97) | compiled peak vs compiled bf16 "
             "(<= 1.00) | run |", "|---|---|---|---|---|---|---|---|"]
    seen = set()
    for name, doc in runs.items():
        data = doc["data"] if name.startswith("bench_experts") else {}
        rows = data.get("grouped_experts", []) + data.get("moe", [])
        eager = {(r["shape"], r["variant"]): r["fresh_ms"] for r in rows if r["mode"] == "eager"}
        shapes = {r["shape"] for r in rows if r["mode"] == "compiled"} - seen
        for r in rows:
            e = eager.get((r["shape"], r["variant"]))
            if r["mode"] == "compiled" and r["shape"] in shapes and e:
                ratio, peak = e / r["fresh_ms"], r.get("peak_vs_bf16")
                peak = "" if peak is None else f"{_fmt(peak)} ({'yes' if peak <= 1.0 else '**no**'})"
                lines.append(f"| {r['shape']} | {r['variant']} | {_fmt(e)} | {_fmt(r['fresh_ms'])} | {_fmt(ratio)} | "
                             f"{'yes' if ratio >= 0.97 else '**no**'} | {peak} | {doc['commit']}, {doc['device']} |")
        seen |= shapes
    return lines if seen else ["(no compiled rows)"]


def distributed_table(runs):
    """Issue 68's targets (set for 4 H100s) against the latest bench_distributed run of
    each recipe:
    fp8 communication's bytes, its step against bf16 and against the same recipe
    communicating in bf16, and the loss curve against bf16, next to bf16's own curve against fp32 (the
    same measure: the floor of a loss gap on that task)."""
    docs = [d for n, d in runs.items() if n.startswith("bench_distributed") and not n.endswith("_profile")
            and d["data"]["steps"][0]["world"] > 1]  # (one rank communicates nothing: no target row)
    if not docs:
        return ["(not run)"]
    lines = ["| recipe | layout | bytes vs bf16 comm (<= 0.55) | step vs bf16 (>= 1.25) | step vs fp8 with bf16 comm "
             "(>= 1.10) | loss vs bf16, max rel. (< 0.01) | bf16's loss vs fp32 | run |",
             "|---|---|---|---|---|---|---|---|"]
    for doc in docs:
        lines += _distributed_rows(doc)
    return lines


def _distributed_rows(doc):
    data = doc["data"]
    curves = {(c["layout"], c["variant"]): c for c in data.get("curves", [])}
    lines = []
    run = f"{doc['commit']}, {data['steps'][0]['world']}× {doc['device']}" + (", compiled" if data["shape"].get(
        "compiled") else "")
    for r in data["steps"]:
        if r["variant"] != "fp8_comm":
            continue
        c = curves.get((r["layout"], r["variant"]))
        cells = [(r["comm_bytes_vs_bf16_comm"], "<=", 0.55), (r["vs_bf16"], ">=", 1.25), (r["vs_fp8"], ">=", 1.10),
                 (None if c is None else c["max_rel_diff_vs_bf16"], "<", 0.01)]
        out = []
        for i, (v, op, bound) in enumerate(cells):
            met = v is not None and (v <= bound if op == "<=" else v >= bound if op == ">=" else v < bound)
            shown = f"{v:.4f}" if i == 3 and v is not None else _fmt(v)
            out.append("not run" if v is None else f"{shown} ({'yes' if met else '**no**'})")
        if c is not None and r["layout"] == "ep" and "router_same_on_every_rank" not in c:
            out[3] += " per-rank routers (record 042)"
        floor = curves.get((r["layout"], "bf16"), {}).get("max_rel_diff_vs_fp32")
        out.append("not run" if floor is None else f"{floor:.4f}")
        lines.append(f"| {r.get('recipe', 'fp8_blockwise')} | {r['layout']} | " + " | ".join(out) + f" | {run} |")
    return lines


def render(runs):
    lines = ["# Results", "",
             "Generated by `python bench/report.py` from bench/results/*.json, the latest run of each benchmark; "
             "do not edit by hand. Earlier tables are in git history (this file at 24f1daf holds the kernel-level "
             "tables of the sessions before this format).", "",
             f"## Targets ({TARGET_DEVICE} runs; user path: torchtitan's modules, backward into .grad, router group "
             "sizes)", "",
             *targets_table(runs), "",
             "Runs of commits before 7a11733 held the weights' backward operands from the forward (then the "
             "default; record 050): faster single layers, more memory a layer in a model.", "",
             "Compiled (torch.compile, fullgraph) against eager:", "",
             *compiled_table(runs), "",
             "FP8 communication (`bench/bench_distributed.py`; targets set for 4 H100s):", "",
             *distributed_table(runs), ""]
    largest = {}  # (the paper model of each recipe's largest bench_distributed run only)
    for name, doc in runs.items():
        if name.startswith("bench_distributed"):
            recipe, world = doc["data"]["shape"].get("recipe"), doc["data"]["steps"][0]["world"]
            largest[recipe] = max(largest.get(recipe, 0), world)
    for name, doc in runs.items():
        lines += [f"## {name}", "", f"{doc['device']}, torch {doc['torch']}, commit {doc['commit']}, {doc['date']}: "
                  f"`{doc['command']}`", ""]
        data = doc["data"]
        groups = data.items() if isinstance(data, dict) else [(None, data)]
        if name.startswith("bench_distributed"):
            if data["steps"][0]["world"] < largest[data["shape"].get("recipe")]:
                groups = [(k, v) for k, v in groups if k != "paper_model"]
            groups = [(k, v) for k, v in groups if k != "variants_freed"]
            if not data.get("variants_freed"):
                lines += ["peak_gib: past the first row, each also holds the earlier variants' layers, which the "
                          "benchmark did not free then (record 045); only the first row's is its variant's own.", ""]
        for key, rows in groups:
            if key:
                lines += [f"### {key}", ""]
            lines += _table(rows if isinstance(rows, list) else [rows]) + [""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    text = render(load(args.results))
    path = os.path.join(HERE, "RESULTS.md")
    if args.check:
        same = os.path.exists(path) and open(path).read() == text
        print("RESULTS.md is up to date" if same else "RESULTS.md differs from what bench/results renders")
        return 0 if same else 1
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
