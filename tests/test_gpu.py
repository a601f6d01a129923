"""GPU-only cases: large shapes, GPU output bit-exact with the CPU op, and the
kernel paths that small shapes do not reach (cluster-split reductions, slices
longer than the shared-memory cache, unaligned group starts, garbage offs)."""

import os
import subprocess
import sys

import pytest
import torch

import moe_fp8_ext
from conftest import FP8_DTYPES, assert_fp8_equal, assert_scale_equal, poison, randn, requires_cuda

pytestmark = [requires_cuda, pytest.mark.gpu]


def same_as_cpu(op, *args):
    poison("cuda")
    gpu = op(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args])
    cpu = op(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    for g, c in zip(gpu, cpu):
        assert g.stride() == c.stride()
        if g.dtype == torch.float32:
            assert_scale_equal(g, c)
        else:
            assert_fp8_equal(g, c)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(16384, 7168), (4096, 40000), (65536, 2048)])
def test_rowwise_large(fp8_dtype, shape):
    same_as_cpu(moe_fp8_ext.quantize_rowwise, randn(shape, torch.bfloat16, "cuda"), fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(8, 7168, 2048), (16, 5120, 1536), (64, 2048, 1408)])
@pytest.mark.parametrize("transposed", [False, True])
def test_experts_large(fp8_dtype, shape, transposed):
    e, k, n = shape
    w = randn((e, n, k), torch.bfloat16, "cuda").transpose(1, 2) if transposed else randn(shape, torch.bfloat16, "cuda")
    same_as_cpu(moe_fp8_ext.quantize_experts_fwd, w, fp8_dtype)
    same_as_cpu(moe_fp8_ext.quantize_experts_bwd, w, fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("m, d1, d2, g", [(16384, 7168, 2048, 8), (65536, 2048, 1408, 64), (20000, 136, 72, 1024)])
def test_jagged_dual_large(fp8_dtype, m, d1, d2, g):
    cuts = torch.sort(torch.randint(0, m + 1, (g,))).values.to(torch.int32)
    cuts[-1] = m
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise_dual, randn((m, d1), torch.bfloat16, "cuda"),
                randn((m, d2), torch.bfloat16, "cuda"), cuts, fp8_dtype)


def test_jagged_skewed_groups_reread_path():
    # One group holds almost every row: far larger than the planned cache, so its
    # slices re-read rows from memory in pass 2; a 16-unaligned start too.
    m = 60000
    offs = torch.tensor([3, 3, 59993, 60000], dtype=torch.int32)
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, randn((m, 256), torch.bfloat16, "cuda"), offs, torch.float8_e4m3fn)
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, randn((m, 100), torch.float32, "cuda"), offs, torch.float8_e4m3fnuz)


def test_jagged_unaligned_groups_and_odd_width():
    m = 5000
    offs = torch.tensor([1, 17, 18, 1000, 1001, 4999], dtype=torch.int32)  # tail row 4999
    x = randn((m, 2 * 769), torch.float16, "cuda")[:, ::2]  # strided: scalar path
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, x, offs, torch.float8_e4m3fn)


@pytest.mark.parametrize("transposed", [False, True])
def test_rowwise_column_major_input_long_k(transposed):
    x = randn((3000, 20000), torch.bfloat16, "cuda")
    same_as_cpu(moe_fp8_ext.quantize_rowwise, x.t() if transposed else x, torch.float8_e4m3fn)


def test_garbage_offs_is_memory_safe():
    # Decreasing, negative and past-the-end offsets: results are unspecified on GPU
    # without MOE_FP8_DEBUG=1, but nothing outside q and scale may be touched.
    x = randn((512, 64), torch.bfloat16, "cuda")
    offs = torch.tensor([700, -5, 100, 2**31 - 1, 30, -2**31], dtype=torch.int32, device="cuda")
    guard = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")
    q, s = moe_fp8_ext.quantize_jagged_colwise(x, offs, torch.float8_e4m3fn)
    torch.cuda.synchronize()
    assert q.shape == (512, 64) and s.shape == (6, 64)
    assert torch.all(guard == 7)


def test_debug_env_checks_offs_on_gpu():
    code = (
        "import torch, moe_fp8_ext\n"
        "x = torch.randn(8, 16, device='cuda', dtype=torch.bfloat16)\n"
        "offs = torch.tensor([6, 4], dtype=torch.int32, device='cuda')\n"
        "try:\n"
        "    moe_fp8_ext.quantize_jagged_colwise(x, offs, torch.float8_e4m3fn)\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
    )
    env = dict(os.environ, MOE_FP8_DEBUG="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "RAISED" in out.stdout and "expected non-decreasing offs" in out.stdout, out.stdout + out.stderr


# ---- token groups -----------------------------------------------------------------------


@pytest.mark.parametrize("tokens, d, g", [(16384, 7168, 8), (16384, 2048, 64), (32768, 5120, 300), (20000, 72, 9000)])
def test_pad_unpad_large_same_as_cpu(tokens, d, g):
    # g = 9000: more groups than fit the per-block tables (read from global memory).
    x = randn((tokens, d), torch.bfloat16, "cuda")
    cuts = torch.sort(torch.randint(0, tokens + 1, (g,))).values.to(torch.int32)
    poison("cuda")
    gpu = moe_fp8_ext.pad_token_groups(x, cuts.cuda(), 16)
    cpu = moe_fp8_ext.pad_token_groups(x.cpu(), cuts, 16)
    for a, b in zip(gpu, cpu):
        assert torch.equal(a.cpu(), b)
    poison("cuda")
    back = moe_fp8_ext.unpad_token_groups(gpu[0], cuts.cuda(), gpu[1], tokens)
    assert torch.equal(back.cpu(), moe_fp8_ext.unpad_token_groups(cpu[0], cuts, cpu[1], tokens))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_jagged_dual_padded_large(fp8_dtype):
    m, g = 16384, 8
    cuts = torch.sort(torch.randint(0, m + 1, (g,))).values.to(torch.int32)
    cuts[-1] = m - 7
    starts, _ = moe_fp8_ext.padded_group_offsets(cuts, m, 16)
    same_as_cpu(lambda a, b, o, f, s: moe_fp8_ext.quantize_jagged_colwise_dual(a, b, o, f, padded_starts=s),
                randn((m, 7168), torch.bfloat16, "cuda"), randn((m, 2048), torch.bfloat16, "cuda"), cuts, fp8_dtype, starts)


def test_token_group_ops_garbage_is_memory_safe():
    x = randn((512, 64), torch.bfloat16, "cuda")
    guard = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")
    bad = torch.tensor([700, -5, 100, 2**31 - 1, 30, -2**31], dtype=torch.int32, device="cuda")
    xp, starts, _ = moe_fp8_ext.pad_token_groups(x, bad, 16)
    moe_fp8_ext.unpad_token_groups(xp, bad, bad, 512)
    torch.ops.moe_fp8.pad_token_groups_at(x, bad, bad, 100)
    moe_fp8_ext.quantize_jagged_colwise(x, bad, torch.float8_e4m3fn, padded_starts=bad)
    moe_fp8_ext.gather_rows(x, bad)
    moe_fp8_ext.scatter_rows(x[:6], bad, 50)
    moe_fp8_ext.permute_indices(torch.tensor([5, -3, 2**30, 7], dtype=torch.int32, device="cuda"), 2, 2, 16, 100)
    torch.cuda.synchronize()
    assert torch.all(guard == 7)


def test_permute_indices_large():
    counts = torch.randint(0, 600, (8 * 32,), dtype=torch.int32)
    m = int(counts.sum())
    max_len = moe_fp8_ext.padded_rows(m, 32, 128)
    gpu = moe_fp8_ext.permute_indices(counts.cuda(), 32, 8, 128, max_len)
    cpu = moe_fp8_ext.permute_indices(counts, 32, 8, 128, max_len)
    for a, b in zip(gpu, cpu):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("plan", ["1,8", "1,40", "2,64", "4,512", "8,16", "8,256"])
def test_cols_plan_override_same_bits(monkeypatch, plan):
    # Any launch plan of the transposing kernel gives the CPU op's bits: caches far
    # shorter than a slice (the re-read path), one-fragment caches, single blocks and
    # 8-block clusters, with unaligned groups, a padded layout and the strided path.
    monkeypatch.setenv("MOE_FP8_COLS_PLAN", plan)
    m = 3001
    offs = torch.tensor([0, 5, 1500, 1517, 2999], dtype=torch.int32)  # empty group, tail rows
    starts, _ = moe_fp8_ext.padded_group_offsets(offs, m, 16)
    x1, x2 = randn((m, 264), torch.bfloat16, "cuda"), randn((m, 96), torch.bfloat16, "cuda")
    same_as_cpu(lambda a, b, o, f: moe_fp8_ext.quantize_jagged_colwise_dual(a, b, o, f), x1, x2, offs, torch.float8_e4m3fn)
    same_as_cpu(lambda a, b, o, f, s: moe_fp8_ext.quantize_jagged_colwise_dual(a, b, o, f, padded_starts=s),
                x1, x2, offs, torch.float8_e4m3fn, starts)
    same_as_cpu(moe_fp8_ext.quantize_jagged_colwise, randn((m, 2 * 77), torch.float32, "cuda")[:, ::2], offs,
                torch.float8_e4m3fnuz)
    w_t = randn((3, 1000, 136), torch.bfloat16, "cuda").transpose(1, 2)
    same_as_cpu(moe_fp8_ext.quantize_experts_bwd, w_t, torch.float8_e4m3fn)


@pytest.mark.parametrize("plan", ["3,64", "2,12", "0,64", "2", "2,64x", "1,100000"])
def test_cols_plan_override_rejects_bad_values(monkeypatch, plan):
    monkeypatch.setenv("MOE_FP8_COLS_PLAN", plan)
    with pytest.raises(RuntimeError, match="MOE_FP8_COLS_PLAN"):
        # W^T: the reduction dimension is strided, so this is the transposing kernel
        moe_fp8_ext.quantize_experts_bwd(randn((2, 32, 64), torch.bfloat16, "cuda").transpose(1, 2), torch.float8_e4m3fn)


def _graph_matches_eager(step):
    """Run step() eagerly under torch's sync-debug mode "error" (a torch-level host
    sync raises), then capture it in a CUDA graph (any host sync, ours in C++ included,
    fails the capture), poison the graph's outputs, replay, and compare bit for bit."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(s):
            eager = [t.clone() for t in step()]
            step()  # warm-up before capture, on the side stream as capture requires
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in outs:
        t.view(torch.uint8).fill_(0xFF)
    graph.replay()
    torch.cuda.synchronize()
    for t, ref in zip(outs, eager):
        assert torch.equal(t.view(torch.uint8), ref.view(torch.uint8)), "graph replay differs from the eager step"


@pytest.mark.parametrize("pad_groups", [True, False])
def test_grouped_mm_step_has_no_host_sync(pad_groups):
    m, k, n = 1000, 256, 384
    # Unaligned groups (and an empty one) need pad_groups; without it, aligned ones
    # (and M = 1000, not a multiple of 16, with rows past the last group).
    ends = [96, 96, 400, 720, 992] if not pad_groups else [90, 90, 401, 733, 990]
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    a = randn((m, k), torch.bfloat16, "cuda").requires_grad_()
    w = (randn((len(ends), n, k), torch.bfloat16, "cuda") * 0.02).requires_grad_()
    g = randn((m, n), torch.bfloat16, "cuda")

    def step():
        out = moe_fp8_ext.grouped_mm(a, w.transpose(1, 2), offs, pad_groups=pad_groups)
        return (out, *torch.autograd.grad(out, (a, w), g))

    _graph_matches_eager(step)


def test_token_group_ops_have_no_host_sync():
    x = randn((3000, 200), torch.bfloat16, "cuda").requires_grad_()
    offs = torch.tensor([0, 700, 701, 2500, 2990], dtype=torch.int32, device="cuda")
    counts = torch.tensor([5, 0, 900, 17, 1200, 33, 400, 1], dtype=torch.int32, device="cuda")  # 2 ranks x 4 experts
    gy = randn((3000, 200), torch.bfloat16, "cuda")

    def step():
        xp, starts, _ends = moe_fp8_ext.pad_token_groups(x, offs, 16)
        y = moe_fp8_ext.unpad_token_groups(xp * 2, offs, starts, x.shape[0])
        xe, pends, idx = moe_fp8_ext.permute_and_pad(y, counts, 4, 2, 16)
        back = moe_fp8_ext.unpermute(xe, idx, x.shape[0])
        return (xp, y, xe, pends, back, *torch.autograd.grad(back, (x,), gy))

    _graph_matches_eager(step)
