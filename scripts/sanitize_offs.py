"""Run under compute-sanitizer: every op with garbage offs and odd shapes, so that
memcheck sees any out-of-bounds access (scripts/gpu_ci.sh runs it); then the GPU rows
of the input-contract table (tests/test_input_contract.py): every bad-input class,
device mixes included."""

import collections
import os
import sys

import torch

import moe_fp8_ext

F8 = torch.float8_e4m3fn
x = torch.randn(4099, 77, device="cuda", dtype=torch.bfloat16)
y = torch.randn(4099, 64, device="cuda", dtype=torch.bfloat16)
for offs in ([700, -5, 100, 2**31 - 1, 30, -2**31], [4099 * 3] * 3, [-1] * 5, [5000, 4098, 4099, 0]):
    o = torch.tensor(offs, dtype=torch.int32, device="cuda")
    moe_fp8_ext.quantize_jagged_colwise(x, o, F8)
    moe_fp8_ext.quantize_jagged_colwise_dual(x, y, o, torch.float8_e4m3fnuz)
moe_fp8_ext.quantize_rowwise(x, F8)
moe_fp8_ext.quantize_rowwise(x.t(), F8)
w = torch.randn(3, 1000, 33, device="cuda", dtype=torch.bfloat16)
moe_fp8_ext.quantize_experts_fwd(w, F8)
moe_fp8_ext.quantize_experts_bwd(w, F8)
moe_fp8_ext.quantize_experts_fwd(w.transpose(1, 2).contiguous().transpose(1, 2), F8)
# Token groups: garbage offs, padded starts and indices, every copy width.
for offs in ([700, -5, 100, 2**31 - 1, 30, -2**31], [4099 * 3] * 3, [5000, 4098, 4099, 0]):
    o = torch.tensor(offs, dtype=torch.int32, device="cuda")
    for t in (x, x.view(torch.uint8)[:, :77], torch.randn(4099, 3, device="cuda")):
        xp, starts, ends = moe_fp8_ext.pad_token_groups(t, o, 16)
        moe_fp8_ext.unpad_token_groups(xp, o, o, 4099)
        torch.ops.moe_fp8.pad_token_groups_at(t, o, o, 333)
        moe_fp8_ext.gather_rows(t, o)
        moe_fp8_ext.scatter_rows(t[: o.numel()], o, 4099)
    moe_fp8_ext.quantize_jagged_colwise_dual(x, y, o, F8, padded_starts=o, alignment=16)
    moe_fp8_ext.quantize_jagged_colwise(x, o, F8, padded_starts=o.flip(0), alignment=128)
    moe_fp8_ext.zero_rows_past_groups_(x, o)
    moe_fp8_ext.zero_rows_past_groups_(x.view(torch.uint8)[:, 1:78], o)
# Rowwise + per-group colwise of token groups (the two ops): garbage offs and padded starts.
for offs in ([700, -5, 100, 2**31 - 1, 30, -2**31], [4099 * 3] * 3, [-1] * 5, [5000, 4098, 4099, 0]):
    o = torch.tensor(offs, dtype=torch.int32, device="cuda")
    ps, _ = moe_fp8_ext.padded_group_offsets(o, 4099, 16)
    for p in (ps, o, o.flip(0)):
        moe_fp8_ext.quantize_rowwise_jagged_dual(y, o, F8, True, p, 16)
    moe_fp8_ext.quantize_rowwise_jagged_dual(y[:, :40], o, F8, True, o, 128)
big = torch.sort(torch.randint(0, 4100, (6000,), dtype=torch.int32)).values.cuda()  # global-table path
moe_fp8_ext.pad_token_groups(x, big, 32)
moe_fp8_ext.permute_indices(torch.tensor([5, -3, 2**30, 7, 0, 9], dtype=torch.int32, device="cuda"), 3, 2, 16, 100)
# G = 0 (an empty offs: a null data pointer, a layout with no groups) and padded
# starts that overlap or run past the rows (clamped on the GPU).
e = torch.zeros(0, dtype=torch.int32, device="cuda")
xp, s0, _ = moe_fp8_ext.pad_token_groups(x, e, 16)
moe_fp8_ext.unpad_token_groups(xp, e, s0, 4099)
moe_fp8_ext.padded_group_offsets(e, 4099, 16)
moe_fp8_ext.zero_rows_past_groups_(x.clone(), e)
o = torch.tensor([100, 200, 300], dtype=torch.int32, device="cuda")
for ps in ([0, 3, 2**31 - 1], [-16, 5000, 0], [16, 0, 4]):
    p = torch.tensor(ps, dtype=torch.int32, device="cuda")
    moe_fp8_ext.unpad_token_groups(xp, o, p, 4099)
    torch.ops.moe_fp8.pad_token_groups_at(x, o, p, 333)
# MXFP8 and blockwise quantization, and the scale swizzles: garbage offs (the kernels
# clamp them), partial tiles, an M-group blocked layout whose static tail ends inside a
# tile row, and strided inputs (the memset + scalar paths).
refused, launched = collections.Counter(), collections.Counter()


def attempt(fn, *args, **kwargs):
    """A call whose clear refusal (a checked bad argument) is fine here: memcheck
    watches the ones that launch (every op must launch at least once: checked below)."""
    try:
        out = fn(*args, **kwargs)
    except (RuntimeError, ValueError) as e:
        refused[fn.__name__] += 1
        if "CUDA" in str(e) or "illegal" in str(e):
            raise
        return None
    launched[fn.__name__] += 1
    return out


xm = torch.randn(1000, 96, device="cuda", dtype=torch.bfloat16)
for offs in ([700, -5, 100, 2**31 - 1, 30, -2**31], [1000 * 3] * 3, [-1] * 5, [960, 32, 1000, 0], [7]):
    o = torch.tensor(offs, dtype=torch.int32, device="cuda")
    po = o.clamp(min=0)
    for t in (xm, xm.t().contiguous().t(), xm.float()[:, :64]):
        attempt(moe_fp8_ext.quantize_mxfp8_rowwise, t, "rceil", True, o)
        attempt(moe_fp8_ext.quantize_mxfp8_colwise, t, "floor", True, o, padded_starts=po, alignment=32)
        attempt(moe_fp8_ext.quantize_mxfp8_colwise, t[:992], "rceil", True, o)  # the kernel sums the starts
        attempt(moe_fp8_ext.quantize_blockwise_act_rhs, t, F8, o, po, 128)
        attempt(moe_fp8_ext.quantize_blockwise_act_transposed_lhs, t, F8, o, po, 128)
        # (the one-read kernel for xm: garbage starts, clamped, negative, decreasing)
        attempt(moe_fp8_ext.quantize_blockwise_act_dual, t, F8, o, po, 128)
        attempt(moe_fp8_ext.quantize_blockwise_act_dual, t, F8, o, o.flip(0), 256)
    s = moe_fp8_ext.quantize_mxfp8_rowwise(xm)[1]
    bm = attempt(moe_fp8_ext.to_blocked_scales_m_groups, s, o)
    bk = attempt(moe_fp8_ext.to_blocked_scales_k_groups, s, o)
    if bm is not None:
        attempt(moe_fp8_ext.from_blocked_scales_m_groups, bm, o, 3)
    if bk is not None:
        attempt(moe_fp8_ext.from_blocked_scales_k_groups, bk, o, 1000, 3)
# valid offs and padded starts too (launched on any device, not only where content goes unchecked)
o = torch.tensor([96, 96, 500, 1000], dtype=torch.int32, device="cuda")
po, _ = moe_fp8_ext.padded_group_offsets(o, 1000, 128)
for t in (xm, xm.t().contiguous().t()):
    attempt(moe_fp8_ext.quantize_blockwise_act_rhs, t, F8, o, po, 128)
    attempt(moe_fp8_ext.quantize_blockwise_act_transposed_lhs, t, F8, o, po, 128)
    attempt(moe_fp8_ext.quantize_blockwise_act_dual, t, F8, o, po, 128)
for t in (xm, xm[:, 32:], xm.t().contiguous().t()):
    attempt(moe_fp8_ext.quantize_mxfp8_rowwise, t, "rceil", True)
    attempt(moe_fp8_ext.quantize_mxfp8_colwise, t[:992], "rceil", True)
    attempt(moe_fp8_ext.quantize_blockwise_act_lhs, t, torch.float8_e4m3fnuz)
attempt(moe_fp8_ext.quantize_mxfp8_experts, torch.randn(3, 64, 130, device="cuda"), "rceil", True)
attempt(moe_fp8_ext.quantize_mxfp8_experts, torch.randn(3, 130, 64, device="cuda").transpose(1, 2), "rceil", True)
attempt(moe_fp8_ext.quantize_mxfp8_experts, torch.randn(3, 256, 64, device="cuda").transpose(1, 2), "rceil", True)  # one blocked matrix
attempt(moe_fp8_ext.to_blocked_scales, torch.ones(3, 130, 5, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu))
# The blockwise weight ops: partial 128x128 tiles, odd strides, 2-D and 3-D, both fp8 formats.
for wt in (x, x.t(), torch.randn(3, 1000, 33, device="cuda", dtype=torch.bfloat16),
           torch.randn(3, 33, 1000, device="cuda").transpose(1, 2), torch.randn(2, 130, 258, device="cuda")[:, 1:, 2:]):
    for f8 in (F8, torch.float8_e4m3fnuz):
        attempt(moe_fp8_ext.quantize_blockwise_weight_rhs, wt, f8)
        attempt(moe_fp8_ext.quantize_blockwise_weight_transposed_rhs, wt, f8)
        attempt(moe_fp8_ext.quantize_blockwise_weight_dual, wt, f8)
# The blockwise grouped GEMMs (sm90 only): their per-group problem table is built on the
# device from the same garbage offs (clamped; a wgrad group not starting at a multiple of
# 128 is treated as empty).
from moe_fp8_ext import blockwise_gemm  # noqa: E402

if blockwise_gemm.available():
    e4 = torch.float8_e4m3fn
    xa, sa = moe_fp8_ext.quantize_blockwise_act_lhs(xm[:, :96].contiguous(), e4)
    for offs in ([700, -5, 100, 2**31 - 1, 30, -2**31], [1000 * 3] * 3, [-1] * 5, [960, 32, 1000, 0, 7, 128]):
        o = torch.tensor(offs, dtype=torch.int32, device="cuda")
        w = torch.randn(o.numel(), 96, 64, device="cuda", dtype=torch.bfloat16)
        qb, sb = moe_fp8_ext.quantize_blockwise_weight_rhs(w, e4)
        g = torch.randn(1024, 64, device="cuda", dtype=torch.bfloat16)
        qg, sg = moe_fp8_ext.quantize_blockwise_act_transposed_lhs(g, e4)
        qx, sx = moe_fp8_ext.quantize_blockwise_act_rhs(torch.randn(1024, 96, device="cuda", dtype=torch.bfloat16), e4)
        for config in range(-1, blockwise_gemm.CONFIGS_2D2D):  # every tile configuration
            if config < blockwise_gemm.CONFIGS_2D3D:
                attempt(blockwise_gemm.blockwise_grouped_mm_2d3d, xa, sa, qb, sb, o, torch.bfloat16, config)
            attempt(blockwise_gemm.blockwise_grouped_mm_2d2d, qg, sg, qx, sx, o, torch.bfloat16, config)
        for config in range(-1, blockwise_gemm.CONFIGS_2D2D_ADD):  # the wgrad added into fp32 (in place)
            attempt(blockwise_gemm.blockwise_grouped_mm_2d2d_add_, torch.zeros(o.numel(), 64, 96, device="cuda"), qg,
                    sg, qx, sx, o, config)
        # The SwiGLU GEMM: garbage offs and padded starts alike (clamped; a token block the layout cannot hold is
        # not written).
        qw, sw = moe_fp8_ext.quantize_blockwise_weight_rhs(
            torch.randn(o.numel(), 96, 256, device="cuda", dtype=torch.bfloat16), e4)
        for starts in (o, torch.full_like(o, 2**31 - 1), -o):
            attempt(blockwise_gemm.blockwise_grouped_mm_swiglu, xa, sa, qw, sw, o, starts)
        # The dSwiGLU GEMM (W2's dgrad, hidden 128), the same.
        h13 = torch.randn(xa.shape[0], 256, device="cuda", dtype=torch.bfloat16)
        for starts in (o, torch.full_like(o, 2**31 - 1), -o):
            attempt(blockwise_gemm.blockwise_grouped_mm_dswiglu, xa, sa, qw[:, :, :128], sw[:, :, :1], o, h13, starts)
# Our rowwise grouped GEMMs (sm90 only), the same garbage offs: clamped groups; a wgrad
# group not starting at a multiple of 16 is treated as empty.
from moe_fp8_ext import rowwise_gemm  # noqa: E402

if rowwise_gemm.available():
    e4 = torch.float8_e4m3fn
    qa = torch.randn(1024, 96, device="cuda").to(e4)
    for offs in ([700, -5, 100, 2**31 - 1, 30, -2**31], [1000 * 3] * 3, [-1] * 5, [960, 32, 1000, 0, 7, 128]):
        o = torch.tensor(offs, dtype=torch.int32, device="cuda")
        e = o.numel()
        qb = torch.randn(e, 64, 96, device="cuda").to(e4).transpose(1, 2)
        sa, sb = torch.rand(1024, device="cuda"), torch.rand(e, 64, device="cuda")
        for config in (-1, 0, 3, 5):
            attempt(rowwise_gemm.rowwise_grouped_mm_2d3d, qa, sa, qb, sb, o, torch.bfloat16, config)
            attempt(rowwise_gemm.rowwise_grouped_mm_2d2d, torch.randn(64, 1024, device="cuda").to(e4), sb,
                    qa.t().contiguous().t(), torch.rand(e, 96, device="cuda"), o, torch.bfloat16, config)
        attempt(rowwise_gemm.rowwise_grouped_mm_2d2d_add_, torch.zeros(e, 64, 96, device="cuda"),
                torch.randn(64, 1024, device="cuda").to(e4), sb, qa.t().contiguous().t(),
                torch.rand(e, 96, device="cuda"), o)  # (the wgrad added into fp32, in place)
print("sanitize_offs: MXFP8/blockwise/swizzle/GEMM calls refused with a clear error:", dict(refused))
print("sanitize_offs: calls that launched:", dict(launched))
never = sorted(set(refused) - set(launched))
if never:  # an op every call of which was refused was never watched by memcheck
    sys.exit(f"sanitize_offs: no call of {never} launched: fix the calls above")
torch.cuda.synchronize()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_input_contract as contract  # noqa: E402

counts = collections.Counter()
for param in contract._params("cuda"):
    case, mut, device = param.values
    outcome, detail = contract.classify(case, mut, device)
    counts[outcome] += 1
    if outcome not in ("clear", "correct", "clamped"):
        print(f"sanitize_offs: {outcome} {case.id}: {mut.label}: {detail}")
torch.cuda.synchronize()
print("sanitize_offs: contract table on cuda:", dict(counts))
print("sanitize_offs: done")
