"""The FP8 rowwise grouped GEMMs for Hopper (csrc/gemm/rowwise_grouped_sm90*.cu, our
CUTLASS kernels behind the fp8_rowwise recipe): rowwise_grouped_mm_2d3d (forward /
dgrad) and rowwise_grouped_mm_2d2d (wgrad).

- everywhere (CI has no GPU): the argument checks of the wrappers and of the fakes (the
  same messages), the fakes' shapes on meta tensors, ``available()`` answering False
  without an sm90 GPU, the recipe keeping PyTorch's GEMM where ours is not in use;
- on an sm90 GPU only (skipped elsewhere): every configuration and the pick by shape
  against the fp32 GEMM of the dequantized operands and against torch._scaled_grouped_mm
  (random shapes, empty groups, one group, rows past the last group, partial tiles,
  strided rows), outputs into poisoned memory; misaligned wgrad groups come out zero
  (an error with MOE_FP8_DEBUG=1); CUDA-graph capture (no host sync); opcheck; the
  recipe's GEMMs run on our kernels (profiler) and ``Fp8Rowwise(gemm_kernel="torch")``
  runs PyTorch's; the C++ op's argument checks give the fakes' messages.

Tolerance against the fp32 GEMM of the dequantized operands (fast accumulation: the
tensor cores' partial sums keep about 14 bits, never promoted):
  |out - ref| <= 2^-8 |ref| + 2^-9 (|A| @ |B|)
A wrong scale, a wrong group or an unwritten tile gives errors of order |ref|.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from moe_fp8_ext import rowwise_gemm as rg
from conftest import ROUTER_SIZES_16, graph_matches_eager, offs_from_sizes, poison

E4M3 = torch.float8_e4m3fn
HAS_SM90 = rg.available()
requires_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an NVIDIA GPU of compute capability 9.0 and the sm_90a build")
CONFIGS = list(range(-1, rg.CONFIGS))


def col_major(shape, dtype, device):
    *lead, r, c = shape
    return torch.empty(*lead, c, r, dtype=dtype, device=device).transpose(-1, -2)


def operands_2d3d(m, k, n, e, device="meta"):
    return [torch.empty(m, k, dtype=E4M3, device=device), torch.empty(m, device=device),
            col_major((e, k, n), E4M3, device), torch.empty(e, n, device=device),
            torch.zeros(e, dtype=torch.int32, device=device)]


def operands_2d2d(m, n, k, e, device="meta"):
    return [torch.empty(n, m, dtype=E4M3, device=device), torch.empty(e, n, device=device),
            col_major((m, k), E4M3, device), torch.empty(e, k, device=device),
            torch.zeros(e, dtype=torch.int32, device=device)]


def _edit(ops, i, t):
    ops = list(ops)
    ops[i] = t
    return ops


# ---- everywhere: checks and fakes ---------------------------------------------------------

def test_available_is_false_without_sm90():
    assert not rg.available("cpu")
    if not torch.cuda.is_available():
        assert not rg.available()
        assert not rg.in_use(torch.empty(1, dtype=E4M3))


def test_fake_shapes_meta():
    out = torch.ops.moe_fp8.rowwise_grouped_mm_2d3d(*operands_2d3d(300, 256, 384, 4), torch.bfloat16)
    assert out.shape == (300, 384) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    out = torch.ops.moe_fp8.rowwise_grouped_mm_2d2d(*operands_2d2d(640, 200, 136, 5), torch.bfloat16, 3)
    assert out.shape == (5, 200, 136) and out.dtype == torch.bfloat16


BAD_2D3D = [
    ("a rank", lambda o: _edit(o, 0, o[0][0]), torch.bfloat16, -1, "expected a to be a 2-D tensor, got 1-D"),
    ("a dtype", lambda o: _edit(o, 0, o[0].to(torch.float8_e5m2)), torch.bfloat16, -1, "expected a of dtype float8_e4m3fn"),
    ("scale dtype", lambda o: _edit(o, 1, o[1].double()), torch.bfloat16, -1, "expected scale_a of dtype float32"),
    ("out dtype", lambda o: o, torch.float16, -1, "expected out_dtype bfloat16, got Half"),
    ("config", lambda o: o, torch.bfloat16, 6, "expected config -1 (the pick by shape) or in [0, 6), got 6"),
    ("scale_a shape", lambda o: _edit(o, 1, torch.empty(299, device="meta")), torch.bfloat16, -1,
     "expected scale_a of shape [300], got [299]"),
    ("scale_b shape", lambda o: _edit(o, 3, torch.empty(4, 383, device="meta")), torch.bfloat16, -1,
     "expected scale_b of shape [4, 384], got [4, 383]"),
    ("b layout", lambda o: _edit(o, 2, torch.empty(4, 256, 384, dtype=E4M3, device="meta")), torch.bfloat16, -1,
     "expected b column-major per expert (stride(1) == 1)"),
    ("a row stride", lambda o: _edit(o, 0, torch.empty(300, 264, dtype=E4M3, device="meta")[:, :256]), torch.bfloat16,
     -1, "expected a.stride(0) to be at least 256 and a multiple of 16"),
    ("offs groups", lambda o: _edit(o, 4, torch.zeros(3, dtype=torch.int32, device="meta")), torch.bfloat16, -1,
     "expected offs of shape (4,) (one group per expert of b), got (3,)"),
]


@pytest.mark.parametrize("what, edit, out_dtype, config, msg", BAD_2D3D, ids=[c[0] for c in BAD_2D3D])
def test_checks_2d3d(what, edit, out_dtype, config, msg):
    ops = edit(operands_2d3d(300, 256, 384, 4))
    with pytest.raises(RuntimeError, match=re.escape("rowwise_grouped_mm_2d3d: " + msg)):
        torch.ops.moe_fp8.rowwise_grouped_mm_2d3d(*ops, out_dtype, config)
    with pytest.raises(RuntimeError, match="rowwise_grouped_mm_2d3d: expected"):
        rg.rowwise_grouped_mm_2d3d(*ops, out_dtype, config)


BAD_2D2D = [
    ("b rows", lambda o: _edit(o, 2, col_major((320, 136), E4M3, "meta")), "expected b of shape (M, K) with M = 640"),
    ("scale_a shape", lambda o: _edit(o, 1, torch.empty(5, 199, device="meta")), "expected scale_a of shape [5, 200]"),
    ("b layout", lambda o: _edit(o, 2, torch.empty(640, 136, dtype=E4M3, device="meta")),
     "expected b column-major (stride(0) == 1)"),
    ("K", lambda o: _edit(_edit(o, 2, col_major((640, 132), E4M3, "meta")), 3, torch.empty(5, 132, device="meta")),
     "expected K (the columns of b) to be a multiple of 8"),
]


@pytest.mark.parametrize("what, edit, msg", BAD_2D2D, ids=[c[0] for c in BAD_2D2D])
def test_checks_2d2d(what, edit, msg):
    ops = edit(operands_2d2d(640, 200, 136, 5))
    with pytest.raises(RuntimeError, match=re.escape("rowwise_grouped_mm_2d2d: " + msg)):
        torch.ops.moe_fp8.rowwise_grouped_mm_2d2d(*ops, torch.bfloat16)
    with pytest.raises(RuntimeError, match="rowwise_grouped_mm_2d2d: expected"):
        rg.rowwise_grouped_mm_2d2d(*ops, torch.bfloat16)


BAD_2D2D_ADD = [
    ("out dtype", lambda o, out: (out.bfloat16(), o), "expected out of dtype float32, got torch.bfloat16"),
    ("out shape", lambda o, out: (out[:, :, :128], o), "expected out of shape [5, 200, 136], got [5, 200, 128]"),
    ("out strides", lambda o, out: (out.transpose(1, 2).contiguous().transpose(1, 2), o),
     "expected out contiguous (row-major (E, N, K))"),
    ("operands", lambda o, out: (out, _edit(o, 1, torch.empty(5, 199, device="meta"))),
     "expected scale_a of shape [5, 200]"),
]


@pytest.mark.parametrize("what, edit, msg", BAD_2D2D_ADD, ids=[c[0] for c in BAD_2D2D_ADD])
def test_checks_2d2d_add(what, edit, msg):
    """The fused wgrad-into-main-gradient op: the 2d2d op's rules, then out's, alike in the raw op (its fake, on the
    meta device) and the wrapper."""
    out, ops = edit(operands_2d2d(640, 200, 136, 5), torch.empty(5, 200, 136, device="meta"))
    pattern = re.escape("rowwise_grouped_mm_2d2d_add_: " + msg)
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.moe_fp8.rowwise_grouped_mm_2d2d_add_(out, *ops)
    with pytest.raises(RuntimeError, match=pattern):
        rg.rowwise_grouped_mm_2d2d_add_(out, *ops)
    assert torch.ops.moe_fp8.rowwise_grouped_mm_2d2d_add_(
        torch.empty(5, 200, 136, device="meta"), *operands_2d2d(640, 200, 136, 5)) is None


def _on_device(ops, device):
    """The same shapes, strides and dtypes on `device` (contents unset: the checks read none)."""
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in ops]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("what, edit, out_dtype, config, msg", BAD_2D3D, ids=[c[0] for c in BAD_2D3D])
def test_checks_2d3d_cuda_op(what, edit, out_dtype, config, msg):
    # The C++ op's own checks (the tests above reach the fake on meta tensors): same message.
    ops = _on_device(edit(operands_2d3d(300, 256, 384, 4)), "cuda")
    with pytest.raises(RuntimeError, match=re.escape("rowwise_grouped_mm_2d3d: " + msg)):
        torch.ops.moe_fp8.rowwise_grouped_mm_2d3d(*ops, out_dtype, config)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("what, edit, msg", BAD_2D2D, ids=[c[0] for c in BAD_2D2D])
def test_checks_2d2d_cuda_op(what, edit, msg):
    ops = _on_device(edit(operands_2d2d(640, 200, 136, 5)), "cuda")
    with pytest.raises(RuntimeError, match=re.escape("rowwise_grouped_mm_2d2d: " + msg)):
        torch.ops.moe_fp8.rowwise_grouped_mm_2d2d(*ops, torch.bfloat16)


def test_cpu_tensors_get_a_clear_error():
    with pytest.raises(RuntimeError, match="rowwise_grouped_mm_2d3d: expected CUDA tensors on a GPU of compute"):
        rg.rowwise_grouped_mm_2d3d(*operands_2d3d(32, 64, 64, 2, device="cpu"))


def test_in_use_traces_under_compile_fullgraph(monkeypatch):
    # The recipe calls in_use() inside its autograd.Function under torch.compile; the dispatcher query is not traceable,
    # so dynamo must see a constant (a graph break fails fullgraph). Device 0 pretends to be Hopper, on any machine
    # (torch.cuda.is_available is left alone: dynamo itself consults it).
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * (2.0 if rg._built_for(0) else 3.0)

        @staticmethod
        def backward(ctx, g):
            return g * (2.0 if rg._built_for(0) else 3.0)

    x = torch.ones(4, requires_grad=True)
    torch._dynamo.reset()
    loss = torch.compile(lambda t: Fn.apply(t).sum(), fullgraph=True)(x)
    loss.backward()
    want = 2.0 if rg._built() else 3.0  # the CUDA kernels are in this build, or not
    assert float(loss) == 4 * want and bool((x.grad == want).all())
    torch._dynamo.reset()


def test_in_use_rules(monkeypatch):
    # Where the kernels are available (pretended here), in_use takes e4m3fn operands,
    # and the recipe runs them unless gemm_kernel="torch" (then PyTorch's GEMM).
    from moe_fp8_ext.recipes import Fp8Rowwise

    monkeypatch.setattr(rg, "available", lambda device=None: True)
    assert rg.in_use(torch.empty(1, dtype=E4M3))
    assert not rg.in_use(torch.empty(1, dtype=torch.float8_e4m3fnuz))
    assert not rg.in_use(torch.empty(1, dtype=torch.float8_e5m2))
    assert Fp8Rowwise()._ours(torch.empty(1, dtype=E4M3))
    assert not Fp8Rowwise(gemm_kernel="torch")._ours(torch.empty(1, dtype=E4M3))
    with pytest.raises(ValueError, match="Fp8Rowwise: expected gemm_kernel in \\('auto', 'torch'\\), got 'cutlass'"):
        Fp8Rowwise(gemm_kernel="cutlass")
    monkeypatch.setattr(rg, "available", lambda device=None: False)
    assert not rg.in_use(torch.empty(1, dtype=E4M3))
    assert not Fp8Rowwise()._ours(torch.empty(1, dtype=E4M3))


# ---- on an sm90 GPU -----------------------------------------------------------------------

def fp8(*shape, g):
    return (torch.randn(*shape, generator=g, device="cuda") * 2).clamp(-448, 448).to(E4M3)


def scales(*shape, g):
    return torch.rand(*shape, generator=g, device="cuda") + 0.25


def ranges(offs, m):
    out, start = [], 0
    for e in offs.tolist():
        e = min(max(e, 0), m)
        out.append((start, max(e, start)))
        start = max(e, start)
    return out


def reference_2d3d(a, sa, b, sb, offs):
    ad, bd = a.float() * sa[:, None], b.float() * sb[:, None, :]
    ref = torch.zeros(a.shape[0], b.shape[2], device=a.device)
    mag = torch.zeros_like(ref)
    for g, (s, e) in enumerate(ranges(offs, a.shape[0])):
        ref[s:e] = ad[s:e] @ bd[g]
        mag[s:e] = ad[s:e].abs() @ bd[g].abs()
    return ref, mag


def reference_2d2d(a, sa, b, sb, offs):
    e = offs.numel()
    ref = torch.zeros(e, a.shape[0], b.shape[1], device=a.device)
    mag = torch.zeros_like(ref)
    for g, (s, t) in enumerate(ranges(offs, a.shape[1])):
        ad, bd = a[:, s:t].float() * sa[g][:, None], b[s:t].float() * sb[g][None, :]
        ref[g] = ad @ bd
        mag[g] = ad.abs() @ bd.abs()
    return ref, mag


def assert_close(out, ref, mag):
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    o = out.float()
    assert bool(torch.isfinite(o).all()), f"{int((~torch.isfinite(o)).sum())} non-finite outputs (unwritten?)"
    bad = (o - ref).abs() > 2.0**-8 * ref.abs() + 2.0**-9 * mag + 1e-30
    if bool(bad.any()):
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{int(bad.sum())} of {out.numel()} outputs outside the tolerance; first at {i}: "
                             f"{float(o[i])!r} vs {float(ref[i])!r}")


# Starts at every multiple of 16 below 128 and then below 256 with a whole tile each
# (144 = 128 + 16, 272 = 256 + 16), router-like sizes, then starts off the 16-row steps.
MANY_GROUPS = [144] * 8 + [272] * 16 + ROUTER_SIZES_16 + [100, 129, 37, 256, 300]
# 16 groups of the wgrad cases below, multiples of 16
WGRAD_SIZES_16 = [48, 32, 0, 64, 16, 80, 32, 48, 96, 16, 64, 32, 48, 80, 16, 96]

# (M, K, N, group sizes): empty groups, one group, tails past the last group, partial tiles
CASES_2D3D = [
    (1000, 256, 384, [100, 0, 513, 387]),
    (300, 128, 136, [300]),
    (777, 512, 264, [0, 0, 5, 700, 0]),       # 72 rows past the last group
    (64, 64, 64, [0, 0]),                      # no row in any group: zeros
    (2048, 1024, 1536, [256] * 8),
    # Many groups, so that a CTA changes group at nearly every tile: starts at every multiple
    # of 16 below 256, whole, partial and (2x1 clusters) spare tiles, then starts off the
    # 16-row steps; 50 rows past the last group
    (sum(MANY_GROUPS) + 50, 128, 256, MANY_GROUPS),
]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m, k, n, sizes", CASES_2D3D)
def test_2d3d_matches_reference(m, k, n, sizes, config):
    g = torch.Generator(device="cuda").manual_seed(m + k + n + config)
    e = len(sizes)
    a, b = fp8(m, k, g=g), fp8(e, n, k, g=g).transpose(1, 2)
    sa, sb = scales(m, g=g), scales(e, n, g=g)
    offs = offs_from_sizes(sizes, "cuda")
    poison("cuda")
    out = rg.rowwise_grouped_mm_2d3d(a, sa, b, sb, offs, config=config)
    assert_close(out, *reference_2d3d(a, sa, b, sb, offs))
    # PyTorch's kernel on the same operands, where it takes them (dims multiples of 16; rows past offs[-1]: unwritten there)
    if config == -1 and sum(sizes) == m and k % 16 == 0 and n % 16 == 0:
        want = torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)
        assert torch.allclose(out.float(), want.float(), rtol=2**-7, atol=1e-3 * want.float().abs().max().item())


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("config", [-1, 5])
def test_2d3d_large_groups_tile_order(config):
    """Groups whose mean A reaches 32 MiB take the tiles along N (rowwise_grouped_mm_2d3d):
    that order, with partial M and N tiles and rows past the last group."""
    g = torch.Generator(device="cuda").manual_seed(7 + config)
    sizes, k, n = [16520, 16376], 2048, 264
    m = sum(sizes) + 40
    assert -(-m // len(sizes)) * k >= 32 << 20  # the pick's bound: this case is along N
    a, b = fp8(m, k, g=g), fp8(len(sizes), n, k, g=g).transpose(1, 2)
    sa, sb = scales(m, g=g), scales(len(sizes), n, g=g)
    offs = offs_from_sizes(sizes, "cuda")
    poison("cuda")
    out = rg.rowwise_grouped_mm_2d3d(a, sa, b, sb, offs, config=config)
    assert_close(out, *reference_2d3d(a, sa, b, sb, offs))


@requires_sm90
@pytest.mark.gpu
def test_2d3d_strided_rows():
    g = torch.Generator(device="cuda").manual_seed(1)
    m, k, n, e = 500, 256, 256, 3
    a = fp8(m, k + 32, g=g)[:, 16:16 + k]  # row stride 288, start 16 bytes in
    b = fp8(e, n + 16, k, g=g)[:, :n].transpose(1, 2)
    sa, sb = scales(m, g=g), scales(e, n, g=g)
    offs = offs_from_sizes([200, 100, 200], "cuda")
    assert_close(rg.rowwise_grouped_mm_2d3d(a, sa, b, sb, offs), *reference_2d3d(a, sa, b, sb, offs))


# (M tokens, N, K, group sizes, multiples of 16)
CASES_2D2D = [
    (1024, 256, 384, [128, 0, 512, 384]),
    (320, 136, 264, [320]),
    (640, 512, 128, [16, 0, 0, 608, 0]),
    (2048, 1536, 1024, [256] * 8),
    (40, 64, 64, [40]),                        # a group of 40 tokens (K of the GEMM not a multiple of 16)
    (200, 128, 136, [64, 136]),
    # 16 groups, group g's output at row g N of (E N, K): N = 208 (every multiple of 16
    # below 256) and N = 200 (odd groups off the 16-row steps), partial N tiles
    (768, 208, 136, WGRAD_SIZES_16),
    (768, 200, 128, WGRAD_SIZES_16),
]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m, n, k, sizes", CASES_2D2D)
def test_2d2d_matches_reference(m, n, k, sizes, config):
    g = torch.Generator(device="cuda").manual_seed(m + n + k + config)
    e = len(sizes)
    r = -(-m // 16) * 16  # rows of a and columns of b: 16-byte aligned (TMA), M itself need not be
    a, b = fp8(n, r, g=g)[:, :m], fp8(k, r, g=g)[:, :m].t()
    sa, sb = scales(e, n, g=g), scales(e, k, g=g)
    offs = offs_from_sizes(sizes, "cuda")
    poison("cuda")
    out = rg.rowwise_grouped_mm_2d2d(a, sa, b, sb, offs, config=config)
    assert_close(out, *reference_2d2d(a, sa, b, sb, offs))
    if config == -1 and m % 16 == 0 and n % 16 == 0 and k % 16 == 0:  # where PyTorch's kernel takes the operands
        want = torch._scaled_grouped_mm(a, b, sa.reshape(-1), sb.reshape(-1), offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)
        live = torch.tensor([s > 0 for s in sizes], device="cuda")  # empty groups: ours zero, PyTorch's unspecified
        assert torch.allclose(out[live].float(), want[live].float(), rtol=2**-7,
                              atol=1e-3 * want[live].float().abs().max().item())


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, sizes", CASES_2D2D)
def test_2d2d_add_is_the_product_before_rounding(m, n, k, sizes):
    """rowwise_grouped_mm_2d2d_add_ adds the scaled fp32 product once: from zeros it is what the bf16 op rounds (bit
    for bit), onto any out it is out + that product (IEEE fp32 adds); an empty group leaves its out as it is."""
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    e = len(sizes)
    r = -(-m // 16) * 16
    a, b = fp8(n, r, g=g)[:, :m], fp8(k, r, g=g)[:, :m].t()
    sa, sb = scales(e, n, g=g), scales(e, k, g=g)
    offs = offs_from_sizes(sizes, "cuda")
    acc = torch.zeros(e, n, k, device="cuda")
    rg.rowwise_grouped_mm_2d2d_add_(acc, a, sa, b, sb, offs)
    poison("cuda")
    assert torch.equal(rg.rowwise_grouped_mm_2d2d(a, sa, b, sb, offs), acc.bfloat16())
    out0 = torch.randn(e, n, k, device="cuda", generator=g)
    out = out0.clone()
    rg.rowwise_grouped_mm_2d2d_add_(out, a, sa, b, sb, offs)
    assert out._version > 0  # the write is seen by autograd
    want = out0 + acc
    assert torch.equal(out, want), (f"{int((out != want).sum())} outputs differ, by up to "
                                    f"{((out - want).abs() / want.abs().clamp_min(1e-30)).max().item():.2e} relative")
    for i, size in enumerate(sizes):
        if size == 0:
            assert torch.equal(out[i], out0[i])


@requires_sm90
@pytest.mark.gpu
def test_2d2d_misaligned_group_is_empty():
    g = torch.Generator(device="cuda").manual_seed(2)
    m, n, k = 96, 64, 64
    a, b = fp8(n, m, g=g), fp8(k, m, g=g).t()
    sa, sb = scales(2, n, g=g), scales(2, k, g=g)
    offs = offs_from_sizes([40, 56], "cuda")  # the second group starts at 40: not a multiple of 16
    out = rg.rowwise_grouped_mm_2d2d(a, sa, b, sb, offs)
    ref, mag = reference_2d2d(a, sa, b, sb, offs_from_sizes([40], "cuda"))
    assert_close(out[:1], ref, mag)
    assert bool((out[1] == 0).all())
    # MOE_FP8_DEBUG is read once per process: the debug check runs in a fresh one
    code = (
        "import torch, moe_fp8_ext\n"
        "from moe_fp8_ext import rowwise_gemm as rg\n"
        "a = torch.zeros(64, 96, device='cuda').to(torch.float8_e4m3fn)\n"
        "b = torch.zeros(64, 96, device='cuda').to(torch.float8_e4m3fn).t()\n"
        "s = torch.ones(2, 64, device='cuda')\n"
        "offs = torch.tensor([40, 96], dtype=torch.int32, device='cuda')\n"
        "try:\n"
        "    rg.rowwise_grouped_mm_2d2d(a, s, b, s, offs)\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
    )
    env = dict(os.environ, MOE_FP8_DEBUG="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "RAISED" in res.stdout and "expected every non-empty token group to start at a multiple of 16" in res.stdout, \
        res.stdout + res.stderr


@requires_sm90
@pytest.mark.gpu
def test_no_host_sync_graph_capture():
    g = torch.Generator(device="cuda").manual_seed(3)
    m, k, n, e = 512, 256, 128, 4
    a, b = fp8(m, k, g=g), fp8(e, n, k, g=g).transpose(1, 2)
    sa, sb = scales(m, g=g), scales(e, n, g=g)
    offs = offs_from_sizes([100, 0, 300, 112], "cuda")
    ga, gb = fp8(n, m, g=g), fp8(k, m, g=g).t()
    gsa, gsb = scales(e, n, g=g), scales(e, k, g=g)
    woffs = offs_from_sizes([96, 0, 304, 112], "cuda")
    graph_matches_eager(lambda: (rg.rowwise_grouped_mm_2d3d(a, sa, b, sb, offs),
                                 rg.rowwise_grouped_mm_2d2d(ga, gsa, gb, gsb, woffs)))


def _opcheck_2d3d():
    g = torch.Generator(device="cuda").manual_seed(4)
    a, b = fp8(256, 128, g=g), fp8(2, 64, 128, g=g).transpose(1, 2)
    return a, scales(256, g=g), b, scales(2, 64, g=g), offs_from_sizes([100, 156], "cuda"), torch.bfloat16, -1


def _opcheck_2d2d():
    g = torch.Generator(device="cuda").manual_seed(5)
    a, b = fp8(64, 256, g=g), fp8(128, 256, g=g).t()
    return a, scales(2, 64, g=g), b, scales(2, 128, g=g), offs_from_sizes([96, 160], "cuda"), torch.bfloat16, -1


# torch.library.opcheck cases (test_op_coverage.py reads OPCHECK_CASES): CUDA kernels
# only, run on an sm90 GPU (the checks and fakes run everywhere above).
OPCHECK_CASES = [
    ("rowwise_grouped_mm_2d3d", lambda d: _opcheck_2d3d()),
    ("rowwise_grouped_mm_2d2d", lambda d: _opcheck_2d2d()),
    ("rowwise_grouped_mm_2d2d_add_", lambda d: (torch.zeros(2, 64, 128, device=d), *_opcheck_2d2d()[:5])),
]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("op, args", OPCHECK_CASES, ids=[op for op, _ in OPCHECK_CASES])
def test_opcheck(op, args):
    # test_schema is left out: its mutation check multiplies the inputs, and torch has
    # no fp8 mul (as in test_blockwise_gemm)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(getattr(torch.ops.moe_fp8, op).default, args("cuda"), test_utils=utils)


@requires_sm90
@pytest.mark.gpu
def test_recipe_runs_our_gemms(monkeypatch):
    import moe_fp8_ext
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = offs_from_sizes([100, 0, 300, 112], "cuda")

    def step(recipe="fp8_rowwise"):
        out = moe_fp8_ext.grouped_mm(x, w.transpose(1, 2), offs, recipe=recipe)
        torch.autograd.grad(out.float().square().sum(), (x, w))

    def gemm_kernels(recipe="fp8_rowwise"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(recipe)
            torch.cuda.synchronize()
        names = [ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
        return sum("build_tables_2d" in n for n in names), sum("_scaled_grouped" in n or "prepare_grouped_gemm" in n
                                                               for n in names)

    ours, theirs = gemm_kernels()
    assert ours == 3 and theirs == 0, (ours, theirs)  # fwd, dgrad (2d3d) and wgrad (2d2d)
    ours, theirs = gemm_kernels(moe_fp8_ext.recipes.Fp8Rowwise(gemm_kernel="torch"))
    assert ours == 0 and theirs >= 3, (ours, theirs)
