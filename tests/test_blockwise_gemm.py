"""The FP8 blockwise grouped GEMMs for Hopper (DESIGN §6, csrc/gemm/blockwise_grouped_sm90.cu):
blockwise_grouped_mm_2d3d (forward / dgrad) and blockwise_grouped_mm_2d2d (wgrad).

- everywhere (CI has no GPU): the argument checks of the wrappers and of the fakes
  ("<op>: expected X, got Y", the same from both), the fakes' output shapes and dtypes
  on meta tensors, ``available()`` answering False without an sm90 GPU, and a clear
  error for CPU tensors;
- on an sm90 GPU only (skipped elsewhere): the result against a dequantized fp32
  grouped GEMM for random shapes (empty groups, one group, odd group sizes, partial
  last K block and N tile, rows past the last group), operands straight from the
  quantization ops of moe_fp8_ext.blockwise, into poisoned memory; opcheck;
  torch.compile(fullgraph=True); CUDA-graph capture (no host sync); garbage offs
  (decreasing, negative, past M, misaligned wgrad groups) that must not fault.

Tolerance, against the fp32 GEMM of the dequantized operands (the same products and
the same per-block scales, so only rounding differs):
  |out - ref| <= 2^-8 |ref| + 2^-11 (|A| @ |B|)
2^-8: the bf16 output (round to nearest: 2^-9 relative) with margin. 2^-11 of the sum of
absolute products: Hopper's FP8 tensor cores accumulate each 128-deep block with about
14 bits of mantissa before CUTLASS promotes it to fp32 (DeepSeek-V3 §3.3.2), and fp32
sums in a different order; a wrong scale or a wrong group gives errors of order |ref|.
"""

import re

import pytest
import torch

import moe_fp8_ext
from moe_fp8_ext import blockwise_gemm as bg
from conftest import DEVICES, ROUTER_SIZES_16, graph_matches_eager, offs_from_sizes, poison, random_offs

E4M3 = torch.float8_e4m3fn
BLOCK = 128
HAS_SM90 = bg.available()
requires_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an NVIDIA GPU of compute capability 9.0 and the sm_90a build")
mm_2d3d = bg.blockwise_grouped_mm_2d3d
mm_2d2d = bg.blockwise_grouped_mm_2d2d


def cdiv(a, b):
    return -(-a // b)


# ---- operands --------------------------------------------------------------------------

def col_major(shape, dtype, device):
    """(..., r, c) column-major per matrix."""
    *lead, r, c = shape
    return torch.empty(*lead, c, r, dtype=dtype, device=device).transpose(-1, -2)


def operands_2d3d(m, k, n, e, device="meta"):
    """Empty operands of the 2d3d op in its layouts (for checks and fakes)."""
    a = torch.empty(m, k, dtype=E4M3, device=device)
    sa = col_major((m, cdiv(k, BLOCK)), torch.float32, device)
    b = col_major((e, k, n), E4M3, device)
    sb = col_major((e, cdiv(k, BLOCK), cdiv(n, BLOCK)), torch.float32, device)
    offs = torch.zeros(e, dtype=torch.int32, device=device)
    return [a, sa, b, sb, offs]


def operands_2d2d(m, n, k, e, device="meta"):
    a = torch.empty(n, m, dtype=E4M3, device=device)
    sa = col_major((n, cdiv(m, BLOCK)), torch.float32, device)
    b = col_major((m, k), E4M3, device)
    sb = torch.empty(cdiv(m, BLOCK), k, dtype=torch.float32, device=device)
    offs = torch.zeros(e, dtype=torch.int32, device=device)
    return [a, sa, b, sb, offs]


def quantized_2d3d(x, w):
    """x (M, K), w (E, K, N) high precision -> the 2d3d operands, from the quantization ops."""
    a, sa = moe_fp8_ext.quantize_blockwise_act_lhs(x, E4M3)
    b, sb = moe_fp8_ext.quantize_blockwise_weight_rhs(w, E4M3)
    return a, sa, b, sb


def quantized_2d2d(grad, x, offs):
    """grad (M, N), x (M, K) -> the wgrad operands, blocks restarting at each group."""
    a, sa = moe_fp8_ext.quantize_blockwise_act_transposed_lhs(grad, E4M3, offs)
    b, sb = moe_fp8_ext.quantize_blockwise_act_rhs(x, E4M3, offs)
    return a, sa, b, sb


def expand(s, dims, sizes):
    """Scales repeated over their 128-element blocks along `dims`, cut to `sizes`."""
    for d, n in zip(dims, sizes):
        s = s.repeat_interleave(BLOCK, dim=d).narrow(d, 0, n)
    return s


def dequant_2d3d(a, sa, b, sb):
    m, k = a.shape
    n = b.shape[2]
    ad = a.float() * expand(sa.float(), [1], [k])
    bd = b.float() * expand(sb.float(), [1, 2], [k, n])
    return ad, bd


def dequant_2d2d(a, sa, b, sb):
    n, m = a.shape
    return a.float() * expand(sa.float(), [1], [m]), b.float() * expand(sb.float(), [0], [m])


def ranges(offs, m):
    ends = offs.tolist()
    out, start = [], 0
    for e in ends:
        e = min(max(e, 0), m)
        s = start
        out.append((s, max(e, s)))
        start = e
    return out


def reference_2d3d(a, sa, b, sb, offs):
    """fp32 grouped GEMM of the dequantized operands, and |A| @ |B| for the tolerance
    (rows past the last group: zero)."""
    ad, bd = dequant_2d3d(a, sa, b, sb)
    m, n = a.shape[0], b.shape[2]
    ref = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    mag = torch.zeros_like(ref)
    for g, (s, e) in enumerate(ranges(offs, m)):
        if e > s:
            ref[s:e] = ad[s:e] @ bd[g]
            mag[s:e] = ad[s:e].abs() @ bd[g].abs()
    return ref, mag


def reference_2d2d(a, sa, b, sb, offs):
    ad, bd = dequant_2d2d(a, sa, b, sb)
    m = a.shape[1]
    e = offs.numel()
    ref = torch.zeros(e, a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    mag = torch.zeros_like(ref)
    for g, (s, t) in enumerate(ranges(offs, m)):
        if t > s:
            ref[g] = ad[:, s:t] @ bd[s:t]
            mag[g] = ad[:, s:t].abs() @ bd[s:t].abs()
    return ref, mag


def assert_close_to_reference(out, ref, mag):
    """The tolerance of the module docstring; out must also be finite (poisoned memory
    reads as NaN: an unwritten element fails here)."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    o = out.float()
    assert bool(torch.isfinite(o).all()), f"{int((~torch.isfinite(o)).sum())} non-finite outputs (unwritten?)"
    err = (o - ref).abs()
    bound = 2.0**-8 * ref.abs() + 2.0**-11 * mag + 1e-30
    bad = err > bound
    if bool(bad.any()):
        i = bad.nonzero()[0].tolist()
        raise AssertionError(f"{int(bad.sum())} of {out.numel()} outputs outside the tolerance; first at {i}: "
                             f"{float(o[tuple(i)])!r} vs {float(ref[tuple(i)])!r} (bound {float(bound[tuple(i)])!r})")


# ---- everywhere: checks and fakes ---------------------------------------------------------

def test_available_is_false_without_sm90():
    if HAS_SM90:
        assert bg.available("cuda")
    assert not bg.available("cpu")
    if not torch.cuda.is_available():
        assert not bg.available()


def test_fake_shapes_meta():
    out = torch.ops.moe_fp8.blockwise_grouped_mm_2d3d(*operands_2d3d(300, 256, 384, 4), torch.bfloat16)
    assert out.shape == (300, 384) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    out = torch.ops.moe_fp8.blockwise_grouped_mm_2d2d(*operands_2d2d(640, 200, 136, 5), torch.bfloat16)
    assert out.shape == (5, 200, 136) and out.dtype == torch.bfloat16


def test_fake_empty_sizes():
    assert torch.ops.moe_fp8.blockwise_grouped_mm_2d3d(*operands_2d3d(0, 128, 64, 3), torch.bfloat16).shape == (0, 64)
    assert torch.ops.moe_fp8.blockwise_grouped_mm_2d3d(*operands_2d3d(5, 0, 64, 0), torch.bfloat16).shape == (5, 64)
    assert torch.ops.moe_fp8.blockwise_grouped_mm_2d2d(*operands_2d2d(0, 16, 8, 2), torch.bfloat16).shape == (2, 16, 8)


def _edit(ops, i, t):
    ops = list(ops)
    ops[i] = t
    return ops


BAD_2D3D = [
    # (what, operands -> operands, out_dtype, message)
    ("a rank", lambda o: _edit(o, 0, o[0][0]), torch.bfloat16, "expected a to be a 2-D tensor, got 1-D"),
    ("a dtype", lambda o: _edit(o, 0, o[0].to(torch.float8_e5m2)), torch.bfloat16, "expected a of dtype float8_e4m3fn"),
    ("b dtype", lambda o: _edit(o, 2, o[2].to(torch.bfloat16)), torch.bfloat16, "expected b of dtype float8_e4m3fn"),
    ("scale dtype", lambda o: _edit(o, 1, o[1].double()), torch.bfloat16, "expected scale_a of dtype float32"),
    ("offs dtype", lambda o: _edit(o, 4, o[4].long()), torch.bfloat16, "expected offs of dtype int32"),
    ("out dtype", lambda o: o, torch.float16, "expected out_dtype bfloat16, got Half"),
    ("b K", lambda o: _edit(o, 2, col_major((4, 128, 384), E4M3, "meta")), torch.bfloat16,
     "expected b of shape (E, K, N) with K = 256"),
    ("scale_a shape", lambda o: _edit(o, 1, col_major((300, 3), torch.float32, "meta")), torch.bfloat16,
     "expected scale_a of shape [300, 2], got [300, 3]"),
    ("scale_b shape", lambda o: _edit(o, 3, col_major((4, 2, 2), torch.float32, "meta")), torch.bfloat16,
     "expected scale_b of shape [4, 2, 3], got [4, 2, 2]"),
    ("offs groups", lambda o: _edit(o, 4, torch.zeros(3, dtype=torch.int32, device="meta")), torch.bfloat16,
     "expected offs of shape (4,) (one group per expert of b), got (3,)"),
    ("a layout", lambda o: _edit(o, 0, col_major((300, 256), E4M3, "meta")), torch.bfloat16,
     "expected a row-major (stride(1) == 1)"),
    ("scale_a layout", lambda o: _edit(o, 1, torch.empty(300, 2, device="meta")), torch.bfloat16,
     "expected scale_a column-major (stride(0) == 1)"),
    ("b layout", lambda o: _edit(o, 2, torch.empty(4, 256, 384, dtype=E4M3, device="meta")), torch.bfloat16,
     "expected b column-major per expert (stride(1) == 1)"),
    ("scale_b layout", lambda o: _edit(o, 3, torch.empty(4, 2, 3, device="meta")), torch.bfloat16,
     "expected scale_b column-major per expert (stride(1) == 1)"),
    ("a row stride", lambda o: _edit(o, 0, torch.empty(300, 264, dtype=E4M3, device="meta")[:, :256]), torch.bfloat16,
     "expected a.stride(0) to be at least 256 and a multiple of 16"),
]


@pytest.mark.parametrize("what, edit, out_dtype, msg", BAD_2D3D, ids=[c[0] for c in BAD_2D3D])
def test_checks_2d3d(what, edit, out_dtype, msg):
    ops = edit(operands_2d3d(300, 256, 384, 4))
    # the fake (meta tensors) and the wrapper run the same checks
    with pytest.raises(RuntimeError, match=re.escape("blockwise_grouped_mm_2d3d: " + msg)):
        torch.ops.moe_fp8.blockwise_grouped_mm_2d3d(*ops, out_dtype)
    with pytest.raises(RuntimeError, match="blockwise_grouped_mm_2d3d: expected"):
        mm_2d3d(*ops, out_dtype)


def test_checks_2d3d_divisibility():
    with pytest.raises(RuntimeError, match=r"expected K \(the columns of a\) to be a multiple of 16"):
        torch.ops.moe_fp8.blockwise_grouped_mm_2d3d(*operands_2d3d(64, 200, 128, 2), torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"expected N \(the columns of b\) to be a multiple of 8"):
        torch.ops.moe_fp8.blockwise_grouped_mm_2d3d(*operands_2d3d(64, 256, 100, 2), torch.bfloat16)


@pytest.mark.parametrize("config", [-2, 99, 1.0])
def test_checks_config(config):
    cases = [(torch.ops.moe_fp8.blockwise_grouped_mm_2d3d, mm_2d3d, operands_2d3d(300, 256, 384, 4), bg.CONFIGS_2D3D),
             (torch.ops.moe_fp8.blockwise_grouped_mm_2d2d, mm_2d2d, operands_2d2d(640, 200, 136, 5), bg.CONFIGS_2D2D)]
    for op, wrapper, ops, n in cases:
        msg = re.escape(f"expected config -1 (the pick by shape) or in [0, {n}), got {config}")
        if isinstance(config, int):  # the schema's int refuses a float before the fake runs
            with pytest.raises(RuntimeError, match=msg):
                op(*ops, torch.bfloat16, config)
        with pytest.raises(RuntimeError, match=msg):
            wrapper(*ops, torch.bfloat16, config)
    for c in range(bg.CONFIGS_2D3D):  # every configuration traces
        out = torch.ops.moe_fp8.blockwise_grouped_mm_2d3d(*operands_2d3d(300, 256, 384, 4), torch.bfloat16, c)
        assert out.shape == (300, 384)
    for c in range(bg.CONFIGS_2D2D):
        out = torch.ops.moe_fp8.blockwise_grouped_mm_2d2d(*operands_2d2d(640, 200, 136, 5), torch.bfloat16, c)
        assert out.shape == (5, 200, 136)


def test_checks_device_mismatch():
    ops = operands_2d3d(64, 128, 128, 2, device="cpu")
    ops[4] = ops[4].to("meta")
    with pytest.raises(RuntimeError, match=r"blockwise_grouped_mm_2d3d: expected offs on cpu \(the device of a\), got meta"):
        mm_2d3d(*ops)


def test_cpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="blockwise_grouped_mm_2d3d: expected CUDA tensors"):
        mm_2d3d(*operands_2d3d(64, 128, 128, 2, device="cpu"))
    with pytest.raises(RuntimeError, match="blockwise_grouped_mm_2d2d: expected CUDA tensors"):
        mm_2d2d(*operands_2d2d(256, 64, 64, 2, device="cpu"))


BAD_2D2D = [
    ("b rows", lambda o: _edit(o, 2, col_major((512, 136), E4M3, "meta")), torch.bfloat16,
     "expected b of shape (M, K) with M = 640"),
    ("scale_a shape", lambda o: _edit(o, 1, col_major((200, 4), torch.float32, "meta")), torch.bfloat16,
     "expected scale_a of shape [200, 5], got [200, 4]"),
    ("scale_b shape", lambda o: _edit(o, 3, torch.empty(5, 128, device="meta")), torch.bfloat16,
     "expected scale_b of shape [5, 136], got [5, 128]"),
    ("a layout", lambda o: _edit(o, 0, col_major((200, 640), E4M3, "meta")), torch.bfloat16,
     "expected a row-major (stride(1) == 1)"),
    ("b layout", lambda o: _edit(o, 2, torch.empty(640, 136, dtype=E4M3, device="meta")), torch.bfloat16,
     "expected b column-major (stride(0) == 1)"),
    ("scale_b layout", lambda o: _edit(o, 3, col_major((5, 136), torch.float32, "meta")), torch.bfloat16,
     "expected scale_b row-major (stride(1) == 1)"),
    ("K", lambda o: _edit(_edit(o, 2, col_major((640, 132), E4M3, "meta")), 3, torch.empty(5, 132, device="meta")),
     torch.bfloat16, "expected K (the columns of b) to be a multiple of 8"),
    ("out dtype", lambda o: o, torch.float32, "expected out_dtype bfloat16, got Float"),
]


@pytest.mark.parametrize("what, edit, out_dtype, msg", BAD_2D2D, ids=[c[0] for c in BAD_2D2D])
def test_checks_2d2d(what, edit, out_dtype, msg):
    ops = edit(operands_2d2d(640, 200, 136, 5))
    pattern = re.escape("blockwise_grouped_mm_2d2d: " + msg)
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.moe_fp8.blockwise_grouped_mm_2d2d(*ops, out_dtype)
    with pytest.raises(RuntimeError, match=pattern):
        mm_2d2d(*ops, out_dtype)


BAD_2D2D_ADD = [
    ("out dtype", lambda o, out: (out.bfloat16(), o, -1), "expected out of dtype float32, got torch.bfloat16"),
    ("out shape", lambda o, out: (out[:, :, :128], o, -1), "expected out of shape [5, 200, 136], got [5, 200, 128]"),
    ("out strides", lambda o, out: (out.transpose(1, 2).contiguous().transpose(1, 2), o, -1),
     "expected out contiguous (row-major (E, N, K))"),
    ("config", lambda o, out: (out, o, 2), "expected config -1 (the pick by shape) or in [0, 2), got 2"),
    ("operands", lambda o, out: (out, _edit(o, 1, o[1].contiguous()), -1), "expected scale_a column-major"),
]


@pytest.mark.parametrize("what, edit, msg", BAD_2D2D_ADD, ids=[c[0] for c in BAD_2D2D_ADD])
def test_checks_2d2d_add(what, edit, msg):
    """The fused wgrad-into-main-gradient op: the 2d2d op's rules, then out's (float32 (E, N, K) contiguous), alike
    in the raw op (its fake, on the meta device) and the wrapper."""
    out, ops, config = edit(operands_2d2d(640, 200, 136, 5), torch.empty(5, 200, 136, device="meta"))
    pattern = re.escape("blockwise_grouped_mm_2d2d_add_: " + msg)
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.moe_fp8.blockwise_grouped_mm_2d2d_add_(out, *ops, config)
    with pytest.raises(RuntimeError, match=pattern):
        bg.blockwise_grouped_mm_2d2d_add_(out, *ops, config=config)


def test_fake_2d2d_add_returns_nothing():
    out = torch.empty(5, 200, 136, device="meta")
    assert torch.ops.moe_fp8.blockwise_grouped_mm_2d2d_add_(out, *operands_2d2d(640, 200, 136, 5)) is None
    with pytest.raises(RuntimeError, match="blockwise_grouped_mm_2d2d_add_: expected CUDA tensors"):
        bg.blockwise_grouped_mm_2d2d_add_(torch.empty(2, 64, 64), *operands_2d2d(256, 64, 64, 2, device="cpu"))


def test_checks_2d2d_row_alignment():
    # contiguous operands with M % 16 != 0: rows of a / columns of b not 16-byte aligned
    with pytest.raises(RuntimeError, match=r"expected a.stride\(0\) to be at least 200 and a multiple of 16"):
        torch.ops.moe_fp8.blockwise_grouped_mm_2d2d(*operands_2d2d(200, 64, 64, 2), torch.bfloat16)


# ---- sm90 GPU: numerics ---------------------------------------------------------------------

def block_magnitudes(shape, blocks, g):
    """Powers of two in [2^-6, 2^6], one per block of BLOCK elements along each dim in
    `blocks` (whole dims elsewhere broadcast per element): operands whose every scale block
    has its own scale, so that a kernel reading another block's scale misses by up to
    2^12 (with one magnitude for all, the scales agree to a few percent and a wrong one
    passes the tolerance)."""
    coarse = [cdiv(n, BLOCK) if d in blocks else n for d, n in enumerate(shape)]
    mag = torch.exp2(torch.randint(-6, 7, coarse, generator=g).float())
    for d in blocks:
        mag = mag.repeat_interleave(BLOCK, dim=d).narrow(d, 0, shape[d])
    return mag


def draw_2d3d(m, k, n, e, offs, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * block_magnitudes((m, k), [1], g)).bfloat16()
    w = (torch.randn(e, k, n, generator=g) * 0.05 * block_magnitudes((e, k, n), [1, 2], g)).bfloat16()
    return quantized_2d3d(x.cuda(), w.cuda()) + (offs.cuda(),)


# Many groups, so a CTA changes group at nearly every tile (the store warp rewrites its descriptor each time), and
# every tile kind: whole tiles, a 2x1 cluster's spare tile past a group (N = 384), partial last tiles, starts off
# multiples of 16 rows, in runs and interleaved; the case adds 77 tail rows.
MANY_GROUPS = [128, 256, 0, 100, 384, 129, 128, 640, 1, 255, 256, 384, 0, 512, 127, 128] * 3
# Router-like sizes, multiples of 16: group starts at every multiple of 16 below 128,
# whole and partial last tiles.
MANY_GROUPS_16 = ROUTER_SIZES_16 * 3

# (M, K, N, E, group sizes or None for random)
CASES_2D3D = [
    (512, 256, 384, 4, None),
    (1000, 384, 256, 7, None),           # random sizes, some empty
    (333, 128, 128, 1, [333]),           # one group
    (260, 256, 256, 5, [1, 3, 127, 0, 129]),  # odd sizes, an empty group
    (300, 144, 136, 3, [100, 0, 150]),   # partial last K block (144 = 128 + 16), N not a multiple of 128, 50 tail rows
    (640, 400, 200, 4, [0, 0, 640, 0]),  # empty first groups, partial K and N
    (2048, 1024, 1024, 8, None),         # several tiles a group, several K blocks
    (sum(MANY_GROUPS) + 77, 256, 256, len(MANY_GROUPS), MANY_GROUPS),  # cluster 1x2
    (sum(MANY_GROUPS) + 77, 256, 384, len(MANY_GROUPS), MANY_GROUPS),  # cluster 2x1
    (sum(MANY_GROUPS_16) + 64, 256, 256, len(MANY_GROUPS_16), MANY_GROUPS_16),  # cluster 1x2
    (sum(MANY_GROUPS_16) + 64, 256, 384, len(MANY_GROUPS_16), MANY_GROUPS_16),  # cluster 2x1
]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, e, sizes", CASES_2D3D)
def test_2d3d_matches_dequantized_reference(m, k, n, e, sizes):
    offs = random_offs(m, e, tail=m // 10) if sizes is None else offs_from_sizes(sizes)
    a, sa, b, sb, offs = draw_2d3d(m, k, n, e, offs, seed=m + k)
    poison("cuda")
    out = mm_2d3d(a, sa, b, sb, offs)
    ref, mag = reference_2d3d(a, sa, b, sb, offs)
    assert_close_to_reference(out, ref, mag)  # rows past the last group: zero in ref


# Partial 256-row and 128-row tiles, groups of fewer rows than a tile, empty groups, tail
# rows, partial K blocks and N tiles, a cluster's spare tiles.
CONFIG_CASES_2D3D = [
    (3000, 384, 384, 3, [1100, 0, 1700]),
    (1000, 400, 200, 7, None),
    (sum(MANY_GROUPS_16) + 64, 256, 256, len(MANY_GROUPS_16), MANY_GROUPS_16),
    (4096, 1024, 1024, 2, [2560, 1536]),
]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, e, sizes", CONFIG_CASES_2D3D)
def test_2d3d_configs(m, k, n, e, sizes):
    offs = random_offs(m, e, tail=m // 10) if sizes is None else offs_from_sizes(sizes)
    a, sa, b, sb, offs = draw_2d3d(m, k, n, e, offs, seed=m + n)
    out = assert_configs_bit_equal(lambda c: mm_2d3d(a, sa, b, sb, offs, config=c), bg.CONFIGS_2D3D)
    assert_close_to_reference(out, *reference_2d3d(a, sa, b, sb, offs))


@requires_sm90
@pytest.mark.gpu
def test_2d3d_many_partial_tiles():
    """600 groups of 16-240 rows: nearly every tile is a group's partial last tile, so the
    store warp of each CTA rewrites its store descriptor at nearly every tile, right after
    the previous tile's stores (csrc/gemm/store_warp_epilogue.cuh); a few starts off the
    multiples of 16 rows; N = 128 (one N tile: cluster 2x1, spare tiles past groups of an odd
    number of M tiles)."""
    g = torch.Generator().manual_seed(11)
    sizes = (torch.randint(1, 16, (600,), generator=g) * 16).tolist()
    for i in range(0, 600, 50):  # one group starting 5 rows off the steps, the next back on them
        sizes[i] += 5
        sizes[i + 1] += 11
    m = sum(sizes) + 30
    a, sa, b, sb, offs = draw_2d3d(m, 128, 128, len(sizes), offs_from_sizes(sizes), seed=11)
    poison("cuda")
    out = mm_2d3d(a, sa, b, sb, offs)
    assert_close_to_reference(out, *reference_2d3d(a, sa, b, sb, offs))


@requires_sm90
@pytest.mark.gpu
def test_2d3d_dgrad_operands():
    """dgrad: grad_out (M, N) 1x128 along N, w^T from quantize_blockwise_weight_transposed_rhs."""
    m, k, n, e = 700, 256, 384, 3
    offs = offs_from_sizes([300, 0, 400]).cuda()
    grad = torch.randn(m, n, device="cuda").bfloat16()
    w = (torch.randn(e, k, n, device="cuda") * 0.05).bfloat16()
    a, sa = moe_fp8_ext.quantize_blockwise_act_lhs(grad, E4M3)
    b, sb = moe_fp8_ext.quantize_blockwise_weight_transposed_rhs(w, E4M3)  # (E, N, K) column-major
    poison("cuda")
    out = mm_2d3d(a, sa, b, sb, offs)
    assert out.shape == (m, k)
    ref, mag = reference_2d3d(a, sa, b, sb, offs)
    assert_close_to_reference(out, ref, mag)


def draw_2d2d(m, n, k, offs, seed=0):
    """Magnitudes per 128-token block and column on both sides (the scales' blocks: groups
    start at multiples of 128 tokens, so the blocks restart on the same grid)."""
    g = torch.Generator().manual_seed(seed)
    grad = (torch.randn(m, n, generator=g) * block_magnitudes((m, n), [0], g)).bfloat16().cuda()
    x = (torch.randn(m, k, generator=g) * block_magnitudes((m, k), [0], g)).bfloat16().cuda()
    offs = offs.cuda()
    return quantized_2d2d(grad, x, offs) + (offs,)


def assert_configs_bit_equal(run, configs):
    """Every configuration (tile, cluster) gives the bits of the first: the same 64x128
    GMMAs promoted in the same order (csrc/gemm/pipelined_promotion.cuh)."""
    outs = []
    for c in range(configs):
        poison("cuda")
        outs.append(run(c))
    for c, o in enumerate(outs[1:], 1):
        assert torch.equal(o, outs[0]), f"config {c}: {int((o != outs[0]).sum())} outputs differ from config 0's"
    return outs[0]


def sizes_at_128(sizes, last):
    """Group sizes: multiples of 128 except the last non-empty one (+ `last`)."""
    return [s * BLOCK for s in sizes[:-1]] + [sizes[-1] * BLOCK + last]


CASES_2D2D = [
    # (M, N, K, group sizes)
    (1024, 256, 384, sizes_at_128([2, 0, 3, 3], 0)),
    (1008, 200, 136, sizes_at_128([1, 4, 0, 2], 80)),   # N and K not multiples of 128, partial last block, tail rows
    (512, 128, 128, sizes_at_128([4], 0)),              # one group
    (768, 384, 256, sizes_at_128([0, 0, 6], 0)),        # empty groups first
    (4096, 512, 1024, sizes_at_128([8, 8, 0, 8, 8], 0)),
    # N = 208: group g's output starts at row 208 g of the (E * N, K) matrix, every
    # multiple of 16 below 128 over the eight groups; partial last N tiles
    (1536, 208, 256, sizes_at_128([2, 1, 1, 3, 1, 2, 1, 1], 0)),
]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, sizes", CASES_2D2D)
def test_2d2d_matches_dequantized_reference(m, n, k, sizes):
    offs = offs_from_sizes(sizes)
    a, sa, b, sb, offs = draw_2d2d(m, n, k, offs, seed=m + n)
    poison("cuda")
    out = mm_2d2d(a, sa, b, sb, offs)
    ref, mag = reference_2d2d(a, sa, b, sb, offs)
    assert_close_to_reference(out, ref, mag)  # empty groups: zero


def gemm_kernels(fn):
    """The names of the CUTLASS GEMM kernels one call of fn launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if "GemmUniversal" in e.name}


@requires_sm90
@pytest.mark.gpu
def test_configs_run_their_own_kernels():
    """config picks the kernel: one GEMM kernel a call, a different one for each config
    (so the bit-equality tests compare different kernels), and the pick (-1) one of them."""
    a, sa, b, sb, offs = draw_2d3d(1024, 256, 384, 2, offs_from_sizes([500, 524]))
    ga, gsa, gb, gsb, goffs = draw_2d2d(512, 256, 256, offs_from_sizes([256, 256]))
    for configs, call in ((bg.CONFIGS_2D3D, lambda c: mm_2d3d(a, sa, b, sb, offs, config=c)),
                          (bg.CONFIGS_2D2D, lambda c: mm_2d2d(ga, gsa, gb, gsb, goffs, config=c))):
        names = [gemm_kernels(lambda c=c: call(c)) for c in range(configs)]
        assert all(len(n) == 1 for n in names), names
        assert len(set.union(*names)) == configs, "two configurations ran the same kernel"
        assert gemm_kernels(lambda: call(-1)) <= set.union(*names)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, sizes", CASES_2D2D + [(2048, 640, 768, sizes_at_128([4, 0, 3, 9], 0))])
def test_2d2d_configs(m, n, k, sizes):
    """N and K of 200 / 208 / 136 leave partial 256-wide tiles; empty groups, partial last
    token blocks."""
    a, sa, b, sb, offs = draw_2d2d(m, n, k, offs_from_sizes(sizes), seed=m + k)
    out = assert_configs_bit_equal(lambda c: mm_2d2d(a, sa, b, sb, offs, config=c), bg.CONFIGS_2D2D)
    assert_close_to_reference(out, *reference_2d2d(a, sa, b, sb, offs))


@requires_sm90
@pytest.mark.gpu
def test_2d2d_random_groups():
    m, n, k, e = 2560, 256, 512, 6
    offs = random_offs(m, e, alignment=BLOCK)
    a, sa, b, sb, offs = draw_2d2d(m, n, k, offs, seed=3)
    poison("cuda")
    out = mm_2d2d(a, sa, b, sb, offs)
    assert_close_to_reference(out, *reference_2d2d(a, sa, b, sb, offs))


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, sizes", CASES_2D2D)
def test_2d2d_add_is_the_product_before_rounding(m, n, k, sizes):
    """blockwise_grouped_mm_2d2d_add_ adds the fp32 accumulator once: from zeros it is what the bf16 op rounds (bit
    for bit), onto any out it is out + that accumulator (IEEE fp32 adds), in both configurations; an empty group
    leaves its out as it is."""
    a, sa, b, sb, offs = draw_2d2d(m, n, k, offs_from_sizes(sizes), seed=m + n)
    e = offs.numel()
    acc = torch.zeros(e, n, k, device="cuda")
    bg.blockwise_grouped_mm_2d2d_add_(acc, a, sa, b, sb, offs)
    poison("cuda")
    assert torch.equal(mm_2d2d(a, sa, b, sb, offs), acc.bfloat16())
    ref, mag = reference_2d2d(a, sa, b, sb, offs)
    assert bool(((acc - ref).abs() <= 2.0**-11 * mag + 1e-30).all())
    out0 = torch.randn(e, n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m))
    for c in range(bg.CONFIGS_2D2D_ADD):
        out = out0.clone()
        version = out._version
        bg.blockwise_grouped_mm_2d2d_add_(out, a, sa, b, sb, offs, config=c)
        assert out._version > version  # the write is seen by autograd
        assert torch.equal(out, out0 + acc), f"config {c}: {int((out != out0 + acc).sum())} outputs differ"
    for g, (s, t) in enumerate(ranges(offs, m)):
        if t == s:
            assert torch.equal(out[g], out0[g])


# ---- sm90 GPU: graphs, compile, opcheck, garbage offs --------------------------------------

def _gpu_2d3d():
    return draw_2d3d(260, 256, 256, 5, offs_from_sizes([1, 3, 127, 0, 100]), seed=5)


def _gpu_swiglu():
    a, sa, _, _, offs, starts, (qi, si) = swiglu_operands(300, 256, 256, 3, offs_from_sizes([100, 0, 170]), seed=7)
    return a, sa, qi, si, offs, starts


def _gpu_2d2d():
    return draw_2d2d(640, 128, 256, offs_from_sizes(sizes_at_128([1, 0, 2, 1], 40)), seed=6)


# torch.library.opcheck cases (test_op_coverage.py reads OPCHECK_CASES). The ops have
# CUDA kernels only: the cases run on an sm90 GPU (the checks and fakes run everywhere above).
OPCHECK_CASES = [
    ("blockwise_grouped_mm_2d3d", lambda d: (*_gpu_2d3d(), torch.bfloat16)),
    ("blockwise_grouped_mm_2d2d", lambda d: (*_gpu_2d2d(), torch.bfloat16)),
    ("blockwise_grouped_mm_2d2d_add_", lambda d: (torch.zeros(4, 128, 256, device=d), *_gpu_2d2d())),
    ("blockwise_grouped_mm_swiglu", lambda d: _gpu_swiglu()),
    ("blockwise_grouped_mm_dswiglu", lambda d: _gpu_dswiglu()),
]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("op, args", OPCHECK_CASES, ids=[op for op, _ in OPCHECK_CASES])
def test_opcheck(op, args):
    # test_schema is left out: its mutation check multiplies the inputs, and torch has
    # no fp8 mul (the other utils: fake tensor, autograd registration, aot dispatch)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(getattr(torch.ops.moe_fp8, op).default, args("cuda"), test_utils=utils)


@requires_sm90
@pytest.mark.gpu
def test_compile_fullgraph():
    a, sa, b, sb, offs = _gpu_2d3d()
    a2, sa2, b2, sb2, offs2 = _gpu_2d2d()

    def step(a, sa, b, sb, offs, a2, sa2, b2, sb2, offs2):
        y = mm_2d3d(a, sa, b, sb, offs)
        w = mm_2d2d(a2, sa2, b2, sb2, offs2)
        return y * 2, w.sum(0)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(a, sa, b, sb, offs, a2, sa2, b2, sb2, offs2)
    want = step(a, sa, b, sb, offs, a2, sa2, b2, sb2, offs2)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@requires_sm90
@pytest.mark.gpu
def test_cuda_graph_capture():
    """Both ops captured in a CUDA graph replay bit-equal to eager (no host sync)."""
    a, sa, b, sb, offs = _gpu_2d3d()
    a2, sa2, b2, sb2, offs2 = _gpu_2d2d()
    graph_matches_eager(lambda: (mm_2d3d(a, sa, b, sb, offs), mm_2d2d(a2, sa2, b2, sb2, offs2)))


@requires_sm90
@pytest.mark.gpu
def test_deterministic():
    a, sa, b, sb, offs = _gpu_2d3d()
    assert torch.equal(mm_2d3d(a, sa, b, sb, offs), mm_2d3d(a, sa, b, sb, offs))


GARBAGE_OFFS = [
    [200, 100, 260, 50, 260],       # decreasing
    [-5, 300, 1 << 30, -(1 << 30), 7],  # negative and far past M
    [260, 260, 260, 260, 260],      # everything in the first group
    [3, 5, 7, 9, 2**31 - 1],
]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("bad", GARBAGE_OFFS)
def test_garbage_offs_do_not_fault(bad):
    """Bad offs on a GPU: clamped into [0, M] by the table kernel (DESIGN §3). The result
    is whatever the clamped groups give, but nothing is read or written out of bounds;
    a fault would surface at the synchronize (and poison the CUDA context for the rest)."""
    a, sa, b, sb, _ = _gpu_2d3d()
    offs = torch.tensor(bad, dtype=torch.int32, device="cuda")
    out = mm_2d3d(a, sa, b, sb, offs)
    a2, sa2, b2, sb2, _ = _gpu_2d2d()
    offs2 = torch.tensor(bad[:4], dtype=torch.int32, device="cuda")
    w = mm_2d2d(a2, sa2, b2, sb2, offs2)  # wgrad: misaligned group starts count as empty
    torch.cuda.synchronize()
    assert out.shape == (260, 256) and w.shape == (4, 128, 256)
    # a well-formed call still works after the garbage
    a, sa, b, sb, offs = _gpu_2d3d()
    assert_close_to_reference(mm_2d3d(a, sa, b, sb, offs), *reference_2d3d(a, sa, b, sb, offs))


@requires_sm90
@pytest.mark.gpu
def test_2d2d_misaligned_group_is_zero():
    """A wgrad group that does not start at a multiple of 128 (bad offs) is empty: zeros."""
    a, sa, b, sb, _ = _gpu_2d2d()
    offs = torch.tensor([100, 300, 640, 640], dtype=torch.int32, device="cuda")
    poison("cuda")
    out = mm_2d2d(a, sa, b, sb, offs)
    assert bool((out[1:].float() == 0).all()) and bool(torch.isfinite(out[0].float()).all())


# ---- the W13 GEMM with the SwiGLU epilogue (DESIGN §6) --------------------------------------


def swiglu_operands(m, k, hidden, e, offs, seed=0, device="cuda"):
    """x's 1x128 operand, [W1; W3]'s 128x128 operand (plain and interleaved), padded starts."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * block_magnitudes((m, k), [1], g)).bfloat16().to(device)
    w1, w3 = ((torch.randn(e, hidden, k, generator=g) * 0.1 * block_magnitudes((e, hidden, k), [1, 2], g))
              .bfloat16().to(device) for _ in range(2))
    a, sa = moe_fp8_ext.quantize_blockwise_act_lhs(x, E4M3)
    parts = [w1.transpose(1, 2), w3.transpose(1, 2)]
    b, sb = moe_fp8_ext.quantize_blockwise_weight_rhs_cat(parts, E4M3)
    bi, sbi = moe_fp8_ext.quantize_blockwise_weight_rhs_cat(parts, E4M3, interleave=True)
    offs = offs.to(device)
    starts, _ = torch.ops.moe_fp8.padded_group_offsets(offs, m, BLOCK)
    return a, sa, b, sb, offs, starts, (bi, sbi)


def swiglu_kernels(h13, offs, starts):
    """h13, then the SwiGLU op and the activation dual of h: the fused op's epilogue outputs."""
    h = torch.ops.moe_fp8.swiglu(h13)
    return (h13,) + tuple(torch.ops.moe_fp8.quantize_blockwise_act_dual(h, E4M3, offs, starts, BLOCK))


def composed_swiglu(a, sa, b, sb, offs, starts):
    """What the fused op replaces: the GEMM, the SwiGLU op, then the activation dual."""
    return swiglu_kernels(mm_2d3d(a, sa, b, sb, offs), offs, starts)


def assert_within_gemm_rounding(got, ref):
    """h13 of two GEMMs that sum in other orders: within a bf16 rounding, or a thousandth of the largest value."""
    diff = (got.float() - ref.float()).abs()
    assert bool((diff <= 2.0**-7 * ref.float().abs() + 1e-3 * ref.float().abs().max()).all())


def assert_bits_equal(outs, refs, names=("h13", "q_rows", "s_rows", "q_cols", "s_cols")):
    assert len(outs) == len(refs) == len(names)
    for name, o, r in zip(names, outs, refs):
        assert o.shape == r.shape and o.stride() == r.stride() and o.dtype == r.dtype, name
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[o.element_size()]
        assert torch.equal(o.view(as_int), r.view(as_int)), f"{name} differs"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dual", [False, True])
def test_interleaved_weight_cat_is_the_interleaved_weights_operand(device, dual):
    """The _cat ops' interleave: the forward operand of [W1; W3] interleaved by 128 (each
    128x128 tile and its scale belong to one weight); the transposed one of [W1; W3]."""
    g = torch.Generator().manual_seed(3)
    w1, w3 = (torch.randn(2, 256, 200, generator=g).bfloat16().to(device) for _ in range(2))
    parts = [w1.transpose(1, 2), w3.transpose(1, 2)]
    poison(device)
    w13i = torch.stack([w1.view(2, 2, 128, 200), w3.view(2, 2, 128, 200)], dim=2).reshape(2, 512, 200)
    ref = list(moe_fp8_ext.quantize_blockwise_weight_rhs(w13i.transpose(1, 2), E4M3))
    if dual:
        out = moe_fp8_ext.quantize_blockwise_weight_dual_cat(parts, E4M3, interleave=True)
        ref += moe_fp8_ext.quantize_blockwise_weight_transposed_rhs_cat(parts, E4M3)
    else:
        out = moe_fp8_ext.quantize_blockwise_weight_rhs_cat(parts, E4M3, interleave=True)
    for o, r in zip(out, ref):
        assert o.shape == r.shape and o.stride() == r.stride()
        as_int = {1: torch.uint8, 4: torch.int32}[o.element_size()]
        assert torch.equal(o.view(as_int), r.view(as_int))
    with pytest.raises(RuntimeError, match="of one width to interleave"):
        moe_fp8_ext.quantize_blockwise_weight_rhs_cat([parts[0], parts[1][..., :128]], E4M3, interleave=True)


def test_swiglu_gemm_fake_and_checks():
    m, k, hidden, e = 300, 256, 256, 4
    a, sa, b, sb, offs = operands_2d3d(m, k, 2 * hidden, e)
    starts = torch.empty(e, dtype=torch.int32, device="meta")
    h13, qr, sr, qc, sc = torch.ops.moe_fp8.blockwise_grouped_mm_swiglu(a, sa, b, sb, offs, starts)
    r = cdiv(m + e * BLOCK, BLOCK) * BLOCK
    assert h13.shape == (m, 2 * hidden) and h13.dtype == torch.bfloat16
    assert qr.shape == (m, hidden) and sr.shape == (m, 2) and sr.stride() == (1, m)
    assert qc.shape == (r, hidden) and qc.stride() == (1, r) and sc.shape == (r // BLOCK, hidden)
    with pytest.raises(RuntimeError, match="hidden a multiple of 128"):
        bg.blockwise_grouped_mm_swiglu(*operands_2d3d(m, k, 384, e), starts)
    with pytest.raises(RuntimeError, match="padded_starts of shape"):
        bg.blockwise_grouped_mm_swiglu(a, sa, b, sb, offs, starts[:2])
    with pytest.raises(RuntimeError, match="expected CUDA tensors"):
        cpu = operands_2d3d(m, k, 2 * hidden, e, device="cpu")
        bg.blockwise_grouped_mm_swiglu(*cpu, torch.zeros(e, dtype=torch.int32))


# Groups: empty ones, partial token blocks, starts off multiples of 16, tail rows past the last group; hidden 128 and
# 384 (an odd number of 256-column tiles) run the kernel without a cluster, 256 and 512 the 1x2 one.
SWIGLU_CASES = [
    (3000, 384, 384, 3, [1100, 0, 1700]),
    (sum(MANY_GROUPS) + 77, 256, 128, len(MANY_GROUPS), MANY_GROUPS),
    (sum(MANY_GROUPS_16), 512, 256, len(MANY_GROUPS_16), MANY_GROUPS_16),
    (640, 128, 512, 2, [0, 0]),
]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m, k, hidden, e, sizes", SWIGLU_CASES)
def test_swiglu_gemm_is_the_composed_path(m, k, hidden, e, sizes):
    offs = offs_from_sizes(sizes)
    a, sa, b, sb, offs, starts, (qi, si) = swiglu_operands(m, k, hidden, e, offs, seed=m + hidden)
    refs = composed_swiglu(a, sa, b, sb, offs, starts)
    poison("cuda")
    outs = bg.blockwise_grouped_mm_swiglu(a, sa, qi, si, offs, starts)
    assert_bits_equal(outs, refs)


@pytest.mark.parametrize("hidden, sizes", [(384, [200, 0, 333, 100]), (128, [150, 128, 1, 300])])
def test_swiglu_gemm_reference_is_the_composed_math(hidden, sizes):
    """reference.blockwise_grouped_mm_swiglu, the op's spec: its GEMM reads W1 and W3
    interleaved by 128 (the fp32 GEMM of the plain [W1; W3] within rounding), and its
    fp8 outputs, layouts included, are the SwiGLU and quantize_blockwise_act_dual
    kernels' of its h13 bit for bit (CPU)."""
    from moe_fp8_ext import reference

    m, k, e = 700, 256, len(sizes)
    a, sa, b, sb, offs, starts, (qi, si) = swiglu_operands(m, k, hidden, e, offs_from_sizes(sizes), 4, "cpu")
    ref = reference.blockwise_grouped_mm_swiglu(a, sa, qi, si, offs)
    plain = moe_fp8_ext.get_recipe("fp8_blockwise").mm_2d3d((a, sa), (b, sb), offs, torch.bfloat16, "emulated")
    assert ref[0].shape == plain.shape and bool((ref[0][sum(sizes):] == 0).all())
    assert_within_gemm_rounding(ref[0], plain)
    assert_bits_equal(ref, swiglu_kernels(ref[0], offs, starts))


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m, k, hidden, e, sizes", SWIGLU_CASES[:2])
def test_swiglu_gemm_is_the_reference(m, k, hidden, e, sizes):
    """The op against reference.py: its fp8 outputs are the reference's of its own h13,
    bit for bit; h13 is the reference GEMM's within the GEMMs' summation order."""
    from moe_fp8_ext import reference

    offs = offs_from_sizes(sizes)
    a, sa, _, _, offs, starts, (qi, si) = swiglu_operands(m, k, hidden, e, offs, seed=m + 1)
    poison("cuda")
    outs = [t.cpu() for t in bg.blockwise_grouped_mm_swiglu(a, sa, qi, si, offs, starts)]
    a, sa, qi, si, offs = (t.cpu() for t in (a, sa, qi, si, offs))
    assert_bits_equal(outs, (outs[0],) + reference.swiglu_blockwise_operands(outs[0], offs))
    assert_within_gemm_rounding(outs[0], reference.blockwise_grouped_mm_swiglu(a, sa, qi, si, offs)[0])


@requires_sm90
@pytest.mark.gpu
def test_swiglu_gemm_special_values():
    """Inf and NaN in x reach h13 and h: their rows' and token blocks' operands are NaN
    (the composed path's), the other blocks untouched."""
    m, k, hidden, e = 700, 256, 256, 2
    offs = offs_from_sizes([300, 400])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=g).bfloat16().cuda()
    x[7, 3], x[450, 100] = float("inf"), float("nan")
    w1, w3 = (torch.randn(e, hidden, k, generator=g).bfloat16().cuda() * 0.1 for _ in range(2))
    a, sa = moe_fp8_ext.quantize_blockwise_act_lhs(x, E4M3)
    parts = [w1.transpose(1, 2), w3.transpose(1, 2)]
    b, sb = moe_fp8_ext.quantize_blockwise_weight_rhs_cat(parts, E4M3)
    offs = offs.cuda()
    starts, _ = torch.ops.moe_fp8.padded_group_offsets(offs, m, BLOCK)
    refs = composed_swiglu(a, sa, b, sb, offs, starts)
    outs = bg.blockwise_grouped_mm_swiglu(
        a, sa, *moe_fp8_ext.quantize_blockwise_weight_rhs_cat(parts, E4M3, interleave=True), offs, starts)
    assert_bits_equal(outs, refs)
    assert bool(torch.isnan(outs[2][7]).all()) and bool(torch.isfinite(outs[2][8]).all())


@requires_sm90
@pytest.mark.gpu
def test_swiglu_gemm_graph_capture():
    offs = offs_from_sizes([200, 0, 333, 128])
    a, sa, _, _, offs, starts, (qi, si) = swiglu_operands(700, 256, 256, 4, offs, seed=9)
    graph_matches_eager(lambda: bg.blockwise_grouped_mm_swiglu(a, sa, qi, si, offs, starts))


@requires_sm90
@pytest.mark.gpu
def test_swiglu_gemm_garbage_starts_do_not_fault():
    """padded_starts off multiples of 128 or past the layout (bad input; checked on the
    CPU and with MOE_FP8_DEBUG=1): those groups' token blocks are not written, nothing is
    written out of bounds, and a well-formed call still works after them."""
    offs = offs_from_sizes([200, 100, 300])
    a, sa, b, sb, offs, starts, (qi, si) = swiglu_operands(600, 256, 256, 3, offs, seed=11)
    for bad in ([0, 200, 300], [0, 2**31 - 1, 256], [-128, 16, 1000000]):
        bg.blockwise_grouped_mm_swiglu(a, sa, qi, si, offs, torch.tensor(bad, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    assert_bits_equal(bg.blockwise_grouped_mm_swiglu(a, sa, qi, si, offs, starts),
                      composed_swiglu(a, sa, b, sb, offs, starts))


# ---- the W2 input-gradient GEMM with the dSwiGLU epilogue ---------------------------------------


def dswiglu_operands(m, k, hidden, e, offs, seed=0, device="cuda", tail_zero=True):
    """grad_out's 1x128 operand, W2's (E, K, hidden) operand, h13 = [h1 | h3] (its rows past
    offs[-1] zero where tail_zero, as the forward GEMM leaves them), padded starts."""
    g = torch.Generator().manual_seed(seed)
    go = (torch.randn(m, k, generator=g) * block_magnitudes((m, k), [1], g)).bfloat16().to(device)
    w2 = (torch.randn(e, k, hidden, generator=g) * 0.05 * block_magnitudes((e, k, hidden), [1, 2], g)).bfloat16()
    h13 = (torch.randn(m, 2 * hidden, generator=g) * 3 * block_magnitudes((m, 2 * hidden), [1], g)).bfloat16()
    if tail_zero:
        h13[int(offs[-1]) if offs.numel() else 0:] = 0
    a, sa = moe_fp8_ext.quantize_blockwise_act_lhs(go, E4M3)
    b, sb = moe_fp8_ext.quantize_blockwise_weight_rhs(w2.to(device), E4M3)
    offs = offs.to(device)
    starts, _ = torch.ops.moe_fp8.padded_group_offsets(offs, m, BLOCK)
    return a, sa, b, sb, offs, h13.to(device), starts


def dswiglu_kernels(grad_h, h13, offs, starts):
    """The SwiGLU backward op, then the activation dual of grad_h13: the fused op's epilogue outputs."""
    g13 = torch.ops.moe_fp8.swiglu_backward(grad_h, h13)
    return tuple(torch.ops.moe_fp8.quantize_blockwise_act_dual(g13, E4M3, offs, starts, BLOCK))


def _gpu_dswiglu():
    return dswiglu_operands(700, 256, 256, 4, offs_from_sizes([200, 0, 333, 128]), seed=8)


DSWIGLU_NAMES = ("q_rows", "s_rows", "q_cols", "s_cols")


def test_dswiglu_gemm_fake_and_checks():
    m, k, hidden, e = 300, 256, 256, 4
    a, sa, b, sb, offs = operands_2d3d(m, k, hidden, e)
    h13 = torch.empty(m, 2 * hidden, dtype=torch.bfloat16, device="meta")
    starts = torch.empty(e, dtype=torch.int32, device="meta")
    qr, sr, qc, sc = torch.ops.moe_fp8.blockwise_grouped_mm_dswiglu(a, sa, b, sb, offs, h13, starts)
    r = cdiv(m + e * BLOCK, BLOCK) * BLOCK
    assert qr.shape == (m, 2 * hidden) and qr.dtype == E4M3 and sr.shape == (m, 4) and sr.stride() == (1, m)
    assert qc.shape == (r, 2 * hidden) and qc.stride() == (1, r) and sc.shape == (r // BLOCK, 2 * hidden)
    with pytest.raises(RuntimeError, match="hidden\\) to be a multiple of 128"):
        bg.blockwise_grouped_mm_dswiglu(*operands_2d3d(m, k, 192, e), h13[:, :384], starts)
    with pytest.raises(RuntimeError, match="h13 a contiguous bfloat16 tensor of shape"):
        bg.blockwise_grouped_mm_dswiglu(a, sa, b, sb, offs, h13[:, :hidden], starts)
    with pytest.raises(RuntimeError, match="h13 a contiguous bfloat16 tensor of shape"):
        bg.blockwise_grouped_mm_dswiglu(a, sa, b, sb, offs, h13.float(), starts)
    with pytest.raises(RuntimeError, match="h13 a contiguous bfloat16 tensor of shape"):
        bg.blockwise_grouped_mm_dswiglu(a, sa, b, sb, offs, h13.t().contiguous().t(), starts)
    with pytest.raises(RuntimeError, match="padded_starts of shape"):
        bg.blockwise_grouped_mm_dswiglu(a, sa, b, sb, offs, h13, starts[:2])
    with pytest.raises(RuntimeError, match="expected CUDA tensors"):
        cpu = operands_2d3d(m, k, hidden, e, device="cpu")
        bg.blockwise_grouped_mm_dswiglu(*cpu, torch.zeros(m, 2 * hidden, dtype=torch.bfloat16),
                                        torch.zeros(e, dtype=torch.int32))


@pytest.mark.parametrize("hidden, sizes", [(384, [200, 0, 333, 100]), (128, [150, 128, 1, 300])])
def test_dswiglu_gemm_reference_is_the_composed_math(hidden, sizes):
    """reference.blockwise_grouped_mm_dswiglu, the op's spec: the plain GEMM's grad_h
    (within the summation order), then the SwiGLU backward and activation dual kernels
    bit for bit (CPU); rows past offs[-1] (h13's there from the forward: zero) zero."""
    from moe_fp8_ext import reference

    m, k, e = 700, 256, len(sizes)
    a, sa, b, sb, offs, h13, starts = dswiglu_operands(m, k, hidden, e, offs_from_sizes(sizes), 4, "cpu")
    grad_h = reference._blockwise_grouped_gemm(a, sa, reference._blockwise_weights(b, sb), offs)
    plain = moe_fp8_ext.get_recipe("fp8_blockwise").mm_2d3d((a, sa), (b, sb), offs, torch.bfloat16, "emulated")
    assert_within_gemm_rounding(grad_h, plain)
    ref = reference.blockwise_grouped_mm_dswiglu(a, sa, b, sb, offs, h13)
    assert_bits_equal(ref, dswiglu_kernels(grad_h, h13, offs, starts), DSWIGLU_NAMES)
    assert not bool(ref[0][sum(sizes):].float().any())


# SwiGLU's groups; here hidden 128 and 384 (an odd number of column tiles) run the kernel with 2x1 clusters, 256 and
# 512 with 1x2 ones.
DSWIGLU_CASES = SWIGLU_CASES


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m, k, hidden, e, sizes", DSWIGLU_CASES)
def test_dswiglu_gemm_is_the_composed_path(m, k, hidden, e, sizes):
    a, sa, b, sb, offs, h13, starts = dswiglu_operands(m, k, hidden, e, offs_from_sizes(sizes), seed=m + hidden)
    refs = dswiglu_kernels(mm_2d3d(a, sa, b, sb, offs), h13, offs, starts)
    poison("cuda")
    outs = bg.blockwise_grouped_mm_dswiglu(a, sa, b, sb, offs, h13, starts)
    assert_bits_equal(outs, refs, DSWIGLU_NAMES)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m, k, hidden, e, sizes", DSWIGLU_CASES[:2])
def test_dswiglu_gemm_is_the_reference(m, k, hidden, e, sizes):
    """The op against reference.py, h13's rows past the last group not zero (the op writes
    zero codes there whatever they hold): its outputs are the reference's epilogue of the
    plain GEMM's grad_h bit for bit, and that grad_h the reference GEMM's within the
    GEMMs' summation order."""
    from moe_fp8_ext import reference

    offs = offs_from_sizes(sizes)
    a, sa, b, sb, offs, h13, starts = dswiglu_operands(m, k, hidden, e, offs, seed=m + 1, tail_zero=False)
    grad_h = mm_2d3d(a, sa, b, sb, offs).cpu()
    poison("cuda")
    outs = [t.cpu() for t in bg.blockwise_grouped_mm_dswiglu(a, sa, b, sb, offs, h13, starts)]
    a, sa, b, sb, offs, h13 = (t.cpu() for t in (a, sa, b, sb, offs, h13))
    assert_bits_equal(outs, reference.dswiglu_blockwise_operands(grad_h, h13, offs), DSWIGLU_NAMES)
    assert_within_gemm_rounding(grad_h, reference._blockwise_grouped_gemm(a, sa, reference._blockwise_weights(b, sb),
                                                                          offs))
    assert not bool(outs[0][sum(sizes):].float().any())


@requires_sm90
@pytest.mark.gpu
def test_dswiglu_gemm_special_values():
    """Inf and NaN in grad_out and h13 reach grad_h13: their rows' and token blocks'
    operands are the composed path's."""
    offs = offs_from_sizes([300, 400])
    a, sa, b, sb, offs, h13, starts = dswiglu_operands(700, 256, 256, 2, offs, seed=5)
    h13[7, 3], h13[450, 300], h13[500, 10] = float("inf"), float("nan"), float("-inf")
    refs = dswiglu_kernels(mm_2d3d(a, sa, b, sb, offs), h13, offs, starts)
    outs = bg.blockwise_grouped_mm_dswiglu(a, sa, b, sb, offs, h13, starts)
    assert_bits_equal(outs, refs, DSWIGLU_NAMES)
    assert bool(torch.isnan(outs[1][450]).any()) and bool(torch.isfinite(outs[1][8]).all())


@requires_sm90
@pytest.mark.gpu
def test_dswiglu_gemm_graph_capture():
    args = _gpu_dswiglu()
    graph_matches_eager(lambda: bg.blockwise_grouped_mm_dswiglu(*args))


@requires_sm90
@pytest.mark.gpu
def test_dswiglu_gemm_garbage_starts_do_not_fault():
    """padded_starts off multiples of 128 or past the layout: those groups' token blocks
    are not written, nothing out of bounds, and a well-formed call still works after."""
    a, sa, b, sb, offs, h13, starts = dswiglu_operands(600, 256, 256, 3, offs_from_sizes([200, 100, 300]), seed=11)
    for bad in ([0, 200, 300], [0, 2**31 - 1, 256], [-128, 16, 1000000]):
        bg.blockwise_grouped_mm_dswiglu(a, sa, b, sb, offs, h13, torch.tensor(bad, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    assert_bits_equal(bg.blockwise_grouped_mm_dswiglu(a, sa, b, sb, offs, h13, starts),
                      dswiglu_kernels(mm_2d3d(a, sa, b, sb, offs), h13, offs, starts), DSWIGLU_NAMES)
