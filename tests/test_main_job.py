"""python -m moe_fp8_ext --check: every case it lists matches the reference at an odd
size, and a mismatch makes it fail (exit 1)."""

import pytest
import torch

from moe_fp8_ext import __main__ as main_job

ARGS = ["--check", "--tokens", "300", "--hidden", "256", "--ffn", "128", "--experts", "3", "--iters", "1"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_check_passes(device, capsys):
    assert main_job.main(ARGS + ["--device", device]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if " yes " in line or " NO " in line]
    assert len(rows) == 14 and all(" yes " in r for r in rows), rows


def test_check_fails_on_a_mismatch(monkeypatch, capsys):
    real = main_job.ref.swiglu_backward
    monkeypatch.setattr(main_job.ref, "swiglu_backward", lambda g, h: real(g, h) * 2)
    assert main_job.main(ARGS + ["--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and any(line.startswith("swiglu_backward") and " NO " in line for line in out.splitlines())
