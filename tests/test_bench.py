"""The user-path benchmark runs (on the CPU, tiny shapes: a check of the script, not a
measurement), and bench/RESULTS.md is what bench/report.py renders from bench/results."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("table", [["--experts", "--swiglu-ab"], ["--moe", "--compile"]])
def test_bench_experts_smoke(tmp_path, table):
    pytest.importorskip("torchtitan.models.common.moe")
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "bench/bench_experts.py", "--smoke", *table], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    doc = json.load(open(tmp_path / "bench_experts.json"))
    rows = next(iter(doc["data"].values()))
    want = {"bf16", "fp8_rowwise", "fp8_blockwise"} | ({"fp8_blockwise (composed SwiGLU)"} if "--swiglu-ab" in table
                                                       else {"fp8_rowwise+shared", "fp8_blockwise+shared",
                                                             "fp8_rowwise+dispatch", "fp8_blockwise+dispatch",
                                                             "bf16+dispatcher"})
    assert want <= {r["variant"] for r in rows}
    assert all(r["fresh_ms"] > 0 and r["accum_ms"] > 0 for r in rows)
    if "--compile" in table:  # (the MoE layer's fp8 dispatch compiles fullgraph)
        assert {"bf16", "fp8_blockwise", "fp8_blockwise+dispatch", "fp8_rowwise+dispatch"} <= {
            r["variant"] for r in rows if r["mode"] == "compiled"}


def test_bench_fused_accumulation_smoke(tmp_path):
    """--fused-accumulation: the three ways into fp32 main gradients run and are timed (CPU, tiny)."""
    pytest.importorskip("torchtitan.models.common.moe")
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "bench/bench_experts.py", "--smoke", "--fused-accumulation"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = json.load(open(tmp_path / "bench_experts_fused_accumulation.json"))["data"]["fused_accumulation"]
    assert [r["variant"] for r in rows] == ["bf16 (torchtitan), .grad then main_grad +="] + [
        f"{r}, {w}" for r in ("fp8_blockwise", "fp8_rowwise") for w in (".grad then main_grad +=", "fused")]
    assert all(r["step_ms"] > 0 for r in rows)


def test_bench_stack_smoke(tmp_path):
    """--stack: MoE layers in a row, each recipe with and without held weight operands (CPU, tiny)."""
    pytest.importorskip("torchtitan.models.common.moe")
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "bench/bench_experts.py", "--smoke", "--stack", "2"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = json.load(open(tmp_path / "bench_experts_stack.json"))["data"]["stack"]
    assert [r["variant"] for r in rows] == ["bf16"] + [f"{r}{h}" for r in ("fp8_rowwise", "fp8_blockwise")
                                                       for h in ("", "+hold")]
    assert all(r["shape"].startswith("2 x ") and r["fresh_ms"] > 0 for r in rows)


def test_profile_summary():
    """issue 69's profile table: a step split into GEMMs and memory-bound work, the GEMM-only ceiling, and the bound
    that §13's fusions could reach by removing their bf16 bytes at copy bandwidth."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_experts

    m, h = 1000, 100
    assert bench_experts.fusion_bytes(m, h) == 2 * m * 2 * h * 2 + 2 * m * h * 2 + 2 * m * 2 * h
    res = dict(shape="(1000, 64, 100, 4)", variant="fp8_blockwise", total_ms=10.0,
               families={"fp8 grouped GEMM": 6.0, "bf16 grouped GEMM": 1.0, "quantization (ours)": 2.0,
                         "swiglu (ours)": 1.0})
    s = bench_experts.profile_summary(m, h, res, bf16_ms=14.0, tbs=1e-3)  # 1.6e6 bytes at 1 GB/s: 1.6 ms
    assert (s["gemm_ms"], s["memory_bound_ms"], s["memory_bound_share"]) == (7.0, 3.0, 0.3)
    assert (s["vs_bf16"], s["gemm_only_vs_bf16"], s["fusion_bound_vs_bf16"]) == (1.4, 2.0, round(14 / 8.4, 3))
    bf16 = bench_experts.profile_summary(m, h, dict(res, variant="bf16", total_ms=14.0), bf16_ms=14.0, tbs=1e-3)
    assert bf16["vs_bf16"] == bf16["fusion_bound_vs_bf16"] == 1.0


def test_distributed_targets_skip_one_rank_runs():
    """issue 68's target rows come from runs over several ranks: one rank communicates nothing."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import report

    def run(world):
        step = dict(layout="ep", world=world, step_ms=1.0, vs_bf16=1.0, vs_fp8=1.0, comm_bytes_vs_bf16_comm=0.5)
        return dict(commit="abc", device="GPU", data=dict(shape=dict(recipe="fp8_blockwise"), steps=[
            dict(step, variant="bf16"), dict(step, variant="fp8"), dict(step, variant="fp8_comm")]))

    assert report.distributed_table({"bench_distributed_blockwise_x1": run(1)}) == ["(not run)"]
    rows = report.distributed_table({"bench_distributed_blockwise_x1": run(1), "bench_distributed_blockwise_x2": run(2)})
    assert len(rows) == 3 and "2× GPU" in rows[2] and "1×" not in "".join(rows)


def test_results_md_is_generated():
    out = subprocess.run([sys.executable, "bench/report.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_bench_distributed_profile_rows():
    """--profile's table: a row a layout and variant, a column a kernel family, 0 where a variant ran none of it; and
    --profile refuses the CPU (it sums GPU kernel times) before starting any process group."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_distributed

    def prof(total, fams):
        return {"profile": {"total_ms": total, "families": fams}}

    results = {"ep": {"bf16": prof(3.0, {"bf16 grouped GEMM": 2.0, "communication (NCCL)": 1.0}),
                      "fp8": prof(2.5, {"fp8 grouped GEMM": 1.0, "quantization (ours)": 0.5,
                                        "communication (NCCL)": 1.0})}}
    rows = bench_distributed.profile_rows(results)
    assert [(r["layout"], r["variant"], r["kernels_ms"]) for r in rows] == [("ep", "bf16", 3.0), ("ep", "fp8", 2.5)]
    assert list(rows[0])[3:] == ["bf16 grouped GEMM", "communication (NCCL)", "fp8 grouped GEMM", "quantization (ours)"]
    assert (rows[0]["fp8 grouped GEMM"], rows[1]["bf16 grouped GEMM"], rows[1]["quantization (ours)"]) == (
        0.0, 0.0, 0.5)
    out = subprocess.run([sys.executable, "bench/bench_distributed.py", "--device", "cpu", "--profile"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--profile needs --device cuda" in out.stderr, out.stderr[-2000:]


FREED_SCRIPT = """
import sys, weakref
import torch, torch.distributed as dist
sys.path.insert(0, "bench")
import bench_distributed as bd

dist.init_process_group("gloo")
args = type("Args", (), dict(tokens=256, dim=256, hidden=256, experts=8, topk=2, recipe="fp8_blockwise", steps=1,
                             warmup=1, profile=False, curve=2, compile=False))()
layers, build = [], bd.build
bd.build = lambda *a, **k: layers.append(weakref.ref(build(*a, **k))) or layers[-1]()
for layout in ("ep", "fsdp"):
    bd.run_variant(args, bd.VARIANTS[1], layout, torch.device("cpu"), 1, bd.Counter())
    bd.curve(args, bd.VARIANTS[1], layout, torch.device("cpu"), 1, bd.Counter())
print("alive", sum(ref() is not None for ref in layers), "of", len(layers))
"""


def test_bench_distributed_frees_each_variant():
    """Each variant's layer is freed before the next is measured: FSDP2 leaves sharded modules in reference cycles,
    and a layer left to the cycle collector counted in every later variant's peak memory (record 045)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", FREED_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "alive 0 of 4" in out.stdout, out.stdout[-2000:]


def test_bench_distributed_smoke(tmp_path):
    """Two CPU ranks (gloo): every layout (weights sharded on experts and on rows) and
    variant runs, fp8 communication moves
    about half of bf16 communication's bytes (fp8 + scales), and the loss curves come."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "bench/bench_distributed.py", "--device", "cpu", "--tokens", "512", "--dim", "256", "--hidden", "256",
           "--experts", "8", "--steps", "2", "--warmup", "1", "--curve", "3", "--layouts", "ep,fsdp,fsdp_rows"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = json.load(open(tmp_path / "bench_distributed_blockwise_x2.json"))["data"]["steps"]
    assert {(r["layout"], r["variant"]) for r in rows} == {(l, v) for l in ("ep", "fsdp", "fsdp_rows")
                                                           for v in ("bf16", "fp8", "fp8_comm")}
    for r in rows:
        assert r["step_ms"] > 0
        ratio = r["comm_bytes_vs_bf16_comm"]
        assert 0.5 <= ratio <= 0.55 if r["variant"] == "fp8_comm" else ratio == 1.0, r
    curves = json.load(open(tmp_path / "bench_distributed_blockwise_x2.json"))["data"]["curves"]
    assert len(curves) == 12 and all(c["steps"] == 3 and c["first"] > 0 and 0 <= c["after_10_steps"] for c in curves)
    assert all(c["max_rel_diff_vs_bf16"] == 0 for c in curves if c["variant"] == "bf16")
    assert all(c["max_rel_diff_vs_fp32"] == 0 for c in curves if c["variant"] == "fp32")
    assert all(c["router_same_on_every_rank"] for c in curves)  # data-parallel router, EP layout included
    # the fp32 reference really runs in fp32: its losses differ from bf16's
    assert all(c["max_rel_diff_vs_bf16"] > 0 for c in curves if c["variant"] == "fp32")


def test_bench_distributed_compiled_smoke(tmp_path):
    """--compile (two CPU ranks, aot_eager): the fp8 dispatch (EP; FSDP2's hooks break the graph before the
    experts) and the fp8 all-gather (FSDP) traced, about half the bytes each (counted in an eager step), and
    the FSDP layout's fp8_blockwise curve with fp8 communication the same as with bf16's (a tile and its
    transpose share the scale: the backward's operands made from the forward's gather are the same bits)."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "bench/bench_distributed.py", "--device", "cpu", "--tokens", "512", "--dim", "256", "--hidden", "256",
           "--experts", "8", "--steps", "2", "--warmup", "1", "--curve", "3", "--layouts", "ep,fsdp", "--compile"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    data = json.load(open(tmp_path / "bench_distributed_blockwise_x2_compiled.json"))["data"]
    assert data["shape"]["compiled"]
    ratios = {r["layout"]: r["comm_bytes_vs_bf16_comm"] for r in data["steps"] if r["variant"] == "fp8_comm"}
    assert set(ratios) == {"ep", "fsdp"} and all(0.5 <= v <= 0.55 for v in ratios.values()), ratios
    curves = {c["variant"]: c["losses"] for c in data["curves"] if c["layout"] == "fsdp"}
    assert curves["fp8_comm"] == curves["fp8"], curves
