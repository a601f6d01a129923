"""The user-path benchmark runs (on the CPU, tiny shapes: a check of the script, not a
measurement), and bench/RESULTS.md is what bench/report.py renders from bench/results."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("table", ["--experts", "--moe"])
def test_bench_experts_smoke(tmp_path, table):
    pytest.importorskip("torchtitan.models.common.moe")
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "bench/bench_experts.py", "--smoke", table], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    doc = json.load(open(tmp_path / "bench_experts.json"))
    rows = next(iter(doc["data"].values()))
    assert {"bf16", "fp8_rowwise", "fp8_blockwise"} <= {r["variant"] for r in rows}
    assert all(r["fresh_ms"] > 0 and r["accum_ms"] > 0 for r in rows)


def test_results_md_is_generated():
    out = subprocess.run([sys.executable, "bench/report.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
