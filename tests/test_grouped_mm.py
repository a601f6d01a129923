"""grouped_mm: numerics against fp32 (SQNR), autograd wiring, torch.compile, a short
MoE FFN training run, and errors. On the CPU (and GPUs without an FP8 grouped GEMM)
this runs the emulated path; on sm90+ the FP8 GEMM."""

import pytest
import torch
import torch.nn.functional as F

import moe_fp8_ext
from moe_fp8_ext import reference as ref
from moe_fp8_ext.moe import MoEExperts
from conftest import DEVICES, randn

F8 = torch.float8_e4m3fn


def sqnr(ref_t, x):
    ref_t, x = ref_t.float(), x.float()
    return (20 * torch.log10(ref_t.norm() / (ref_t - x).norm())).item()


def make_offs(sizes, device):
    return torch.cumsum(torch.tensor(sizes), 0).to(torch.int32).to(device)


CASES = {  # (M, K, N, group sizes)
    # At least ~10^5 elements of A: below that, a handful of outliers moves the SQNR of
    # a fresh draw by more than a dB (measured: K=64 shapes dip under 27 dB in 2-8%
    # of draws; these stay above 27.8 dB over 100 draws each).
    "e4": (512, 256, 64, [128, 0, 256, 128]),
    "e1": (512, 256, 96, [512]),
    "e8_empty": (512, 256, 128, [0, 96, 32, 0, 160, 64, 160, 0]),
    "tail_rows": (640, 256, 48, [192, 384]),  # rows past offs[-1] belong to no group
    "tail_rows_odd_m": (600, 256, 48, [192, 0, 384]),  # and M not a multiple of 16
    # Any group sizes (pad_groups=True, the default): odd, empty, one expert.
    "unaligned_e5": (601, 256, 64, [13, 0, 177, 250, 161]),
    "unaligned_e1": (517, 256, 32, [517]),
    "unaligned_e9_tail": (768, 256, 48, [1, 33, 0, 0, 100, 7, 450, 150, 2]),
}


def fp32_reference(a, b_t, offs):
    a32 = a.detach().float().requires_grad_()
    b32 = b_t.detach().float().requires_grad_()
    out = torch._grouped_mm(a32, b32, offs=offs)
    return a32, b32, out


def check_sqnr_against_fp32(m, k, n, offs, device, pad_groups=True):
    """fp8 grouped_mm forward and backward on fresh realistic data against fp32."""
    experts = offs.numel()
    a = randn((m, k), torch.bfloat16, device).requires_grad_()
    b_t = (randn((experts, n, k), torch.bfloat16, device, outliers=False) * 0.02).transpose(1, 2).detach().requires_grad_()
    out = moe_fp8_ext.grouped_mm(a, b_t, offs, pad_groups=pad_groups)
    grad = randn((m, n), torch.bfloat16, device, outliers=False)
    out.backward(grad)
    a32, b32, out32 = fp32_reference(a, b_t, offs)
    out32.backward(grad.float())
    used = int(offs[-1])
    sizes = torch.diff(offs.cpu(), prepend=offs.new_zeros(1).cpu()).tolist()
    # Thresholds from the issue: fp8 e4m3 with rowwise pow2 scales on N(0,1)+outliers
    # activations and N(0, 0.02) weights.
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert sqnr(out32[:used], out[:used]) >= 27, sizes
    assert sqnr(a32.grad[:used], a.grad[:used]) >= 25, sizes
    assert sqnr(b32.grad, b_t.grad) >= 22 or b32.grad.abs().max() == 0, sizes
    assert b_t.grad.shape == b_t.shape and a.grad.shape == a.shape
    assert bool((a.grad[used:] == 0).all()), "rows past offs[-1] get no gradient"
    assert bool((out[used:] == 0).all()), "rows past offs[-1] have no output"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_sqnr_against_fp32(device, case):
    m, k, n, sizes = CASES[case]
    check_sqnr_against_fp32(m, k, n, make_offs(sizes, device), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["e4", "e1", "e8_empty", "tail_rows", "tail_rows_odd_m"])
def test_sqnr_aligned_groups_without_padding(device, case):
    # pad_groups=False: groups of multiples of 16, any M (with rows past offs[-1], an M
    # that is not a multiple of 16 still needs the padded weight-gradient layout).
    m, k, n, sizes = CASES[case]
    check_sqnr_against_fp32(m, k, n, make_offs(sizes, device), device, pad_groups=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("experts", [1, 7, 32])
def test_sqnr_random_unaligned_groups(device, experts):
    # Fresh random group sizes (any size, some empty) every run: pad_groups=True.
    m = max(512, 40 * experts) + 3
    cuts = torch.sort(torch.randint(0, m + 1, (experts,))).values
    cuts[torch.rand(experts) < 0.2] = m  # empty trailing groups too
    check_sqnr_against_fp32(m, 256, 64, torch.sort(cuts).values.to(torch.int32).to(device), device)


def test_backward_is_the_quantized_math():
    # The output and gradients are the products of the quantized operands (emulated
    # path): checks the autograd wiring, operand layouts and scale placement. Both
    # sides accumulate in fp32 in a different order, then round to bf16: allow one
    # bf16 ulp where a sum lands on a rounding boundary (2^-7 relative at most: an
    # ulp is 2^-8 of the top of its binade and 2^-7 of the bottom).
    m, k, n, sizes = CASES["e4"]
    offs = make_offs(sizes, "cpu")
    a = randn((m, k), torch.bfloat16).requires_grad_()
    b_t = (randn((4, k, n), torch.bfloat16, outliers=False) * 0.02).requires_grad_()
    grad = randn((m, n), torch.bfloat16)
    out = moe_fp8_ext.grouped_mm(a, b_t, offs)
    out.backward(grad)

    qa, sa = ref.quantize_rowwise(a.detach(), F8)
    qb, sb = ref.quantize_experts_fwd(b_t.detach(), F8)
    want_out = torch._grouped_mm(qa.float() * sa, qb.float() * sb, offs=offs).to(torch.bfloat16)
    qg, sg = ref.quantize_rowwise(grad, F8)
    qw, sw = ref.quantize_experts_bwd(b_t.detach(), F8)
    want_ga = torch._grouped_mm(qg.float() * sg, qw.float() * sw, offs=offs).to(torch.bfloat16)
    qgc, sgc, qac, sac = ref.quantize_jagged_colwise_dual(grad, a.detach(), offs, F8)
    gid = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    want_gb = torch._grouped_mm((qgc.float() * sgc[gid]).t(), qac.float() * sac[gid], offs=offs).to(torch.bfloat16)
    for got, want in ((out, want_out), (a.grad, want_ga), (b_t.grad, want_gb.transpose(1, 2))):
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_groups_match_explicit_padding(device):
    # pad_groups runs the forward and input gradient unpadded and quantizes the weight
    # gradient's operands straight into the padded layout. Padding the input by hand,
    # running the aligned path and unpadding must give the same numbers.
    m, k, n, sizes = CASES["unaligned_e9_tail"]
    offs = make_offs(sizes, device)
    a = randn((m, k), torch.bfloat16, device)
    b_t = (randn((len(sizes), n, k), torch.bfloat16, device, outliers=False) * 0.02).transpose(1, 2)
    grad = randn((m, n), torch.bfloat16, device, outliers=False)
    got = []
    for explicit in (False, True):
        aa, bb = a.clone().requires_grad_(), b_t.detach().clone().requires_grad_()
        if explicit:
            ap, starts, ends = moe_fp8_ext.pad_token_groups(aa, offs, 16)
            out = moe_fp8_ext.unpad_token_groups(moe_fp8_ext.grouped_mm(ap, bb, ends, pad_groups=False), offs, starts, m)
        else:
            out = moe_fp8_ext.grouped_mm(aa, bb, offs)
        out.backward(grad)
        used = int(offs[-1])
        got.append((out[:used].float(), aa.grad[:used].float(), bb.grad.float()))
    for fused, explicit in zip(*got):
        torch.testing.assert_close(fused, explicit, rtol=2**-7, atol=1e-5)  # one bf16 ulp


def test_needs_only_weight_grad():
    offs = make_offs([32, 32], "cpu")
    a = randn((64, 32), torch.bfloat16)
    b_t = (randn((2, 32, 16), torch.bfloat16) * 0.02).requires_grad_()
    moe_fp8_ext.grouped_mm(a, b_t, offs).float().sum().backward()
    assert a.grad is None and b_t.grad is not None and torch.isfinite(b_t.grad.float()).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["e4", "unaligned_e5"])
def test_compile_fullgraph_forward_backward(device, case):
    m, k, n, sizes = CASES[case]
    offs = make_offs(sizes, device)
    a = randn((m, k), torch.bfloat16, device)
    b_t = (randn((len(sizes), n, k), torch.bfloat16, device, outliers=False) * 0.02).transpose(1, 2)

    def step(a, b_t, offs):
        return moe_fp8_ext.grouped_mm(a, b_t, offs).float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (step, compiled):
        aa, bb = a.clone().requires_grad_(), b_t.detach().clone().requires_grad_()
        loss = fn(aa, bb, offs)
        loss.backward()
        results.append((loss.detach(), aa.grad, bb.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=1e-2, atol=1e-2)  # same quantized math; fusion may reorder fp32 sums


def train(recipe, dtype, steps=50, device="cpu"):
    torch.manual_seed(0)
    experts, dim, hidden, tokens = 4, 64, 128, 256
    model = MoEExperts(experts, dim, hidden, recipe, dtype, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(dim, dim, generator=g) / dim**0.5
    offs = make_offs([64, 48, 96, 48], device)
    losses = []
    for _ in range(steps):
        x = torch.randn(tokens, dim, generator=g)
        y = torch.tanh(x @ teacher)
        out = model(x.to(dtype).to(device), offs)
        loss = F.mse_loss(out.float(), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_fp8_training_tracks_high_precision():
    # CPU: the baseline runs in fp32 (this CPU has no bf16 grouped GEMM); the fp8 run
    # feeds the same fp32 activations through fp8 quantization.
    base = train("bf16", torch.float32)
    fp8 = train("fp8_rowwise", torch.float32)
    assert base[-1] < 0.8 * base[0], "the model must actually learn"
    # fp8 noise moves individual steps a little; the curve must stay within 5%.
    rel = [abs(f - b) / b for f, b in zip(fp8, base)]
    assert max(rel) < 0.05, max(rel)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(recipe="fp4"), "expected recipe in"),
        (dict(A=torch.randn(4, 8, 2)), "expected A 2-D and B_t 3-D"),
        (dict(B_t=torch.randn(2, 16, 8)), "with the same K"),
        (dict(offs=torch.tensor([16, 32])), "expected offs int32"),
    ],
)
def test_errors(kwargs, message):
    args = dict(A=torch.randn(32, 8), B_t=torch.randn(2, 8, 4), offs=torch.tensor([16, 32], dtype=torch.int32))
    recipe = kwargs.pop("recipe", "fp8_rowwise")
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        moe_fp8_ext.grouped_mm(args["A"], args["B_t"], args["offs"], recipe=recipe)


def test_debug_checks_group_alignment(monkeypatch):
    monkeypatch.setenv("MOE_FP8_DEBUG", "1")
    with pytest.raises(ValueError, match="multiples of 16 for the fp8 GEMM, got 8 for group 1"):
        moe_fp8_ext.grouped_mm(torch.randn(32, 16), torch.randn(2, 16, 8), torch.tensor([16, 24], dtype=torch.int32), pad_groups=False)


def test_backend_report():
    assert moe_fp8_ext.grouped_mm_backend("cpu") == "emulated"
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        assert moe_fp8_ext.grouped_mm_backend("cuda") == "fp8_gemm"


# ======================================================================================
# GPU only (moved here from the former tests/test_gpu.py): the whole grouped_mm step,
# forward and backward, never syncs with the host; captured in a CUDA graph it
# replays bit-equal to eager. Skipped without a CUDA GPU and build.
# ======================================================================================

from conftest import graph_matches_eager, requires_cuda  # noqa: E402


@requires_cuda
@pytest.mark.gpu
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

    graph_matches_eager(step)
