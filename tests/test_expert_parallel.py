"""examples/expert_parallel.py under torchrun with two and four processes: its outputs
and the gradients of its input, experts and router must match a single-process run of
the same layer (the example checks and exits 1 otherwise). And examples/fsdp2_experts.py:
the experts layer sharded by FSDP2 trains like an unsharded copy that does the same
math by hand, reusing its quantized weights over micro-batches. FP8 communication: the
example's fp8 dispatch (eager and compiled), and tests/fsdp_fp8_all_gather.py (the fp8 all-gather against
the bf16 one, bit for bit). CPU (gloo) everywhere; GPUs (NCCL) when the machine has
enough."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import HAS_CUDA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "expert_parallel.py")
FSDP2_EXAMPLE = os.path.join(ROOT, "examples", "fsdp2_experts.py")
FSDP_FP8 = os.path.join(ROOT, "tests", "fsdp_fp8_all_gather.py")


def run_torchrun(*args, example=EXAMPLE, ok="expert_parallel: OK", ranks=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", example, *args]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert out.returncode == 0 and ok in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("ranks, extra", [(2, []), (2, ["--topk", "1", "--experts-per-rank", "3", "--tokens", "37"]),
                                          (4, []), (2, ["--compile", "aot_eager"])])
def test_expert_parallel_matches_single_process_cpu(ranks, extra):
    run_torchrun("--device", "cpu", *extra, ranks=ranks)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_matches_single_process_gpus(ranks):
    if not (HAS_CUDA and torch.cuda.device_count() >= ranks):
        pytest.skip(f"needs {ranks} CUDA GPUs")
    print(run_torchrun("--device", "cuda", ranks=ranks))


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp2_experts_cpu(ranks):
    print(run_torchrun("--device", "cpu", example=FSDP2_EXAMPLE, ok="): OK", ranks=ranks))


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise"])
def test_fsdp2_experts_gpus(ranks, recipe):
    if not (HAS_CUDA and torch.cuda.device_count() >= ranks):
        pytest.skip(f"needs {ranks} CUDA GPUs")
    print(run_torchrun("--device", "cuda", "--recipe", recipe, example=FSDP2_EXAMPLE, ok="): OK", ranks=ranks))


# The fp8 dispatch against one process whose experts read the dispatched values (the
# rows quantized and dequantized): outputs and every gradient to the example's tolerance
# (in practice bit for bit; the router's gradient sums over ranks in another order).
@pytest.mark.parametrize("ranks, extra", [(2, ["--recipe", "fp8_blockwise"]), (2, ["--recipe", "fp8_rowwise"]),
                                          (2, ["--recipe", "fp8_blockwise", "--topk", "1", "--tokens", "37"]),
                                          (4, ["--recipe", "fp8_blockwise"]),
                                          (2, ["--recipe", "fp8_rowwise", "--compile", "aot_eager"]),
                                          (4, ["--recipe", "fp8_blockwise", "--compile", "aot_eager"])])
def test_fp8_dispatch_matches_single_process_cpu(ranks, extra):
    run_torchrun("--device", "cpu", "--fp8-dispatch", *extra, ranks=ranks)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise"])
@pytest.mark.parametrize("compiled", [[], ["--compile"]])
def test_fp8_dispatch_matches_single_process_gpus(ranks, recipe, compiled):
    if not (HAS_CUDA and torch.cuda.device_count() >= ranks):
        pytest.skip(f"needs {ranks} CUDA GPUs")
    print(run_torchrun("--device", "cuda", "--fp8-dispatch", "--recipe", recipe, *compiled, ranks=ranks))


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
def test_fsdp_fp8_all_gather_cpu(ranks, recipe):
    run_torchrun("--device", "cpu", "--recipe", recipe, example=FSDP_FP8, ok="): OK", ranks=ranks)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
def test_fsdp_fp8_all_gather_gpus(ranks, recipe):
    if not (HAS_CUDA and torch.cuda.device_count() >= ranks):
        pytest.skip(f"needs {ranks} CUDA GPUs")
    print(run_torchrun("--device", "cuda", "--recipe", recipe, example=FSDP_FP8, ok="): OK", ranks=ranks))
