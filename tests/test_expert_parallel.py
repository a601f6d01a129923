"""examples/expert_parallel.py under torchrun with two processes: its outputs and the
gradients of its input, experts and router must match a single-process run of the
same layer (the example checks and exits 1 otherwise). And examples/fsdp2_experts.py:
the experts layer sharded by FSDP2 over two processes trains like an unsharded copy
and never uses its weight cache. CPU (gloo) everywhere; two GPUs (NCCL) when the
machine has them."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import HAS_CUDA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "expert_parallel.py")
FSDP2_EXAMPLE = os.path.join(ROOT, "examples", "fsdp2_experts.py")


def run_torchrun(*args, example=EXAMPLE, ok="expert_parallel: OK"):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", example, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0 and ok in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("extra", [[], ["--topk", "1", "--experts-per-rank", "3", "--tokens", "37"]])
def test_expert_parallel_matches_single_process_cpu(extra):
    run_torchrun("--device", "cpu", *extra)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and torch.cuda.device_count() >= 2), reason="needs two CUDA GPUs")
def test_expert_parallel_matches_single_process_two_gpus():
    print(run_torchrun("--device", "cuda"))


def test_fsdp2_experts_two_ranks_cpu():
    print(run_torchrun("--device", "cpu", example=FSDP2_EXAMPLE, ok="): OK"))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and torch.cuda.device_count() >= 2), reason="needs two CUDA GPUs")
def test_fsdp2_experts_two_gpus():
    print(run_torchrun("--device", "cuda", example=FSDP2_EXAMPLE, ok="): OK"))
