"""Token groups (DESIGN §8): pad / unpad, the padded jagged quantization, the
expert-parallel permutation indices, row gather / scatter, zero_rows_past_groups_,
padded_group_offsets, dequantize_rows, sum_rows, combine_rows, their autograd, and torch.compile. Every op is compared with
moe_fp8_ext.reference, bit for bit, on CPU and (when present) GPU; errors; opcheck
on every op of the family (OPCHECK_CASES; test_op_coverage.py checks that every
registered op has a case); GPU only: large shapes bit-exact with the CPU op, garbage
offs, and the ops captured in a CUDA graph (no host sync)."""

import pytest
import torch

import moe_fp8_ext
from moe_fp8_ext import reference as ref
from conftest import (
    DEVICES,
    FP8_DTYPES,
    assert_fp8_equal,
    assert_scale_equal,
    graph_matches_eager,
    poison,
    randn,
    random_offs,
    requires_cuda,
    same_as_cpu,
)

MOVE_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.int32]


def rows_of(dtype, shape, device, gen):
    x = torch.randn(shape, generator=gen)
    if dtype == torch.int32:
        return torch.randint(-1000, 1000, shape, generator=gen, dtype=torch.int32).to(device)
    return x.to(dtype).to(device)


def assert_bytes_equal(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("groups, alignment", [(1, 16), (8, 1), (8, 32), (64, 16), (300, 128), (1024, 2), (5000, 16)])
def test_pad_unpad_match_reference(device, groups, alignment):
    gen = torch.Generator().manual_seed(groups * 131 + alignment)
    m, d = 4099, 40  # 80-byte bf16 rows: the 16-byte path
    x = rows_of(torch.bfloat16, (m, d), device, gen)
    offs = random_offs(m, groups, tail=3, generator=gen, device=device)  # a few tail rows past offs[-1]
    poison(device)
    xp, starts, ends = moe_fp8_ext.pad_token_groups(x, offs, alignment)
    rxp, rstarts, rends = ref.pad_token_groups(x.cpu(), offs.cpu(), alignment)
    assert xp.shape[0] == moe_fp8_ext.padded_rows(m, groups, alignment)
    assert torch.equal(starts.cpu(), rstarts) and torch.equal(ends.cpu(), rends)
    assert_bytes_equal(xp, rxp)
    assert int(ends[-1]) % alignment == 0 and bool((starts.cpu() % alignment == 0).all())
    poison(device)
    back = moe_fp8_ext.unpad_token_groups(xp, offs, starts, m)
    want = x.cpu().clone()
    want[int(offs[-1]):] = 0  # tokens past the last group are not part of any group
    assert_bytes_equal(back, want)
    s2, e2 = moe_fp8_ext.padded_group_offsets(offs, m, alignment)
    assert torch.equal(s2, starts) and torch.equal(e2, ends)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
@pytest.mark.parametrize("width", [1, 7, 64, 129])  # odd byte widths take the narrower copy paths
def test_pad_any_dtype_and_width(device, dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = rows_of(dtype, (300, width), device, gen)
    offs = torch.tensor([0, 17, 17, 160, 299], dtype=torch.int32, device=device)
    xp, starts, ends = moe_fp8_ext.pad_token_groups(x, offs, 32)
    rxp, rs, re = ref.pad_token_groups(x.cpu(), offs.cpu(), 32)
    assert_bytes_equal(xp, rxp)
    assert_bytes_equal(moe_fp8_ext.unpad_token_groups(xp, offs, starts, 300), ref.unpad_token_groups(rxp, offs.cpu(), rs, 300))


@pytest.mark.parametrize("device", DEVICES)
def test_pad_non_contiguous_inputs(device):
    gen = torch.Generator().manual_seed(3)
    base = rows_of(torch.bfloat16, (200, 96), device, gen)
    offs = torch.tensor([50, 50, 130, 200], dtype=torch.int32, device=device)
    for x in (base[:, 8:72], base.t().contiguous().t(), base[::1, ::2]):
        xp, s, e = moe_fp8_ext.pad_token_groups(x, offs, 16)
        assert_bytes_equal(xp, ref.pad_token_groups(x.cpu().contiguous(), offs.cpu(), 16)[0])
        assert_bytes_equal(moe_fp8_ext.unpad_token_groups(xp[:, :], offs, s, 200), x.cpu().contiguous())


@pytest.mark.parametrize("device", DEVICES)
def test_pad_edge_sizes(device):
    x = torch.randn(0, 8, device=device)
    xp, s, e = moe_fp8_ext.pad_token_groups(x, torch.zeros(3, dtype=torch.int32, device=device), 16)
    assert xp.shape == (48, 8) and bool((xp == 0).all()) and s.tolist() == [0, 0, 0] and e.tolist() == [0, 0, 0]
    xp, s, e = moe_fp8_ext.pad_token_groups(torch.ones(5, 4, device=device), torch.zeros(0, dtype=torch.int32, device=device), 8)
    assert xp.shape == (8, 4) and bool((xp == 0).all()) and s.numel() == 0
    x = torch.randn(33, 0, device=device)
    xp, s, e = moe_fp8_ext.pad_token_groups(x, torch.tensor([3, 33], dtype=torch.int32, device=device), 16)
    assert xp.shape == (80, 0) and s.tolist() == [0, 16] and e.tolist() == [16, 48]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_zero_rows_past_groups(device, dtype):
    gen = torch.Generator().manual_seed(9)
    base = rows_of(dtype, (50, 14), device, gen)
    for x, offs in ((base.clone(), [10, 30, 41]), (base.clone()[:, 3:10], [50]), (base.clone(), []), (base.clone()[::2], [0, 2])):
        before = x.clone()
        o = torch.tensor(offs, dtype=torch.int32, device=device)
        assert moe_fp8_ext.zero_rows_past_groups_(x, o) is x
        end = offs[-1] if offs else 0
        assert_bytes_equal(x[:end], before[:end])
        assert not x[end:].view(torch.uint8).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("alignment", [1, 16, 32, 128])
def test_jagged_colwise_padded_layout(device, fp8_dtype, alignment):
    gen = torch.Generator().manual_seed(alignment)
    m = 1000
    x1 = randn((m, 160), torch.bfloat16, device)
    x1[m // 2, 7] = float("nan")  # a NaN column: its padding rows are NaN too (0 x NaN scale)
    x2 = randn((m, 48), torch.bfloat16, device)
    offs = random_offs(m, 9, tail=5, generator=gen, device=device)
    starts, ends = moe_fp8_ext.padded_group_offsets(offs, m, alignment)
    poison(device)
    q1, s1, q2, s2 = moe_fp8_ext.quantize_jagged_colwise_dual(x1, x2, offs, fp8_dtype, padded_starts=starts, alignment=alignment)
    for q, s, x in ((q1, s1, x1), (q2, s2, x2)):
        rq, rs = ref.quantize_jagged_colwise_padded(x.cpu(), offs.cpu(), alignment, fp8_dtype)
        assert q.stride() == (1, q.shape[0])
        assert_fp8_equal(q, rq)
        assert_scale_equal(s, rs)
    q, s = moe_fp8_ext.quantize_jagged_colwise(x2, offs, fp8_dtype, padded_starts=starts, alignment=alignment)
    assert_fp8_equal(q, q2)
    assert_scale_equal(s, s2)


# Every quantization that writes the padded layout, with its alignment (a multiple of
# its block): called as f(x, offs, padded_starts, alignment).
PADDED_QUANTIZATIONS = {
    "quantize_jagged_colwise": (16, lambda x, o, s, a: moe_fp8_ext.quantize_jagged_colwise(
        x, o, padded_starts=s, alignment=a)),
    "quantize_jagged_colwise_dual": (16, lambda x, o, s, a: moe_fp8_ext.quantize_jagged_colwise_dual(
        x, x, o, padded_starts=s, alignment=a)),
    "quantize_rowwise_jagged_dual": (16, lambda x, o, s, a: moe_fp8_ext.quantize_rowwise_jagged_dual(
        x, o, padded_starts=s, alignment=a)),
    "quantize_mxfp8_colwise": (32, lambda x, o, s, a: moe_fp8_ext.quantize_mxfp8_colwise(
        x, offs=o, padded_starts=s, alignment=a)),
    "quantize_blockwise_act_rhs": (128, lambda x, o, s, a: moe_fp8_ext.quantize_blockwise_act_rhs(
        x, None, o, s, a)),
    "quantize_blockwise_act_transposed_lhs": (128, lambda x, o, s, a: moe_fp8_ext.quantize_blockwise_act_transposed_lhs(
        x, None, o, s, a)),
    "quantize_blockwise_act_dual": (128, lambda x, o, s, a: moe_fp8_ext.quantize_blockwise_act_dual(
        x, None, o, s, a)),
}


@pytest.mark.parametrize("op", list(PADDED_QUANTIZATIONS))
@pytest.mark.parametrize("case", ["between", "before", "wide"])
def test_quantizations_refuse_gapped_layouts(op, case):
    # The quantizations write each group's padded rows and the tail, never rows between groups (leftover memory: a NaN
    # under a GEMM over padded ends), so only padded_group_offsets' gap-free layout is valid; others raise where offs is
    # checked (CPU; GPU with MOE_FP8_DEBUG=1). pad_token_groups_at takes any non-overlapping placement, zeroing gaps.
    a, f = PADDED_QUANTIZATIONS[op]
    m, sizes = 6 * a, [a // 2, a + 1]
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    starts, _ = moe_fp8_ext.padded_group_offsets(offs, m, a)
    assert starts.tolist() == [0, a]
    gapped = {"between": [0, 2 * a], "before": [a, 2 * a], "wide": [0, 4 * a]}[case]
    gapped = torch.tensor(gapped, dtype=torch.int32)
    rows = moe_fp8_ext.padded_rows(m, 2, a)
    x = torch.randn(m, 64).to(torch.bfloat16)
    f(x, offs, starts, a)  # the gap-free layout
    with pytest.raises(RuntimeError, match=f"{op}: expected padded_starts without gaps"):
        f(x, offs, gapped, a)
    xp = torch.ops.moe_fp8.pad_token_groups_at(x, offs, gapped, rows)  # any placement
    ends = gapped + torch.tensor(sizes, dtype=torch.int32)
    keep = torch.zeros(rows, dtype=torch.bool)
    for s, e in zip(gapped.tolist(), ends.tolist()):
        keep[s:e] = True
    assert torch.equal(xp[~keep], torch.zeros_like(xp[~keep]))
    assert torch.equal(xp[keep], x[:offs[-1]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ranks, experts", [(1, 1), (2, 3), (8, 8), (8, 32), (64, 4)])
def test_permute_indices_match_reference(device, ranks, experts):
    gen = torch.Generator().manual_seed(ranks * 100 + experts)
    counts = torch.randint(0, 40, (ranks * experts,), generator=gen, dtype=torch.int32)
    counts[torch.rand(counts.shape, generator=gen) < 0.25] = 0
    counts[:experts] = 0 if ranks > 1 else counts[:experts]  # rank 0 sends nothing
    counts = counts.to(device)
    m = int(counts.sum())
    for alignment in (1, 16, 128):
        max_len = moe_fp8_ext.padded_rows(m, experts, alignment)
        poison(device)
        idx, sizes, ends = moe_fp8_ext.permute_indices(counts, experts, ranks, alignment, max_len)
        ridx, rsizes, rends = ref.permute_indices(counts.cpu(), experts, ranks, alignment, max_len)
        assert torch.equal(idx.cpu(), ridx) and torch.equal(sizes.cpu(), rsizes) and torch.equal(ends.cpu(), rends)
        assert bool((sizes >= alignment).all())
        valid = idx[idx >= 0].cpu()
        assert torch.equal(valid.sort().values, torch.arange(m, dtype=torch.int32))  # a permutation of the tokens


def test_permute_indices_max_len_too_small_raises():
    counts = torch.tensor([5, 7, 0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"permute_indices: expected max_len >= 32"):
        moe_fp8_ext.permute_indices(counts, 2, 2, 16, 20)
    with pytest.raises(RuntimeError, match="expected non-negative token counts"):
        moe_fp8_ext.permute_indices(torch.tensor([1, -1], dtype=torch.int32), 2, 1, 16, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_gather_scatter_rows(device, dtype):
    gen = torch.Generator().manual_seed(5)
    x = rows_of(dtype, (77, 33), device, gen)
    counts = torch.tensor([3, 9, 0, 20, 11, 0, 30, 4], dtype=torch.int32, device=device)
    idx, _, _ = moe_fp8_ext.permute_indices(counts, 4, 2, 16, moe_fp8_ext.padded_rows(77, 4, 16))
    poison(device)
    y = moe_fp8_ext.gather_rows(x, idx)
    assert_bytes_equal(y, ref.gather_rows(x.cpu(), idx.cpu()))
    poison(device)
    assert_bytes_equal(moe_fp8_ext.scatter_rows(y, idx, 77), x)
    # Rows no slot points to come back as zeros.
    z = moe_fp8_ext.scatter_rows(y, idx, 80)
    assert_bytes_equal(z, ref.scatter_rows(y.cpu(), idx.cpu(), 80))


_NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def assert_dequantized_equal(y, expect):
    """Bit for bit; every NaN the type's +NaN (torch's casts may give another NaN)."""
    assert y.shape == expect.shape and y.dtype == expect.dtype and y.is_contiguous()
    y, expect = y.cpu(), expect.cpu()
    nan = y.isnan()
    assert torch.equal(nan, expect.isnan())
    bits = y.view(_INT_VIEW[y.dtype])
    assert bool((bits[nan] == torch.tensor(_NAN_BITS[y.dtype]).to(bits.dtype)).all())
    assert torch.equal(bits[~nan], expect.view(bits.dtype)[~nan])


def fp8_rows_of(f8, rows, cols, device, gen, layout):
    """Every fp8 code (when rows·cols >= 256) in random places, as a strided view
    (every other byte) or a contiguous view one byte off an 8-byte boundary."""
    n = rows * cols
    codes = (torch.arange(n) % 256).to(torch.uint8)[torch.randperm(n, generator=gen)].view(rows, cols)
    if layout == "strided":
        buf = torch.zeros(rows, 2 * cols, dtype=torch.uint8)
        buf[:, ::2] = codes
        return buf.to(device).view(f8)[:, ::2]
    buf = torch.zeros(n + 1, dtype=torch.uint8)
    buf[1:] = codes.reshape(-1)
    return buf.to(device).view(f8)[1:].view(rows, cols)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("f8", FP8_DTYPES + [torch.float8_e5m2])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows, cols, block", [(37, 256, 128), (37, 144, 128), (5, 100, 100), (9, 2048, 2048),
                                               (7, 40, 16), (3, 256, 1000), (0, 256, 128)])
@pytest.mark.parametrize("layout", ["strided", "offset"])
def test_dequantize_rows_matches_reference(device, f8, out_dtype, rows, cols, block, layout):
    """Every fp8 code (NaN, Inf, subnormals) times scales from fp32 subnormals to 1e6
    (products that overflow fp16 and underflow to subnormals); 1x128 blocks, one scale a
    row, partial blocks; non-contiguous or misaligned q, column-major scales; a poisoned
    output."""
    gen = torch.Generator().manual_seed(rows * 7 + cols + block)
    q = fp8_rows_of(f8, rows, cols, device, gen, layout)
    blocks = (cols - 1) // block + 1
    s = torch.pow(10.0, torch.empty(blocks, rows).uniform_(-42, 6, generator=gen)).to(device).t()
    poison(device)
    y = moe_fp8_ext.ops.token_groups.dequantize_rows(q, s, block, out_dtype)
    assert_dequantized_equal(y, ref.dequantize_rows(q.cpu(), s.cpu(), block, out_dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_rows_fp16_rounding_edges(device):
    """1.0 times scales that land on fp16's rounding edges: the largest finite value,
    just below and at the overflow tie, a normal tie, subnormal ties."""
    edges = [65504.0, 65519.99, 65520.0, 1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, 2**-24 + 2**-40, -65520.0]
    s = torch.tensor(edges, dtype=torch.float32)[:, None].to(device)
    q = torch.ones(len(edges), 8).to(torch.float8_e4m3fn).to(device)
    y = moe_fp8_ext.ops.token_groups.dequantize_rows(q, s, 8, torch.float16)
    assert torch.equal(y.cpu().view(torch.int16), s.cpu().expand(-1, 8).to(torch.float16).view(torch.int16))


@requires_cuda
@pytest.mark.gpu
def test_dequantize_rows_large_on_gpu():
    """More work than one grid of resident blocks: the GPU op against the CPU op."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 256, (8192, 4096), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(8192, 32, generator=gen) + 0.5
    poison("cuda")
    y = moe_fp8_ext.ops.token_groups.dequantize_rows(q.cuda(), s.cuda(), 128, torch.bfloat16)
    assert_dequantized_equal(y, moe_fp8_ext.ops.token_groups.dequantize_rows(q, s, 128, torch.bfloat16))


def test_dequantize_rows_errors():
    """The wrapper's checks and the op's own (no wrapper) give the same messages."""
    q, s = torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 2)
    cases = [((q.float(), s, 128, torch.bfloat16), r"expected q of dtype float8_e4m3fn, float8_e4m3fnuz or "
              r"float8_e5m2, got Float"),
             ((q, s.double(), 128, torch.bfloat16), "expected scale of dtype float32, got Double"),
             ((q, s, 256, torch.bfloat16), r"expected scale of shape \(4, 1\) \(a scale per row and block of 256"),
             ((q, s, 100, torch.bfloat16), r"expected scale of shape \(4, 3\)"),
             ((q, s, 0, torch.bfloat16), r"expected block in \[1, 9223372036854775807\], got 0"),
             ((q, s, 128, torch.int32), "expected out_dtype bfloat16, float16 or float32, got Int")]
    for fn in (moe_fp8_ext.ops.token_groups.dequantize_rows, torch.ops.moe_fp8.dequantize_rows):
        for args, message in cases:
            with pytest.raises(RuntimeError, match="dequantize_rows: " + message):
                fn(*args)


def rows_of_tokens(tokens, rows, k, device, gen):
    """A row gather's indices as a dispatcher makes them: each token's k rows (fewer for
    some, none for others), in a random order; with the rows grouped by token, ascending
    (the indices and offs of sum_rows) and the token of each row."""
    token = torch.arange(tokens).repeat_interleave(k)[torch.randperm(tokens * k, generator=gen)][:rows]
    order = torch.sort(token, stable=True)[1].to(torch.int32)
    offs = torch.searchsorted(token.sort().values, torch.arange(1, tokens + 1)).to(torch.int32)
    return token.to(torch.int32).to(device), order.to(device), offs.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens, rows, k, width", [(37, 200, 6, 72), (64, 512, 8, 256), (5, 9, 2, 3), (5, 40, 8, 16),
                                                    (9, 0, 4, 8)])
def test_sum_rows_is_the_gather_backward(device, dtype, tokens, rows, k, width):
    """Each token's rows summed in ascending order: the reference, and the bits of
    autograd's backward of x[token] (index_put with accumulate) on the same device (on
    CUDA for rows of more than 64 elements: torch adds narrower rows' repeats in fp32 and
    rounds once); values of every size (fp16 overflow to Inf, -0 sums), rows apart by
    more than their width, a poisoned output."""
    gen = torch.Generator().manual_seed(tokens + rows + width)
    token, order, offs = rows_of_tokens(tokens, rows, k, device, gen)
    g = (torch.randn(rows, width, generator=gen) * torch.logspace(-30, 4, width)).to(dtype)
    g[::7] = -g[::7].abs() * 1e-30
    g = torch.cat([g, g], 1).to(device)[:, :width]  # (rows 2 * width apart)
    poison(device)
    got = torch.ops.moe_fp8.sum_rows(g, order, offs)
    assert got.shape == (tokens, width) and got.dtype == dtype and got.is_contiguous()
    assert_same_bits(got, ref.sum_rows(g, order, offs))
    if device == "cpu" or width > 64:
        assert_same_bits(got, gather_backward(token, g, tokens))


def assert_same_bits(a, b):
    """Bit for bit, NaN for NaN (of any payload: torch's casts differ by device)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    a, b = a.cpu(), b.cpu()
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    bits = _INT_VIEW[a.dtype]
    assert torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])


def gather_backward(token, g, tokens):
    """Autograd's backward of x[token] (one CPU thread: torch's CPU index_put adds fp32
    rows with atomics across threads, in no fixed order)."""
    x = torch.zeros(tokens, g.shape[1], dtype=g.dtype, device=g.device, requires_grad=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.autograd.backward(x[token.long()], g)
    finally:
        torch.set_num_threads(threads)
    return x.grad


@pytest.mark.parametrize("device", DEVICES)
def test_sum_rows_skips_minus_one_and_leaves_empty_tokens_zero(device):
    x = torch.tensor([[1.0, -0.0], [2.0, 3.0], [-0.0, -0.0]], device=device)
    idx = _i32([1, -1, 0, 2, -1, 2], device)
    offs = _i32([3, 3, 5, 6], device)  # (token 1: no rows; token 2: -0 only, kept +0 + -0 = +0)
    got = torch.ops.moe_fp8.sum_rows(x, idx, offs)
    want = torch.tensor([[3.0, 3.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], device=device)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert_same_bits(got, ref.sum_rows(x, idx, offs))


def torchtitan_combine(y, scores, token, tokens):
    """torchtitan 0.3.0's combine (LocalTokenDispatcher.combine): the scores applied in
    fp32, a cast, and a deterministic scatter_add (one CPU thread, as gather_backward)."""
    out = torch.zeros(tokens, y.shape[1], dtype=y.dtype, device=y.device)
    scaled = (y.to(torch.float32) * scores.reshape(-1, 1)).to(y.dtype)
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        return out.scatter_add(0, token.long().reshape(-1, 1).expand(-1, y.shape[1]), scaled)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens, rows, k, width", [(37, 200, 6, 72), (64, 512, 8, 256), (5, 9, 2, 3), (5, 40, 8, 300),
                                                    (9, 0, 4, 8)])
def test_combine_rows_and_backward(device, dtype, tokens, rows, k, width):
    """combine_rows and its backward: the reference's bits on every device, for values of
    every size, rows apart by more than their width, a poisoned output; the forward also
    has the bits of torchtitan's combine (fp32; bf16 on CUDA for rows of more than 64
    elements, as sum_rows), y's gradient those of autograd through it, and the
    scores' gradient is within fp32 ordering of autograd's."""
    gen = torch.Generator().manual_seed(tokens + rows + width + 1)
    token, order, offs = rows_of_tokens(tokens, rows, k, device, gen)
    y = (torch.randn(rows, width, generator=gen) * torch.logspace(-30, 4, width)).to(dtype)
    y[::7] = -y[::7].abs() * 1e-30
    y = torch.cat([y, y], 1).to(device)[:, :width]
    scores = torch.rand(rows, generator=gen).to(device)
    g = randn((tokens, width), dtype, device)
    poison(device)
    got = torch.ops.moe_fp8.combine_rows(y, scores, order, offs)
    assert got.shape == (tokens, width) and got.dtype == dtype and got.is_contiguous()
    assert_same_bits(got, ref.combine_rows(y, scores, order, offs))
    poison(device)
    gy, gs = torch.ops.moe_fp8.combine_rows_backward(g, y, scores, token)
    want_gy, want_gs = ref.combine_rows_backward(g, y, scores, token)
    assert_same_bits(gy, want_gy)
    assert_same_bits(gs, want_gs)
    yr, sr = y.detach().requires_grad_(), scores.detach().requires_grad_()
    tt = torchtitan_combine(yr, sr, token, tokens)
    tt.backward(g)
    if dtype == torch.float32 or (dtype == torch.bfloat16 and device != "cpu" and width > 64):
        assert_same_bits(got, tt.detach())  # (fp16: Inf; torch's CPU scatter_add adds bf16 in fp32)
    assert_same_bits(gy, yr.grad)
    assert_dots_close(gs, sr.grad, g, y, token)


def assert_dots_close(got, want, g, y, token):
    """Two fp32 sums of the products g[token[i]] * y[i] in different orders: apart by at
    most the bound of a sum's rounding, columns x 2^-23 x the sum of |products|."""
    finite = want.isfinite()
    assert torch.equal(finite, got.isfinite())
    live = (token >= 0).long()
    mass = (g.float()[token.long().clamp(min=0)].abs() * y.float().abs()).sum(1) * live
    bound = mass * y.shape[1] * 2.0**-23
    assert torch.all((got - want).abs()[finite] <= bound[finite])


@pytest.mark.parametrize("device", DEVICES)
def test_combine_rows_minus_one_rows_and_tokens_without_rows(device):
    y = torch.tensor([[1.0, -0.0], [2.0, 3.0], [-0.0, -0.0]], device=device)
    scores = torch.tensor([0.5, -1.0, 2.0], device=device)
    idx, offs = _i32([1, -1, 0, 2, -1, 2], device), _i32([3, 3, 5, 6], device)
    got = torch.ops.moe_fp8.combine_rows(y, scores, idx, offs)
    want = torch.tensor([[-1.5, -3.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], device=device)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # (+0 + -0 = +0)
    token = _i32([0, -1, 3], device)
    gy, gs = torch.ops.moe_fp8.combine_rows_backward(torch.ones(4, 2, device=device), y, scores, token)
    assert torch.equal(gy.view(torch.int32), torch.tensor([[0.5, 0.5], [0.0, 0.0], [2.0, 2.0]],
                                                          device=device).view(torch.int32))
    assert torch.equal(gs, torch.tensor([1.0, 0.0, 0.0], device=device))


def test_combine_rows_errors():
    y, s = torch.randn(4, 3), torch.rand(4)
    idx, offs = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    cases = [((y, s.double(), idx, offs), "expected scores of dtype float32, got Double"),
             ((y, s[:3], idx, offs), r"expected scores of 4 elements \(one a row of x\), got 3"),
             ((y, s[None], idx, offs), "expected scores to be a 1-D tensor, got 2-D"),
             ((y.to(torch.int32), s, idx, offs), "expected x of dtype bfloat16, float16 or float32, got Int")]
    for fn in (moe_fp8_ext.ops.token_groups.combine_rows, torch.ops.moe_fp8.combine_rows):
        for args, message in cases:
            with pytest.raises(RuntimeError, match="combine_rows: " + message):
                fn(*args)
    g, token = torch.randn(2, 3), torch.tensor([0, 1, -1, 1], dtype=torch.int32)
    cases = [((g.double(), y, s, token), "expected grad of x's dtype and columns"),
             ((g[:, :2], y, s, token), "expected grad of x's dtype and columns"),
             ((g, y, s, token[:3]), r"expected token of 4 elements \(one a row of x\), got 3"),
             ((g, y, s, token.long()), "expected token of dtype int32, got Long")]
    for fn in (moe_fp8_ext.ops.token_groups.combine_rows_backward, torch.ops.moe_fp8.combine_rows_backward):
        for args, message in cases:
            with pytest.raises(RuntimeError, match="combine_rows_backward: " + message):
                fn(*args)
    with pytest.raises(RuntimeError, match=r"combine_rows_backward: expected indices in \[-1, 2\), got 2 at 1"):
        torch.ops.moe_fp8.combine_rows_backward(g, y, s, torch.tensor([0, 2, 0, 0], dtype=torch.int32))


def test_sum_rows_errors():
    x, idx, offs = torch.randn(4, 3), torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    cases = [((x.to(torch.int32), idx, offs), "expected x of dtype bfloat16, float16 or float32, got Int"),
             ((x[0], idx, offs), "expected x to be a 2-D tensor, got 1-D"),
             ((x, idx.long(), offs), "expected indices of dtype int32, got Long"),
             ((x, idx, offs[None]), "expected offs to be a 1-D tensor, got 2-D")]
    for fn in (moe_fp8_ext.ops.token_groups.sum_rows, torch.ops.moe_fp8.sum_rows):
        for args, message in cases:
            with pytest.raises(RuntimeError, match="sum_rows: " + message):
                fn(*args)
    with pytest.raises(RuntimeError, match=r"sum_rows: expected offs\[1\] in \[0, 2\], got 3"):
        torch.ops.moe_fp8.sum_rows(x, idx, torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"sum_rows: expected indices in \[-1, 4\), got 4 at 1"):
        torch.ops.moe_fp8.sum_rows(x, torch.tensor([0, 4], dtype=torch.int32), offs)


def test_gather_scatter_reject_bad_indices():
    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match=r"gather_rows: expected indices in \[-1, 4\), got 4 at 1"):
        moe_fp8_ext.gather_rows(x, torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="scatter_rows: expected every row at most once in indices, got row 1 twice"):
        moe_fp8_ext.scatter_rows(x[:2], torch.tensor([1, 1], dtype=torch.int32), 4)
    with pytest.raises(RuntimeError, match=r"scatter_rows: expected indices of shape \(2,\)"):
        moe_fp8_ext.scatter_rows(x[:2], torch.tensor([1], dtype=torch.int32), 4)
    # More rows in y than the int32 slots of the inverse map hold (broadcast views: no
    # memory), through the wrapper, the op itself and the fake kernel.
    n = 2**31 + 8
    y, idx = torch.zeros(1, 1, dtype=torch.uint8).expand(n, 1), torch.full((1,), -1, dtype=torch.int32).expand(n)
    meta = (torch.empty(n, 1, dtype=torch.uint8, device="meta"), torch.empty(n, dtype=torch.int32, device="meta"))
    for call in (moe_fp8_ext.scatter_rows, torch.ops.moe_fp8.scatter_rows):
        for args in ((y, idx), meta):
            with pytest.raises(RuntimeError, match=r"scatter_rows: expected the rows of y in \[0, 2147483647\], got 2147483656"):
                call(*args, 1)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: moe_fp8_ext.pad_token_groups(torch.randn(8, 2), torch.tensor([8], dtype=torch.int32), 12),
         r"pad_token_groups: expected alignment to be a power of two in \[1, 1024\], got 12"),
        (lambda: moe_fp8_ext.pad_token_groups(torch.randn(8, 2), torch.tensor([9], dtype=torch.int32), 16),
         r"pad_token_groups: expected offs\[0\] in \[0, 8\], got 9"),
        (lambda: moe_fp8_ext.pad_token_groups(torch.randn(8, 2), torch.tensor([8], dtype=torch.int64), 16),
         "pad_token_groups: expected offs of dtype int32, got Long"),
        (lambda: moe_fp8_ext.pad_token_groups(torch.randn(8), torch.tensor([8], dtype=torch.int32), 16),
         "pad_token_groups: expected x to be a 2-D tensor, got 1-D"),
        (lambda: moe_fp8_ext.unpad_token_groups(torch.randn(32, 2), torch.tensor([8, 16], dtype=torch.int32),
                                                torch.tensor([0, 4], dtype=torch.int32), 16),
         r"unpad_token_groups: expected padded_starts\[1\] to place group 1"),
        (lambda: moe_fp8_ext.unpad_token_groups(torch.randn(32, 2), torch.tensor([8, 16], dtype=torch.int32),
                                                torch.tensor([0], dtype=torch.int32), 16),
         r"unpad_token_groups: expected padded_starts of shape \(2,\) like offs, got \(1,\)"),
        (lambda: moe_fp8_ext.permute_indices(torch.zeros(6, dtype=torch.int32), 4, 2, 16, 64),
         r"permute_indices: expected tokens_per_expert_group of shape \(8,\)"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise(torch.randn(32, 4), torch.tensor([8, 32], dtype=torch.int32),
                                                     padded_starts=torch.tensor([0, 4], dtype=torch.int32)),
         r"quantize_jagged_colwise: expected padded_starts\[1\] to place group 1"),
    ],
)
def test_errors(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_pad_unpad_permute(device):
    # The ops move bytes, so float64 gradcheck applies directly.
    x = torch.randn(40, 3, dtype=torch.float64, device=device, requires_grad=True)
    offs = torch.tensor([5, 5, 23, 38], dtype=torch.int32, device=device)
    assert torch.autograd.gradcheck(lambda t: moe_fp8_ext.pad_token_groups(t, offs, 8)[0], (x,))
    _, starts, _ = moe_fp8_ext.pad_token_groups(x.detach(), offs, 8)
    xp = torch.randn(moe_fp8_ext.padded_rows(40, 4, 8), 3, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: moe_fp8_ext.unpad_token_groups(t, offs, starts, 40), (xp,))
    counts = torch.tensor([4, 0, 9, 7, 2, 3], dtype=torch.int32, device=device)
    xr = x[:25].detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: moe_fp8_ext.permute_and_pad(t, counts, 3, 2, 8)[0], (xr,))
    y, _, idx = moe_fp8_ext.permute_and_pad(xr.detach(), counts, 3, 2, 8)
    yr = torch.randn_like(y).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: moe_fp8_ext.unpermute(t, idx, 25), (yr,))


def _i32(values, d):
    return torch.tensor(values, dtype=torch.int32, device=d)


# (op name in torch.ops.moe_fp8, device -> args): schema, fake tensor, AOT dispatch of every op, plus edges: no groups,
# alignment 1, bf16/fp16/int32 rows, a strided in-place target, the padded dual. fp8 rows only into dequantize_rows,
# without test_schema (it does arithmetic torch lacks for fp8). test_op_coverage.py reads the names.
OPCHECK_CASES = [
    ("pad_token_groups", lambda d: (torch.randn(50, 8, device=d), _i32([10, 10, 49], d), 16)),
    ("pad_token_groups_at", lambda d: (torch.randn(50, 8, device=d), _i32([10, 10, 49], d), _i32([0, 16, 16], d), 96)),
    ("unpad_token_groups", lambda d: (torch.randn(96, 8, device=d), _i32([10, 10, 49], d), _i32([0, 16, 16], d), 50)),
    ("padded_group_offsets", lambda d: (_i32([10, 10, 49], d), 50, 16)),
    ("permute_indices", lambda d: (_i32([3, 0, 5, 1, 2, 2], d), 3, 2, 16, 64)),
    ("zero_rows_past_groups_", lambda d: (torch.randn(20, 5, device=d), _i32([3, 11], d))),
    ("gather_rows", lambda d: (torch.randn(6, 5, device=d), _i32([2, -1, 0, 5], d))),
    ("scatter_rows", lambda d: (torch.randn(4, 5, device=d), _i32([2, -1, 0, 5], d), 7)),
    ("quantize_jagged_colwise", lambda d: (torch.randn(50, 8, device=d), _i32([10, 10, 49], d),
                                           torch.float8_e4m3fn, True, _i32([0, 16, 16], d), 16)),
    # Added: edge cases and the padded dual quantization.
    ("quantize_jagged_colwise_dual", lambda d: (randn((50, 24), torch.bfloat16, d), randn((50, 8), torch.bfloat16, d),
                                                _i32([10, 10, 49], d), torch.float8_e4m3fn, True, _i32([0, 16, 16], d), 16)),
    ("pad_token_groups", lambda d: (randn((37, 8), torch.bfloat16, d), _i32([], d), 8)),
    ("pad_token_groups", lambda d: (randn((37, 8), torch.bfloat16, d), _i32([0, 5, 5, 30], d), 1)),
    ("padded_group_offsets", lambda d: (_i32([], d), 50, 128)),
    ("unpad_token_groups", lambda d: (randn((96, 8), torch.float16, d), _i32([10, 10, 49], d),
                                      _i32([0, 16, 16], d), 50)),
    ("permute_indices", lambda d: (_i32([3, 0, 5, 1, 2, 2, 0, 0], d), 2, 4, 1, 13)),
    ("zero_rows_past_groups_", lambda d: (randn((20, 9), torch.bfloat16, d)[:, 2:7], _i32([0, 4], d))),
    ("gather_rows", lambda d: (torch.randint(-9, 9, (6, 5), dtype=torch.int32, device=d), _i32([5, 5, -1], d))),
    ("scatter_rows", lambda d: (randn((3, 5), torch.bfloat16, d), _i32([4, -1, 0], d), 5)),
    ("dequantize_rows", lambda d: (torch.randn(6, 256, device=d).to(torch.float8_e4m3fn), torch.rand(6, 2, device=d),
                                   128, torch.bfloat16)),
    ("dequantize_rows", lambda d: (torch.randn(5, 100, device=d).to(torch.float8_e4m3fnuz), torch.rand(5, 1, device=d),
                                   100, torch.float32)),
    ("sum_rows", lambda d: (randn((6, 16), torch.bfloat16, d), _i32([5, 0, -1, 2, 2], d), _i32([2, 2, 5], d))),
    ("sum_rows", lambda d: (torch.randn(3, 5, device=d), _i32([], d), _i32([0, 0], d))),
    ("combine_rows", lambda d: (randn((6, 16), torch.bfloat16, d), torch.rand(6, device=d), _i32([5, 0, -1, 2, 2], d),
                                _i32([2, 2, 5], d))),
    ("combine_rows_backward", lambda d: (randn((3, 24), torch.bfloat16, d), randn((5, 24), torch.bfloat16, d),
                                         torch.rand(5, device=d), _i32([2, -1, 0, 0, 1], d))),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, args", OPCHECK_CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(OPCHECK_CASES)])
def test_opcheck(device, op, args):
    a = args(device)
    utils = ["test_schema", "test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"]
    if any(isinstance(t, torch.Tensor) and t.dtype in (*FP8_DTYPES, torch.float8_e5m2) for t in a):
        utils.remove("test_schema")  # (its mutation check multiplies the inputs: torch has no fp8 mul)
    torch.library.opcheck(getattr(torch.ops.moe_fp8, op).default, a, test_utils=utils)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    def step(x, offs, counts):
        xp, starts, ends = moe_fp8_ext.pad_token_groups(x, offs, 16)
        q, s = moe_fp8_ext.quantize_jagged_colwise(x, offs, torch.float8_e4m3fn, padded_starts=starts, alignment=16)
        back = moe_fp8_ext.unpad_token_groups(xp * 2, offs, starts, x.shape[0])
        y, pends, idx = moe_fp8_ext.permute_and_pad(x, counts, 2, 2, 16)
        return back, q.float() * 1, s, ends, moe_fp8_ext.unpermute(y + 1, idx, x.shape[0]), pends

    x = randn((70, 24), torch.float32, device)
    offs = torch.tensor([7, 7, 40, 66], dtype=torch.int32, device=device)
    counts = torch.tensor([5, 30, 0, 35], dtype=torch.int32, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    for got, want in zip(compiled(x, offs, counts), step(x, offs, counts)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- GPU only: large shapes, garbage offs, no host sync ------------------------------

@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens, d, g", [(16384, 7168, 8), (16384, 2048, 64), (32768, 5120, 300), (20000, 72, 9000)])
def test_pad_unpad_large_same_as_cpu(tokens, d, g):
    # g = 9000: more groups than fit the per-block tables (read from global memory).
    x = randn((tokens, d), torch.bfloat16, "cuda")
    cuts = random_offs(tokens, g, tail=tokens // (g + 1))  # rows past offs[-1] as well
    poison("cuda")
    gpu = moe_fp8_ext.pad_token_groups(x, cuts.cuda(), 16)
    cpu = moe_fp8_ext.pad_token_groups(x.cpu(), cuts, 16)
    for a, b in zip(gpu, cpu):
        assert torch.equal(a.cpu(), b)
    poison("cuda")
    back = moe_fp8_ext.unpad_token_groups(gpu[0], cuts.cuda(), gpu[1], tokens)
    assert torch.equal(back.cpu(), moe_fp8_ext.unpad_token_groups(cpu[0], cuts, cpu[1], tokens))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_jagged_dual_padded_large(fp8_dtype):
    m, g = 16384, 8
    cuts = random_offs(m, g, tail=7)
    starts, _ = moe_fp8_ext.padded_group_offsets(cuts, m, 16)
    same_as_cpu(lambda a, b, o, f, s: moe_fp8_ext.quantize_jagged_colwise_dual(a, b, o, f, padded_starts=s),
                randn((m, 7168), torch.bfloat16, "cuda"), randn((m, 2048), torch.bfloat16, "cuda"), cuts, fp8_dtype, starts)


@requires_cuda
@pytest.mark.gpu
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
    torch.ops.moe_fp8.sum_rows(x, bad, bad)
    torch.ops.moe_fp8.combine_rows(x, torch.rand(512, device="cuda"), bad, bad)
    torch.ops.moe_fp8.combine_rows_backward(x[:6], x[:6], torch.rand(6, device="cuda"), bad)
    moe_fp8_ext.permute_indices(torch.tensor([5, -3, 2**30, 7], dtype=torch.int32, device="cuda"), 2, 2, 16, 100)
    torch.cuda.synchronize()
    assert torch.all(guard == 7)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens, k, width", [(16384, 6, 2048), (8192, 8, 7168), (3000, 3, 1000)])
def test_sum_rows_large_same_as_cpu_and_autograd(tokens, k, width):
    token, order, offs = rows_of_tokens(tokens, tokens * k, k, "cuda", torch.Generator().manual_seed(k))
    g = randn((tokens * k, width), torch.bfloat16, "cuda")
    poison("cuda")
    got = torch.ops.moe_fp8.sum_rows(g, order, offs)
    assert torch.equal(got.cpu(), torch.ops.moe_fp8.sum_rows(g.cpu(), order.cpu(), offs.cpu()))
    assert torch.equal(got, gather_backward(token, g, tokens))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens, k, width", [(16384, 6, 2048), (8192, 8, 7168), (3000, 3, 1000)])
def test_combine_rows_large_same_as_cpu_and_torchtitan(tokens, k, width):
    token, order, offs = rows_of_tokens(tokens, tokens * k, k, "cuda", torch.Generator().manual_seed(k))
    y, g = randn((tokens * k, width), torch.bfloat16, "cuda"), randn((tokens, width), torch.bfloat16, "cuda")
    scores = torch.rand(tokens * k, device="cuda")
    poison("cuda")
    got = torch.ops.moe_fp8.combine_rows(y, scores, order, offs)
    gy, gs = torch.ops.moe_fp8.combine_rows_backward(g, y, scores, token)
    cpu = (y.cpu(), scores.cpu())
    assert torch.equal(got.cpu(), torch.ops.moe_fp8.combine_rows(*cpu, order.cpu(), offs.cpu()))
    for a, b in zip((gy, gs), torch.ops.moe_fp8.combine_rows_backward(g.cpu(), *cpu, token.cpu())):
        assert torch.equal(a.cpu(), b)
    yr, sr = y.detach().requires_grad_(), scores.detach().requires_grad_()
    tt = torchtitan_combine(yr, sr, token, tokens)
    tt.backward(g)
    assert torch.equal(got, tt) and torch.equal(gy, yr.grad)
    assert_dots_close(gs, sr.grad, g, y, token)


@requires_cuda
@pytest.mark.gpu
def test_permute_indices_large():
    counts = torch.randint(0, 600, (8 * 32,), dtype=torch.int32)
    m = int(counts.sum())
    max_len = moe_fp8_ext.padded_rows(m, 32, 128)
    gpu = moe_fp8_ext.permute_indices(counts.cuda(), 32, 8, 128, max_len)
    cpu = moe_fp8_ext.permute_indices(counts, 32, 8, 128, max_len)
    for a, b in zip(gpu, cpu):
        assert torch.equal(a.cpu(), b)


@requires_cuda
@pytest.mark.gpu
def test_token_group_ops_have_no_host_sync():
    x = randn((3000, 200), torch.bfloat16, "cuda").requires_grad_()
    offs = torch.tensor([0, 700, 701, 2500, 2990], dtype=torch.int32, device="cuda")
    counts = torch.tensor([5, 0, 900, 17, 1200, 33, 400, 1], dtype=torch.int32, device="cuda")  # 2 ranks x 4 experts
    gy = randn((3000, 200), torch.bfloat16, "cuda")
    rows = torch.randperm(3000, device="cuda").to(torch.int32)
    ends = torch.tensor([500, 500, 2999], dtype=torch.int32, device="cuda")
    scores, token = torch.rand(3000, device="cuda"), torch.randint(-1, 3, (3000,), dtype=torch.int32, device="cuda")

    def step():
        xp, starts, _ends = moe_fp8_ext.pad_token_groups(x, offs, 16)
        y = moe_fp8_ext.unpad_token_groups(xp * 2, offs, starts, x.shape[0])
        xe, pends, idx = moe_fp8_ext.permute_and_pad(y, counts, 4, 2, 16)
        back = moe_fp8_ext.unpermute(xe, idx, x.shape[0])
        summed = torch.ops.moe_fp8.sum_rows(gy, rows, ends)
        combined = torch.ops.moe_fp8.combine_rows(gy, scores, rows, ends)
        grads = torch.ops.moe_fp8.combine_rows_backward(gy[:3], gy, scores, token)
        return (xp, y, xe, pends, back, summed, combined, *grads, *torch.autograd.grad(back, (x,), gy))

    graph_matches_eager(step)
