"""Differentiable grouped GEMM for MoE experts: a drop-in for
``torch._grouped_mm(A, B_t, offs=offs)`` that trains in FP8 (DESIGN §5).

    out = grouped_mm(A, B_t, offs)                      # recipe="fp8_rowwise"
    out = grouped_mm(A, B_t, offs, recipe="bf16")       # the torch._grouped_mm baseline

ONE autograd Function, driven by a :class:`~moe_fp8_ext.recipes.Recipe` (see
``recipes/base.py`` for the contract): one ``quantize`` call per tensor asks the
recipe for the orientations it needs, the recipe's GEMMs multiply them; this file wires
the three products, validates the arguments and lays the weight gradient out for the
recipe's alignment.
A new recipe is a Recipe subclass (``moe_fp8_ext.recipes``); nothing here changes.

fp8_rowwise: every operand is quantized with this package's kernels and multiplied by
its CUTLASS grouped GEMMs on Hopper (PyTorch's FP8 grouped GEMM elsewhere, or with
``Fp8Rowwise(gemm_kernel="torch")``)::

    forward  out    = A_q(rows) @ B_t_q(cols over K)
    dgrad    grad_A = grad_out_q(rows) @ B_q(cols over N)
    wgrad    grad_B = grad_out_q(cols per group)^T @ A_q(cols per group)

With a recipe whose ``hold_weight_operands`` is True, where one read makes both operands
of the weight (``bwd=SAME_READ``: fp8_rowwise's dual kernel where two experts' matrices
fit the extension's L2 budget, docs/TUNING.md; fp8_blockwise always), the forward makes
B's dgrad operand with B_t's and holds it (E·N·K fp8 bytes and its scales) until the
dgrad GEMM has used it (saved under torch.compile); not under saved-tensor hooks (see
``_may_free_early``). By default nothing derived from the weight lives from a forward to
its backward: a deep model would hold one such operand per layer (docs/decisions/050).

Where the FP8 grouped GEMM is not available (a CPU, a GPU before sm90) the same
quantized operands are dequantized and multiplied in fp32 ("emulated"), so results and
gradients are the same math; :func:`grouped_mm_backend` says which path runs. The fp8
recipe never silently falls back to bf16 math.

Token groups of any size work without a host sync (``pad_groups=True``, the default;
DESIGN §8). The only FP8 GEMM that needs aligned groups is the weight gradient, whose
contraction runs over the tokens of a group (16-byte aligned pieces of K); its
operands are quantized straight into the padded layout (group starts rounded up to
the recipe's alignment, 16 rows for fp8_rowwise, zero rows between), so no padded copy
is ever written. The forward and the input gradient group the M rows of a 2-D x 3-D
GEMM, which PyTorch's CUDA grouped GEMMs take at any size (their per-group pointers
only need 16-byte aligned rows, i.e. K % 16 == 0: see
aten/src/ATen/native/cuda/GroupMMCommon.cuh), so they run unpadded. On ROCm, where
that is not established, the input is padded and the output unpadded around the
aligned path instead (``Recipe.pads_token_groups``). With ``pad_groups=False`` every
group size must be a multiple of the alignment; set ``MOE_FP8_DEBUG=1`` to check them
(that syncs). No op here syncs with the host otherwise, and the whole function works
under ``torch.compile(fullgraph=True)``.
"""

from typing import Optional, Union

import torch
from torch import Tensor

from . import token_groups
from .ops import content_checked, debug_checks as _debug
from .recipes import FLOAT_DTYPES, SAME_READ, Recipe, get_recipe

_ops = torch.ops.moe_fp8


def grouped_mm_backend(device: torch.device, recipe: Union[str, Recipe] = "fp8_rowwise") -> str:
    """Which GEMM path ``recipe`` runs on ``device``: ``"emulated"`` (dequantize + fp32
    GEMM) where no FP8 grouped GEMM runs, else fp8_rowwise ``"fp8_gemm"`` (CUDA sm90+ or
    ROCm; ours on sm90 where ``rowwise_gemm.in_use``, else PyTorch's), fp8_blockwise
    ``"blockwise_gemm"`` (ours, sm90), mxfp8 ``"mxfp8_gemm"`` (PyTorch's, sm100); bf16
    ``"grouped_mm"``."""
    return get_recipe(recipe, "grouped_mm_backend").backend(torch.device(device))


def _gemm_out_dtype(recipe: Recipe, backend: str, want: torch.dtype, in_dtype: torch.dtype) -> torch.dtype:
    """``want`` if the recipe's GEMM writes it, else the first dtype it writes (a
    gradient in a dtype the GEMM cannot write, e.g. the fp32 grad_A of fp32 master
    activations on the fp8 GEMM, is that result cast)."""
    supported = recipe.out_dtypes(backend, in_dtype)
    return want if want in supported else supported[0]


def _may_free_early() -> bool:
    """Whether a forward may keep an intermediate outside ``save_for_backward`` so that
    the backward can free it half way (autograd's docs allow intermediates on ctx): the
    experts layer's h13, a weight's backward operand made in the forward. Not under
    torch.compile, and not while saved-tensor hooks are active (activation
    checkpointing, offloading: they must see every saved tensor)."""
    return not torch.compiler.is_compiling() and not saved_tensor_hooks_on()


def saved_tensor_hooks_on() -> bool:
    """Whether saved-tensor hooks are active (activation checkpointing, offloading); True
    on a torch that cannot tell (every torch the package supports can)."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except (AttributeError, TypeError, RuntimeError):  # a torch without the query
        return True


def pack(named: dict):
    """Named operands (a tensor, a tuple of tensors, or None) as ``(tensors, layout)`` for
    ``ctx.save_for_backward``; :func:`unpack` gives the dict back (None: absent)."""
    tensors, layout = [], []
    for name, op in named.items():
        if op is not None:
            ts = (op,) if isinstance(op, Tensor) else tuple(op)
            layout.append((name, len(ts), isinstance(op, Tensor)))
            tensors += ts
    return tensors, tuple(layout)


def unpack(tensors, layout) -> dict:
    out, i = {}, 0
    for name, n, is_tensor in layout:
        out[name] = tensors[i] if is_tensor else tuple(tensors[i:i + n])
        i += n
    return out


def colwise_pair(recipe: Recipe, a: Tensor, b: Tensor, fp8_dtype, groups, a_col=None, b_col=None):
    """The colwise operands of a weight gradient's two tensors, each made unless given:
    together (``Recipe.quantize_colwise_pair``) where neither is."""
    if a_col is None and b_col is None:
        return recipe.quantize_colwise_pair(a, b, fp8_dtype, groups)
    a_col = a_col if a_col is not None else recipe.quantize(a, fp8_dtype, groups, rowwise=False, colwise=True)[1]
    b_col = b_col if b_col is not None else recipe.quantize(b, fp8_dtype, groups, rowwise=False, colwise=True)[1]
    return a_col, b_col


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, B_t, offs, recipe, out_dtype, fp8_dtype, backend, pad_wgrad, grad_mode):
        # grad_mode: torch.is_grad_enabled() at the call (the forward itself runs without
        # grad, and needs_input_grad is set under no_grad too): nothing is made for a
        # backward that cannot run.
        ctx.recipe, ctx.fp8_dtype, ctx.backend = recipe, fp8_dtype, backend
        ctx.a_dtype, ctx.b_dtype = A.dtype, B_t.dtype
        ctx.a_shape, ctx.b_shape = A.shape, B_t.shape
        ctx.no_groups = offs.shape[0] == 0
        if ctx.no_groups:  # every row is past offs[-1] (static: no sync)
            return A.new_zeros((A.shape[0], B_t.shape[2]), dtype=out_dtype)
        dgrad = grad_mode and ctx.needs_input_grad[0]  # grad_A reads the weight
        wgrad = grad_mode and ctx.needs_input_grad[1]  # grad_B reads A
        # Where the weight gradient takes the padded layout, A's colwise operand is made with
        # its rowwise one and kept instead of A (fp8 saved activations, DESIGN §10).
        starts = wgrad_offs = None
        if pad_wgrad and wgrad:
            starts, wgrad_offs = _ops.padded_group_offsets(offs, A.shape[0], recipe.alignment)
        lhs, a_col = recipe.quantize(A, fp8_dtype, (offs, starts), colwise=pad_wgrad and wgrad)
        # The weight's input-gradient operand where the read that makes the forward one makes it
        # (hold_weight_operands): held on ctx until the dgrad GEMM has used it, or saved under
        # torch.compile; not under saved-tensor hooks (the backward quantizes it again).
        free_early = _may_free_early()
        hold = dgrad and recipe.hold_weight_operands and (free_early or torch.compiler.is_compiling())
        rhs, bwd = recipe.quantize_weights([B_t], fp8_dtype, bwd=SAME_READ if hold else False)
        ctx.bwd_box = [bwd] if bwd is not None and free_early else None
        # Each input kept only for the gradient that reads it: B_t for grad_A unless its operand
        # is saved (a held one is gone after one backward), A for grad_B unless a_col is kept.
        saved_bwd = bwd if ctx.bwd_box is None else None
        tensors, ctx.layout = pack({
            "offs": offs, "A": A if wgrad and a_col is None else None,
            "B_t": B_t if dgrad and saved_bwd is None else None,
            "starts": starts, "wgrad_offs": wgrad_offs, "a_col": a_col, "bwd": saved_bwd})
        ctx.save_for_backward(*tensors)
        return recipe.mm_2d3d(lhs, rhs, offs, out_dtype, backend)

    @staticmethod
    def backward(ctx, grad_out):
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nones = (None,) * 7
        if ctx.no_groups:  # the output is a constant zero: zero gradients
            grad_A = grad_out.new_zeros(ctx.a_shape, dtype=ctx.a_dtype) if need_a else None
            grad_B_t = grad_out.new_zeros(ctx.b_shape, dtype=ctx.b_dtype) if need_b else None
            return (grad_A, grad_B_t) + nones
        recipe, f8, backend = ctx.recipe, ctx.fp8_dtype, ctx.backend
        s = unpack(ctx.saved_tensors, ctx.layout)
        offs, a_col = s["offs"], s.get("a_col")
        groups = (offs, s.get("starts"))
        grad_out = grad_out.contiguous()
        grad_A = grad_B_t = g_col = None
        if need_a:
            # grad_out's colwise operand with its rowwise one where one read makes both
            lhs, g_col = recipe.quantize(grad_out, f8, groups, colwise=SAME_READ if need_b and a_col is not None else False)
            rhs = ctx.bwd_box.pop() if ctx.bwd_box else s.get("bwd")
            if rhs is None:
                rhs = recipe.quantize_weights([s["B_t"]], f8, fwd=False, bwd=True)[1]
            dtype = _gemm_out_dtype(recipe, backend, ctx.a_dtype, grad_out.dtype)
            grad_A = recipe.mm_2d3d(lhs, rhs, offs, dtype, backend).to(ctx.a_dtype)
            del lhs, rhs
        if need_b:
            g_col, a_col = colwise_pair(recipe, grad_out, s.get("A"), f8, groups, g_col, a_col)
            dtype = _gemm_out_dtype(recipe, backend, ctx.b_dtype, grad_out.dtype)
            grad_B = recipe.mm_2d2d(g_col, a_col, s.get("wgrad_offs", offs), dtype, backend)  # (E, N, K)
            grad_B_t = grad_B.to(ctx.b_dtype).transpose(-2, -1)
        return (grad_A, grad_B_t) + nones


def _type_name(x) -> str:
    return type(x).__name__


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"grouped_mm: expected {name} to be a torch.Tensor, got {_type_name(x)}")


def _check_offs_content(offs: Tensor, num_tokens: int, op: str = "grouped_mm", operand: str = "A") -> None:
    """offs in [0, num_tokens], non-decreasing (DESIGN §3). Called on CPU tensors, and on
    GPU ones with MOE_FP8_DEBUG=1 only (it syncs)."""
    o = offs.cpu().tolist()  # host-sync-ok: a CPU tensor, or MOE_FP8_DEBUG only
    for g, end in enumerate(o):
        if not 0 <= end <= num_tokens:
            raise ValueError(f"{op}: expected offs[{g}] in [0, {num_tokens}] ({operand} has {num_tokens} rows), got {end}")
        if g and end < o[g - 1]:
            raise ValueError(f"{op}: expected non-decreasing offs, got offs[{g}] = {end} < offs[{g - 1}] = {o[g - 1]}")


def check_offs_where_cheap(offs: Tensor, num_tokens: int, op: str = "grouped_mm", operand: str = "A") -> None:
    """offs content: on the CPU always (no sync), on a GPU only with MOE_FP8_DEBUG=1.
    Not while tracing (the values are not known then); the ops check it at run time."""
    if content_checked(offs):
        _check_offs_content(offs, num_tokens, op, operand)


def device_offs(offs: Tensor, num_tokens: int) -> Tensor:
    """offs content is unchecked on a GPU (a check would sync): make it a valid,
    non-decreasing table in [0, num_tokens] on the device (the same values for valid
    offs), so that no content reaches torch's grouped GEMMs, whose device-side assert on
    a negative group size kills the CUDA context (DESIGN §3: bad offs never corrupt)."""
    if offs.device.type == "cpu" or offs.shape[0] == 0:
        return offs
    return torch.cummax(offs.clamp(0, num_tokens), 0).values.to(torch.int32)


def pads_wgrad(recipe: Recipe, pad_groups: bool, num_tokens: int) -> bool:
    """Whether the weight gradient's operands take the padded layout. Its GEMM reads them
    column-major with the token count as the row stride, which must be a multiple of 16
    bytes: an M that is not (rows past offs[-1]) takes the padded layout even with
    aligned groups. M is static: no sync."""
    return recipe.alignment > 1 and (pad_groups or num_tokens % recipe.alignment != 0)


def resolve_fp8_dtype(op: str, recipe: Recipe, backend: str, device: torch.device, fp8_dtype):
    """``fp8_dtype`` checked against what ``recipe`` takes on ``backend`` (None: the
    recipe's default for ``device``)."""
    fp8_dtypes = recipe.fp8_dtypes(backend, device)
    if fp8_dtype is None:
        return recipe.default_fp8_dtype(device)
    if not isinstance(fp8_dtype, torch.dtype):
        raise TypeError(f"{op}: expected fp8_dtype to be a torch.dtype or None, got {fp8_dtype!r} ({_type_name(fp8_dtype)})")
    if not fp8_dtypes:
        raise ValueError(f"{op}: expected fp8_dtype None for recipe {recipe.name!r} (it does not quantize), got {fp8_dtype}")
    if fp8_dtype not in fp8_dtypes:
        raise ValueError(f"{op}: expected fp8_dtype in {fp8_dtypes} for recipe {recipe.name!r} on {device} "
                         f"(backend {backend!r}), got {fp8_dtype}")
    return fp8_dtype


def _check_debug_alignment(offs: Tensor, recipe: Recipe, op: str = "grouped_mm") -> None:
    alignment = recipe.alignment
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).cpu()  # host-sync-ok: MOE_FP8_DEBUG only
    bad = (sizes % alignment != 0).nonzero().flatten().tolist()  # host-sync-ok: MOE_FP8_DEBUG only
    if bad:
        raise ValueError(
            f"{op}: expected group sizes that are multiples of {alignment} for the {recipe.precision} GEMM, "
            f"got {sizes[bad[0]].item()} for group {bad[0]}"  # host-sync-ok: MOE_FP8_DEBUG only
        )


def _check_args(A, B_t, offs, recipe: Recipe, backend: str, out_dtype, fp8_dtype, pad_groups):
    """Every check of DESIGN §3, in the order a user fixes them; returns the resolved
    (out_dtype, fp8_dtype)."""
    for name, x in (("A", A), ("B_t", B_t), ("offs", offs)):
        _check_tensor(name, x)
    if not isinstance(pad_groups, bool):
        raise TypeError(f"grouped_mm: expected pad_groups to be a bool, got {_type_name(pad_groups)}")
    if A.dim() != 2 or B_t.dim() != 3:
        raise ValueError(f"grouped_mm: expected A 2-D and B_t 3-D, got {A.dim()}-D and {B_t.dim()}-D")
    if A.shape[1] != B_t.shape[1]:
        raise ValueError(f"grouped_mm: expected A (M, K) and B_t (E, K, N) with the same K, got {tuple(A.shape)} and {tuple(B_t.shape)}")
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] != B_t.shape[0]:
        raise ValueError(f"grouped_mm: expected offs int32 of shape ({B_t.shape[0]},), got {offs.dtype} {tuple(offs.shape)}")
    for name, x in (("B_t", B_t), ("offs", offs)):
        if x.device != A.device:
            raise ValueError(f"grouped_mm: expected {name} on {A.device} (the device of A), got {x.device}")
    for name, x in (("A", A), ("B_t", B_t)):
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"grouped_mm: expected {name} of dtype bfloat16, float16 or float32, got {x.dtype}")
    recipe.check_inputs(A, B_t)

    if out_dtype is None:
        out_dtype = recipe.default_out_dtype(A.dtype)
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"grouped_mm: expected out_dtype to be a torch.dtype or None, got {out_dtype!r} ({_type_name(out_dtype)})")
    supported = recipe.out_dtypes(backend, A.dtype)
    if out_dtype not in supported:
        raise ValueError(f"grouped_mm: expected out_dtype in {supported} for recipe {recipe.name!r} on {A.device} "
                         f"(backend {backend!r}), got {out_dtype}")

    fp8_dtype = resolve_fp8_dtype("grouped_mm", recipe, backend, A.device, fp8_dtype)
    check_offs_where_cheap(offs, A.shape[0])
    if not pad_groups and recipe.alignment > 1 and _debug():
        _check_debug_alignment(offs, recipe)
    return out_dtype, fp8_dtype


def grouped_mm(
    A: Tensor,
    B_t: Tensor,
    offs: Tensor,
    *,
    recipe: Union[str, Recipe] = "fp8_rowwise",
    out_dtype: Optional[torch.dtype] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    pad_groups: bool = True,
) -> Tensor:
    """Grouped ``A @ B_t[e]`` over the token groups of ``offs``, differentiable in A and B_t.

    A (M, K) (bf16, fp16 or fp32; row-major is the fast path), B_t (E, K, N) in any
    per-expert layout (the transpose of an (E, N, K) weight is the common case),
    ``offs`` int32 (E,) on A's device with the cumulative end row of each group
    (DESIGN §3: non-decreasing, in [0, M]; checked for CPU tensors, and for GPU ones
    with ``MOE_FP8_DEBUG=1``). Returns (M, N) in ``out_dtype``. Rows past ``offs[-1]``
    belong to no group: their output and gradient are zero (so are all of them when
    E = 0).

    ``recipe``: a name in ``moe_fp8_ext.recipes.RECIPES`` or a
    :class:`~moe_fp8_ext.recipes.Recipe`.

    - ``"fp8_rowwise"`` (DESIGN §5): ``out_dtype`` None means bfloat16, the only dtype
      PyTorch's FP8 grouped GEMM writes (``torch._scaled_grouped_mm`` on CUDA/ROCm:
      float16/float32 are refused); the emulated path (CPU, GPUs before sm90) also
      writes float16 and float32. Gradients come back in the dtypes of A and B_t (an
      fp32 gradient on the FP8 GEMM is its bf16 result, cast). ``fp8_dtype`` None
      picks :func:`moe_fp8_ext.default_fp8_dtype`; the FP8 GEMM takes only that one,
      the emulation also the other fp8 formats.
    - ``"bf16"``: ``torch._grouped_mm`` for each product in the inputs' dtype (A and
      B_t of one dtype; K and N whole multiples of 16 bytes), with the same checks
      and zeroed rows as the fp8 recipe and any group sizes. ``out_dtype`` must be
      None or A's dtype (torch._grouped_mm writes nothing else) and ``fp8_dtype``
      None: anything else raises rather than being ignored.

    ``pad_groups`` (recipes with an alignment): groups of any size, no host sync (see
    the module docstring for how). With ``pad_groups=False`` every group size must be a
    multiple of the recipe's alignment (16 for fp8_rowwise; M need not be).
    """
    r = get_recipe(recipe, "grouped_mm")
    for name, x in (("A", A), ("B_t", B_t), ("offs", offs)):
        _check_tensor(name, x)
    backend = r.backend(A.device)
    out_dtype, f8 = _check_args(A, B_t, offs, r, backend, out_dtype, fp8_dtype, pad_groups)
    offs = device_offs(offs, A.shape[0])
    if pad_groups and r.alignment > 1 and r.pads_token_groups(backend) and offs.shape[0] > 0:
        # Pad the input, run the aligned path, unpad the output (all differentiable).
        A_p, starts, ends = token_groups.pad_token_groups(A, offs, r.alignment)
        out_p = _GroupedMM.apply(A_p, B_t, ends, r, out_dtype, f8, backend, False, torch.is_grad_enabled())
        return token_groups.unpad_token_groups(out_p, offs, starts, A.shape[0])
    return _GroupedMM.apply(A, B_t, offs, r, out_dtype, f8, backend, pads_wgrad(r, pad_groups, A.shape[0]),
                            torch.is_grad_enabled())
