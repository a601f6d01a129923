"""Run under compute-sanitizer's racecheck and synccheck tools: every kernel family
that stages data in shared memory or synchronizes its threads, once each on small odd
shapes with valid token groups (scripts/gpu_ci.sh runs it; memcheck over garbage input
is scripts/sanitize_offs.py). Small shapes keep the tools' slowdown affordable; odd
sizes reach the partial tiles and blocks."""

import os
import sys

import torch

import moe_fp8_ext as m

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from workloads import balanced_offs  # noqa: E402

F8, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
dev = "cuda"
x = torch.randn(1037, 264, device=dev, dtype=torch.bfloat16)
y = torch.randn(1037, 72, device=dev, dtype=torch.bfloat16)
offs = torch.tensor([100, 100, 613, 1030], dtype=torch.int32, device=dev)  # an empty group, rows past the last
w = torch.randn(3, 272, 144, device=dev, dtype=torch.bfloat16)

# FP8 rowwise: rows, cols (whole-set, clusters), the weight dual, the jagged dual.
m.quantize_rowwise(x, F8)
m.quantize_jagged_colwise(x, offs, F8)
m.quantize_jagged_colwise_dual(x, y, offs, FNUZ)
starts, _ = m.padded_group_offsets(offs, x.shape[0], 16)
m.quantize_jagged_colwise(x, offs, F8, padded_starts=starts, alignment=16)
m.quantize_experts_fwd(w, F8)
m.quantize_experts_bwd(w, F8)
m.quantize_experts_dual_cat([w, w], F8)
m.quantize_rowwise_jagged_dual(x, offs, F8, True, starts, 16)

# FP8 blockwise: the five layouts, the weight dual (2-D and 3-D), the activation dual.
s128, _ = m.padded_group_offsets(offs, x.shape[0], 128)
for f in (F8, FNUZ):
    m.quantize_blockwise_act_lhs(x, f)
    m.quantize_blockwise_act_rhs(x, f)
    m.quantize_blockwise_act_transposed_lhs(x, f, offs, s128, 128)
    m.quantize_blockwise_weight_dual(w, f)
    m.quantize_blockwise_weight_dual(w[0], f)
    m.quantize_blockwise_act_dual(x, f, offs, s128, 128)

# MXFP8: rowwise (plain, blocked, M groups), colwise (padded, K-group blocked), experts,
# and the scale swizzles with their inverses.
xm = x[:, :256]  # K a multiple of 32
x32 = xm[:1024]
o32 = torch.tensor([96, 96, 512, 1024], dtype=torch.int32, device=dev)
for rounding in ("rceil", "floor"):
    m.quantize_mxfp8_rowwise(xm, rounding)
    m.quantize_mxfp8_rowwise(xm, rounding, blocked=True)
    m.quantize_mxfp8_rowwise(xm, rounding, blocked=True, offs=offs)
    s32, _ = m.padded_group_offsets(offs, x.shape[0], 32)
    m.quantize_mxfp8_colwise(xm, rounding, blocked=True, offs=offs, padded_starts=s32, alignment=32)
    m.quantize_mxfp8_colwise(x32, rounding, blocked=True, offs=o32)
    m.quantize_mxfp8_experts(w[:, :256], rounding, blocked=True)
_, s = m.quantize_mxfp8_rowwise(xm, "rceil")
b = m.to_blocked_scales(s)
m.from_blocked_scales(b, *s.shape)
m.to_blocked_scales(s.view(1, *s.shape).expand(3, -1, -1).contiguous())
bm = m.to_blocked_scales_m_groups(s, offs)
m.from_blocked_scales_m_groups(bm, offs, s.shape[1])
_, sc = m.quantize_mxfp8_colwise(x32, "rceil", offs=o32)
bk = m.to_blocked_scales_k_groups(sc, o32)
m.from_blocked_scales_k_groups(bk, o32, *sc.shape)

# SwiGLU (fused quantizations), token groups (scans, the permutation).
h13 = torch.randn(1037, 2 * 136, device=dev, dtype=torch.bfloat16)
gh = torch.randn(1037, 136, device=dev, dtype=torch.bfloat16)
m.swiglu_quantize_rowwise(h13, F8)
m.swiglu_backward_quantize_rowwise(gh, h13, F8)
xp, ps, pe = m.pad_token_groups(x, offs, 16)
m.unpad_token_groups(xp, offs, ps, x.shape[0])
big = torch.sort(torch.randint(0, 1037, (3000,), dtype=torch.int32)).values.to(dev)  # the global-table path
m.pad_token_groups(y, big, 32)
m.permute_indices(torch.randint(0, 50, (4 * 6,), dtype=torch.int32, device=dev), 6, 4, 16, 2048)

# The GEMMs' problem-table kernels (the blockwise GEMM on sm90 builds).
g = balanced_offs(512, 4, device=dev)
for recipe in ("fp8_rowwise", "fp8_blockwise"):
    a = torch.randn(512, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    bt = torch.randn(4, 256, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    m.grouped_mm(a, bt, g, recipe=recipe).sum().backward()
# Every configuration of the blockwise GEMMs (tile, cluster; the recipe above takes the
# 128x128 ones at this size): partial tiles, an empty group.
from moe_fp8_ext import blockwise_gemm as bg  # noqa: E402

if bg.available():
    g = torch.tensor([300, 300, 700], dtype=torch.int32, device=dev)
    qa, sa = m.quantize_blockwise_act_lhs(torch.randn(700, 256, device=dev, dtype=torch.bfloat16), F8)
    qb, sb = m.quantize_blockwise_weight_rhs(torch.randn(3, 256, 384, device=dev, dtype=torch.bfloat16), F8)
    g128 = torch.tensor([256, 256, 640], dtype=torch.int32, device=dev)
    qg, sg = m.quantize_blockwise_act_transposed_lhs(torch.randn(640, 384, device=dev, dtype=torch.bfloat16), F8, g128)
    qx, sx = m.quantize_blockwise_act_rhs(torch.randn(640, 264, device=dev, dtype=torch.bfloat16), F8, g128)
    for config in range(bg.CONFIGS_2D3D):
        bg.blockwise_grouped_mm_2d3d(qa, sa, qb, sb, g, config=config)
    for config in range(bg.CONFIGS_2D2D):
        bg.blockwise_grouped_mm_2d2d(qg, sg, qx, sx, g128, config=config)
    # The W13 GEMM with the SwiGLU epilogue: both clusters (hidden 128: one 256-column tile, 256: two).
    for hidden in (128, 256):
        qw, sw = m.quantize_blockwise_weight_rhs(torch.randn(3, 256, 2 * hidden, device=dev, dtype=torch.bfloat16), F8)
        ps, _ = m.padded_group_offsets(g, 700, 128)
        bg.blockwise_grouped_mm_swiglu(qa, sa, qw, sw, g, ps)
    # The W2 dgrad GEMM with the dSwiGLU epilogue: both clusters (hidden 128: 2x1, 256: 1x2).
    for hidden in (128, 256):
        qw, sw = m.quantize_blockwise_weight_rhs(torch.randn(3, 256, hidden, device=dev, dtype=torch.bfloat16), F8)
        h13 = torch.randn(700, 2 * hidden, device=dev, dtype=torch.bfloat16)
        bg.blockwise_grouped_mm_dswiglu(qa, sa, qw, sw, g, h13, m.padded_group_offsets(g, 700, 128)[0])
torch.cuda.synchronize()
print("sanitize_smem: done")
