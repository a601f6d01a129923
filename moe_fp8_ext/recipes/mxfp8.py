"""The mxfp8 recipe (DESIGN §7): e8m0 scales per 32 elements in the blocked layout the
sm100 GEMM reads, and the pure-torch readers of that layout the emulation uses."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import mxfp8 as _mx
from ..mxfp8 import MX_BLOCK
from .base import (
    FLOAT_DTYPES,
    Recipe,
    _zero_tail,
    check_fields,
    emulated_grouped_mm_2d2d,
    emulated_grouped_mm_2d3d,
    joined_bwd,
    joined_fwd,
    row_groups,
)
from .rowwise import has_scaled_grouped_mm

# The sm100 GEMM reads e8m0 scales in the blocked (128x4-tile swizzled) layout the quantization kernels write. The
# emulation reads those SAME scales back through the inverse index (torch views and gathers, no host sync), so it
# multiplies exactly what the GEMM would read and any layout mismatch fails numerics on every device.


def _ceil_to(x, m):
    return (x + m - 1) // m * m


def unblock_scales(b: Tensor, rows: int, cols: int) -> Tensor:
    """The inverse of the blocked layout (DESIGN §7) as float32: ``b`` holds
    ceil128(rows) * ceil4(cols) scales in blocked order (any shape, contiguous) ->
    (ceil128(rows), ceil4(cols)), padding included. Pure views: element (r, c) sits at
    ((r//128)*(C'/4) + c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4."""
    rp, cp = _ceil_to(rows, 128), _ceil_to(cols, 4)
    t = b.float().reshape(rp // 128, cp // 4, 32, 4, 4)  # [r//128, c//4, r%32, (r%128)//32, c%4]
    return t.permute(0, 3, 2, 1, 4).reshape(rp, cp)


def unblock_scales_m_groups(b: Tensor, offs: Tensor, m: int, cols: int) -> Tensor:
    """float32 (m, cols) scales of the rows of a token-grouped operand from the M-group
    blocked layout (group g's rows from row sum_{j<g} ceil128(n_j) of one blocked
    (b.shape[0], ceil4(cols)) matrix). Rows past offs[-1] read some in-bounds scale."""
    # b: (m + 128 G, ceil4(cols)); every group's 128-row tiles end within it, but the
    # buffer need not be whole tiles: pad it with zeros to whole tiles to view it.
    rows = _ceil_to(b.shape[0], 128)
    flat = F.pad(b.reshape(-1).float(), (0, (rows - b.shape[0]) * b.shape[1]))
    plain = unblock_scales(flat, rows, b.shape[1])
    ends = offs.long()
    starts = F.pad(ends[:-1], (1, 0))
    blocked_starts = F.pad(torch.cumsum(_ceil_to(ends - starts, 128), 0)[:-1], (1, 0))
    g, _ = row_groups(offs, m)
    g = g.long()
    src = blocked_starts[g] + torch.arange(m, device=b.device) - starts[g]
    return plain.index_select(0, src.clamp(0, plain.shape[0] - 1))[:, :cols]


def unblock_scales_k_groups(b: Tensor, offs: Tensor, rows: int, blocks: int) -> Tensor:
    """float32 (rows, blocks) scales of a weight-gradient operand whose token groups (the
    contraction, ends ``offs``, multiples of 32) run along the columns, from the K-group
    layout: group g's (rows, n_g/32) scales are a blocked matrix of their own, stored
    from flat offset ceil128(rows) * sum_{j<g} ceil4(n_j/32). Blocks past offs[-1]: 0."""
    rp = _ceil_to(rows, 128)
    flat = b.reshape(-1)
    ends = offs.long() // MX_BLOCK
    starts = F.pad(ends[:-1], (1, 0))
    width = _ceil_to(ends - starts, 4)  # each group's padded block-columns
    col0 = F.pad(torch.cumsum(width, 0)[:-1], (1, 0))
    t = torch.arange(blocks, device=b.device)
    g = torch.searchsorted(ends, t, right=True)
    inside = g < ends.numel()
    g = g.clamp(max=ends.numel() - 1)
    lb = t - starts[g]  # block within its group
    r = torch.arange(rows, device=b.device)[:, None]
    idx = (rp * col0[g] + ((r // 128) * (width[g] // 4) + lb // 4) * 512
           + (r % 32) * 16 + ((r % 128) // 32) * 4 + lb % 4)
    idx = torch.where(inside, idx, torch.zeros_like(idx)).clamp(0, flat.numel() - 1)
    s = flat.float()[idx.reshape(-1)].reshape(rows, blocks)
    return torch.where(inside, s, torch.zeros_like(s))


def unblock_scales_experts(b: Tensor, rows: int, cols: int) -> Tensor:
    """float32 (E, rows, cols) from the per-expert blocked layout (E, ceil128(rows) * ceil4(cols))."""
    e = b.shape[0]
    rp, cp = _ceil_to(rows, 128), _ceil_to(cols, 4)
    t = b.float().reshape(e, rp // 128, cp // 4, 32, 4, 4).permute(0, 1, 4, 3, 2, 5)
    return t.reshape(e, rp, cp)[:, :rows, :cols]


def _expand_blocks(s: Tensor) -> Tensor:
    """One scale per 32 elements along the last dim -> one per element."""
    return s.repeat_interleave(MX_BLOCK, dim=-1)


def scaled_grouped_mm_mxfp8(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offs: Tensor, out_dtype) -> Tensor:
    """PyTorch's MXFP8 grouped GEMM (sm100 only: callers gate on capability 10.x; on sm90
    torch 2.11 launches its sm100 kernel and the CUDA context dies). Eager:
    ``F.scaled_grouped_mm`` with BlockWise1x32 scales in the SWIZZLE_32_4_4 (blocked)
    layout. Under torch.compile: ``torch._scaled_grouped_mm``, the same kernel (it
    dispatches on e8m0 scales, as torch's own MXFP8 grouped tests call it), because
    torch 2.13's ``_scaled_grouped_mm_v2`` has no fake implementation to trace with."""
    if hasattr(F, "scaled_grouped_mm") and not (torch.compiler.is_compiling() and hasattr(torch, "_scaled_grouped_mm")):
        mx, swz = F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4
        return F.scaled_grouped_mm(a, b, scale_a, mx, scale_b, mx, swizzle_a=swz, swizzle_b=swz, offs=offs,
                                   output_dtype=out_dtype)
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)


@dataclasses.dataclass(frozen=True)
class Mxfp8(Recipe):
    """MXFP8 (OCP microscaling, DESIGN §7): e4m3fn data, one e8m0 scale per 32
    consecutive elements of each contraction, ``rounding`` "rceil" (default; the scale
    rounds up, no block saturates) or "floor" (OCP's rule:
    ``dataclasses.replace(get_recipe("mxfp8"), name="mxfp8_floor", rounding="floor")``).

    Operands, scales always in the blocked layout the sm100 GEMM reads, written by the
    quantization kernels themselves: rowwise in the M-group layout of the groups (so
    ``quantize`` needs them); colwise per token group (K-group layout), straight into the
    padded layout (alignment 32: any group sizes with ``pad_groups=True``, no sync); the
    weights per expert, along K (forward) or N (input gradient).

    GEMM: ``F.scaled_grouped_mm(..., BlockWise1x32, ..., SWIZZLE_32_4_4)``
    (``"mxfp8_gemm"``) on CUDA capability 10.x only, writing bfloat16; everywhere else
    (CPU, sm90, ROCm) ``"emulated"``: the same quantized operands, their blocked scales
    read back through the inverse layout, dequantized, fp32 grouped GEMM. K and N must
    be multiples of 32. Data is always float8_e4m3fn.
    """

    name: str = "mxfp8"
    alignment: int = 32
    rounding: str = "rceil"

    def __post_init__(self):
        check_fields(self, choices={"rounding": _mx.ROUNDINGS})

    def backend(self, device):
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available() or torch.version.hip:
            return "emulated"
        major, _ = torch.cuda.get_device_capability(device)
        # Capability 10.x ONLY: torch's MXFP8 grouped GEMM is an sm100 kernel, and on
        # sm90 torch 2.11 launches it anyway (the CUDA context dies).
        return "mxfp8_gemm" if major == 10 and has_scaled_grouped_mm() else "emulated"

    def out_dtypes(self, backend, in_dtype):
        return (torch.bfloat16,) if backend == "mxfp8_gemm" else FLOAT_DTYPES

    def fp8_dtypes(self, backend, device):
        return (torch.float8_e4m3fn,)

    def default_fp8_dtype(self, device):
        return torch.float8_e4m3fn

    def check_inputs(self, A, B_t):
        k, n = B_t.shape[1], B_t.shape[2]
        if k % MX_BLOCK or n % MX_BLOCK:
            raise ValueError(f"grouped_mm: expected K and N to be multiples of {MX_BLOCK} for recipe {self.name!r} "
                             f"(MXFP8 blocks of {MX_BLOCK} along each contraction: K forward, N for grad_A), "
                             f"got K={k}, N={n}")

    def pads_token_groups(self, backend):
        # torch's MXFP8 grouped GEMM is only tested (by torch and torchao) with M groups
        # that are multiples of 32: pad them on the real GEMM. The emulation takes any.
        return backend == "mxfp8_gemm"

    def quantize(self, x, fp8_dtype, groups=None, *, rowwise=True, colwise=False):
        # rowwise: the M-group blocked scale layout of the groups; colwise: per token group (K-group layout)
        if groups is None:
            raise ValueError(f"{self.name}: expected the token groups of x (its scales' blocked layout follows them)")
        offs, starts = groups
        row = _mx.quantize_mxfp8_rowwise(x, self.rounding, blocked=True, offs=offs) if rowwise else None
        col = None
        if colwise is True:  # (SAME_READ: none, two kernels)
            col = _mx.quantize_mxfp8_colwise(x, self.rounding, True, offs, padded_starts=starts,
                                             alignment=None if starts is None else self.alignment)  # (Mp, D) col-major
        return row, col

    def quantize_weights(self, b_ts, fp8_dtype, *, fwd=True, bwd=False):
        f = _mx.quantize_mxfp8_experts(joined_fwd(b_ts), self.rounding, blocked=True) if fwd else None  # (E, K, N)
        b = (_mx.quantize_mxfp8_experts(joined_bwd(b_ts).transpose(-2, -1), self.rounding, blocked=True)
             if bwd is True else None)  # (E, N, K)
        return f, b

    def mm_2d3d(self, lhs, rhs, offs, out_dtype, backend):
        (qa, sa), (qb, sb) = lhs, rhs  # (M, Kc) row-major, M-group blocked; (E, Kc, Nout) column-major, per expert
        if backend == "mxfp8_gemm":
            return _zero_tail(scaled_grouped_mm_mxfp8(qa, qb, sa, sb, offs, out_dtype), offs)
        m, kc = qa.shape
        nout = qb.shape[2]
        sa_plain = unblock_scales_m_groups(sa, offs, m, kc // MX_BLOCK)  # (M, Kc/32)
        sb_plain = unblock_scales_experts(sb, nout, kc // MX_BLOCK)  # (E, Nout, Kc/32)
        a = qa.float() * _expand_blocks(sa_plain)
        b = qb.float() * _expand_blocks(sb_plain).transpose(-2, -1)
        return _zero_tail(emulated_grouped_mm_2d3d(a, b, offs).to(out_dtype), offs)

    def mm_2d2d(self, grad, a, offs, out_dtype, backend):
        (qg, sg), (qa, sa) = grad, a  # (Mp, N), (Mp, K) column-major; K-group blocked scales
        qg_t = qg.t()
        if backend == "mxfp8_gemm":
            return scaled_grouped_mm_mxfp8(qg_t, qa, sg, sa, offs, out_dtype)
        n, mp = qg_t.shape
        k = qa.shape[1]
        sg_plain = unblock_scales_k_groups(sg, offs, n, mp // MX_BLOCK)  # (N, Mp/32)
        sa_plain = unblock_scales_k_groups(sa, offs, k, mp // MX_BLOCK)  # (K, Mp/32)
        g_t = qg_t.float() * _expand_blocks(sg_plain)
        a_ = qa.float() * _expand_blocks(sa_plain).t()
        return emulated_grouped_mm_2d2d(g_t, a_, offs).to(out_dtype)
