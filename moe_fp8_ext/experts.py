"""The SwiGLU experts layer (DESIGN §10): ``out = (silu(x W1ᵀ) ⊙ (x W3ᵀ)) W2ᵀ`` over
token groups, as ONE differentiable function that owns the whole FFN.

    out = moe_fp8_ext.experts(x, w1, w3, w2, offs)              # recipe="fp8_rowwise"
    layer = moe_fp8_ext.GroupedExperts(dim, hidden, experts)    # torchtitan's layout
    out = layer(x, num_tokens_per_expert)

Against three :func:`~moe_fp8_ext.grouped_mm` calls (same math up to fp8 rounding) it:

- runs W1 and W3 as one GEMM (N = 2·hidden) in the forward, and the input gradient
  grad_h13 @ [W1; W3] as one GEMM where the recipe makes both operands without a copy
  (``Recipe.joins_w13_dgrad``); W1's and W3's weight gradients are two GEMMs, each
  written into a tensor of its own in the weight's layout (autograd keeps it as is);
- makes an activation's two fp8 operands together (the GEMM's and the weight
  gradient's, in the padded layout) and saves x's fp8 weight-gradient operand instead
  of x; saves h13 and recomputes h in the backward (fp8_blockwise on a GPU keeps h's
  fp8 weight-gradient operand instead);
- fuses SwiGLU and dSwiGLU with quantization (:mod:`moe_fp8_ext.swiglu`);
- frees as it goes: each operand is dropped once its GEMM is issued, and h13 once
  dSwiGLU has read it (kept on ctx, outside ``save_for_backward``, except under
  saved-tensor hooks and torch.compile), so a second backward over one forward raises;
- optionally reuses quantized weights while they are unchanged
  (:mod:`moe_fp8_ext.weight_cache`, opt-in).

With a recipe whose ``hold_weight_operands`` is True, where one read makes a weight's
two orientations (``bwd=SAME_READ``) the forward makes the backward operand too and
holds it on ctx until the backward uses it; by default nothing derived from a weight
lives from a forward to its backward. Under ``torch.compile`` the cache is bypassed.
"""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.torch_version import TorchVersion

from . import dispatch as _dispatch, fsdp as _fsdp, token_groups
from .grouped_mm import (
    _check_debug_alignment,
    _debug,
    _gemm_out_dtype,
    _may_free_early,
    check_offs_where_cheap,
    colwise_pair,
    device_offs,
    pack,
    pads_wgrad,
    resolve_fp8_dtype,
    unpack,
)
from .ops import check_counts_where_cheap
from .recipes import FLOAT_DTYPES, SAME_READ, Recipe, get_recipe
from .swiglu import swiglu, swiglu_backward
from .weight_cache import (
    WeightCache,
    _nbytes,
    cached as _cached,
    clear_weight_caches,
    share_versions_in_state_dict,
    weight_keys,
)

_ops = torch.ops.moe_fp8

__all__ = ["GroupedExperts", "WeightCache", "clear_weight_caches", "experts", "offsets_from_counts"]

# ---- the function ----------------------------------------------------------------------


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w3, w2, offs, recipe, fp8_dtype, backend, pad_wgrad, cache, keys, grad_mode, main_grads):
        # keys: the tensors that say whether w1, w3, w2 changed (weight_cache.weight_keys); main_grads: fp32
        # tensors the weight gradients are added to in place (then returned as None), or None
        ctx.recipe, ctx.fp8_dtype, ctx.backend, ctx.cache = recipe, fp8_dtype, backend, cache
        ctx.main_grads = main_grads
        ctx.keys = keys = (w1, w3, w2) if keys is None else keys
        ctx.dtypes = (x.dtype, w1.dtype, w3.dtype, w2.dtype)
        ctx.shapes = (x.shape, w1.shape, w3.shape, w2.shape)
        ctx.no_groups = offs.shape[0] == 0
        ctx.x_rows = isinstance(x, _dispatch.Fp8Rows)
        if ctx.no_groups:  # every row is past offs[-1] (static: no sync)
            return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        f8, tag = fp8_dtype, (recipe, fp8_dtype)
        gemm_dtype = ctx.gemm_dtype = _gemm_out_dtype(recipe, backend, torch.bfloat16, x.dtype)
        # grad_mode: torch.is_grad_enabled() at the call (needs_input_grad is set under no_grad too)
        need_x = grad_mode and ctx.needs_input_grad[0]
        need_w13 = grad_mode and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
        need_w2 = grad_mode and ctx.needs_input_grad[3]
        # Weights all-gathered in fp8 under FSDP2 (moe_fp8_ext.fsdp): their operands come from
        # the gathered fp8, nothing is made from or kept for them here.
        gathered = ctx.gathered = isinstance(w1, _fsdp.GatheredWeight)  # (experts() checked all three)
        ctx.joint = need_x and (gathered or recipe.joins_w13_dgrad(w1, w3))  # one input-gradient GEMM
        # Where the weight gradients take the padded layout, each activation's colwise operand
        # is made with its rowwise one and kept instead of it (fp8 saved activations).
        starts = wgrad_offs = None
        if pad_wgrad and (need_w13 or need_w2):
            starts, wgrad_offs = _ops.padded_group_offsets(offs, x.shape[0], recipe.alignment)
        groups = (offs, starts)
        free_early = _may_free_early()  # (see grouped_mm: what ctx may hold outside save_for_backward)

        # -- the weights' forward operands. Where one read also makes a weight's input-gradient
        # operand (hold_weight_operands) it is kept: in the cache, on ctx, or saved under compile.
        held = {}
        may_hold = cache is not None or (recipe.hold_weight_operands and not gathered
                                         and (free_early or torch.compiler.is_compiling()))

        def weight_fwd(name, weights, parts, needs_bwd, quantize=recipe.quantize_weights):  # weights: the cache keys
            def make():
                ask = SAME_READ if may_hold and needs_bwd else False
                if ask and cache is not None:
                    cache.discard(name + "_bwd")  # (as get() drops a stale entry first)
                fwd, bwd = quantize(parts, f8, bwd=ask)
                if bwd is not None and cache is not None:
                    cache.put(name + "_bwd", weights, tag, bwd)
                elif bwd is not None:
                    held[name] = bwd
                return fwd

            return _cached(cache, name + "_fwd", weights, tag, make)

        rhs13 = _fsdp.rhs_fwd((w1, w3)) if gathered else weight_fwd(
            "w13", keys[:2], [w1.transpose(-2, -1), w3.transpose(-2, -1)], ctx.joint, recipe.quantize_w13)
        # -- W13: h13 = x @ [W1; W3]ᵀ. Rows dispatched in fp8 (moe_fp8_ext.dispatch) are the
        # forward's operand; their colwise one is made from their dequantized values.
        x_col_wanted = pad_wgrad and need_w13
        x_lhs = _dispatch.fp8_rows_operand(recipe, f8, x)
        if x_lhs is not None:
            x = x.dequantize() if need_w13 else None
            x_col = recipe.quantize(x, f8, groups, rowwise=False, colwise=True)[1] if x_col_wanted else None
        else:
            x_lhs, x_col = recipe.quantize(x, f8, groups, colwise=x_col_wanted)
        if x_col is not None or not need_w13:
            x = None
        # -- W13 with SwiGLU (one GEMM where the recipe fuses them), then W2: out = h @ W2ᵀ, h =
        # silu(h1) * h3; h's colwise operand kept where the same read makes it (the backward then
        # computes no h). x's and W13's operands are dropped once the GEMM has read them.
        tensors, x_lhs, rhs13 = [x_lhs, rhs13], None, None
        h13, h_lhs, h_col = recipe.mm_2d3d_swiglu(tensors, offs, gemm_dtype, backend, f8, groups,
                                                  colwise=SAME_READ if pad_wgrad and need_w2 else False)
        rhs2 = _fsdp.rhs_fwd((w2,)) if gathered else weight_fwd("w2", keys[2:], [w2.transpose(-2, -1)],
                                                                 need_x or need_w13)
        out = recipe.mm_2d3d(h_lhs, rhs2, offs, gemm_dtype, backend)
        del h_lhs, rhs2
        # -- kept for the backward, each only for the gradients that read it. h13 (the largest),
        # x's and h's colwise operands and held weight operands go on ctx where the backward may
        # free them as it goes (the step's peak is there), else they are saved.
        saved = {"x": x, "w1": w1 if need_x else None, "w3": w3 if need_x else None,
                 "w2": w2 if need_x or need_w13 else None, "offs": offs, "starts": starts,
                 "wgrad_offs": wgrad_offs}
        late = {"h13": h13, "x_col": x_col, "h_col": h_col, **{"bwd_" + k: v for k, v in held.items()}}
        ctx.box = late if free_early else None
        if not free_early:
            saved.update(late)
        tensors, ctx.layout = pack(saved)
        ctx.save_for_backward(*tensors)
        out = out.to(ctx.dtypes[0])
        return out.clone() if _COPY_COMPILED_OUTPUT and torch.compiler.is_compiling() else out

    @staticmethod
    def backward(ctx, grad_out):
        grads = _Experts._backward(ctx, grad_out)
        if ctx.x_rows and grads[0] is not None:  # (x's gradient as rows dispatched in fp8 take it)
            grads = (_dispatch.Fp8Rows.gradient(grads[0]),) + grads[1:]
        return grads

    @staticmethod
    def _backward(ctx, grad_out):
        if ctx.no_groups:  # the output is a constant zero: zero gradients
            grads = tuple(grad_out.new_zeros(s, dtype=d) if need else None
                          for s, d, need in zip(ctx.shapes, ctx.dtypes, ctx.needs_input_grad))
            if ctx.main_grads is not None:  # (zero gradients: nothing to add)
                grads = grads[:1] + (None,) * 3
            return grads + (None,) * 9
        s = unpack(ctx.saved_tensors, ctx.layout)
        if ctx.box is not None:
            if "h13" not in ctx.box:
                raise RuntimeError(
                    "experts: backward ran twice over one forward (retain_graph=True): the layer frees its W13 "
                    "output during the first backward to lower the step's peak memory; run the forward again, or "
                    "run it under torch.autograd.graph.saved_tensors_hooks (the layer then keeps it)")
            s.update(ctx.box)
            ctx.box.clear()
        recipe, f8, backend, cache = ctx.recipe, ctx.fp8_dtype, ctx.backend, ctx.cache
        tag, hidden = (recipe, f8), ctx.shapes[1][1]
        need_x, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:4]
        need_w13 = need_w1 or need_w3
        x, w1, w3, w2, offs = (s.pop(k, None) for k in ("x", "w1", "w3", "w2", "offs"))
        groups, wgrad_offs = (offs, s.get("starts")), s.get("wgrad_offs", offs)
        x_col, h_col, h13 = s.pop("x_col", None), s.pop("h_col", None), s.pop("h13")

        def weight_bwd(name, weights, parts):
            """A weight's input-gradient operand: held from the forward, else the cache's or made."""
            rhs = s.pop("bwd_" + name, None)
            return rhs if rhs is not None else _cached(
                cache, name + "_bwd", weights, tag, lambda: recipe.quantize_weights(parts(), f8, fwd=False, bwd=True)[1])

        # Every operand is dropped once its GEMM is issued (the step's peak is in the backward).
        grad_out = grad_out.contiguous()
        grad_h13 = lhs13 = h = g13_col = g_col = halves = None
        if need_x or need_w13:  # grad_h feeds only the gradients below W2
            # -- W2 dgrad: grad_h = grad_out @ W2; grad_out's colwise operand with it where one read
            # makes both, and always under compile, where grad_out then dies here, not after the
            # dSwiGLU (in eager mode autograd holds it through the backward anyway)
            rhs2 = _fsdp.rhs_bwd((w2,)) if ctx.gathered else weight_bwd("w2", ctx.keys[2:],
                                                                        lambda: [w2.transpose(-2, -1)])
            g_col_now = need_w2 and (True if torch.compiler.is_compiling() else
                                     SAME_READ if groups[1] is not None else False)
            lhs_g, g_col = recipe.quantize(grad_out, f8, groups, colwise=g_col_now)
            # -- with dSwiGLU: reads h13 once, fused with grad_h13's operands (in the GEMM's epilogue
            # where the recipe fuses them), and h where W2's weight gradient needs it (none kept in
            # fp8); h13 and grad_h are freed once read.
            if need_x:
                tensors, lhs_g, rhs2, h13 = [lhs_g, rhs2, h13], None, None, None
                grad_h13, lhs13, h, g13_col = recipe.mm_2d3d_dswiglu(
                    tensors, offs, ctx.gemm_dtype, backend, f8, groups, joint=ctx.joint,
                    with_h=need_w2 and h_col is None, colwise=SAME_READ if need_w13 and x_col is not None else False)
            else:
                grad_h = recipe.mm_2d3d(lhs_g, rhs2, offs, ctx.gemm_dtype, backend)
                del rhs2, lhs_g
                grad_h13 = swiglu_backward(grad_h, h13)
                del grad_h
            # (two input-gradient GEMMs whose operands the recipe leaves to them: each half of
            # grad_h13 quantized just before its GEMM)
            halves = grad_h13 if need_x and not ctx.joint and lhs13 is None else None
            if not need_w13:
                grad_h13 = None
        if need_w2 and h is None and h_col is None:
            h = swiglu(h13)
        h13 = None
        # -- W2 wgrad: grad_w2 = grad_outᵀ @ h per group. Its operands are made here; its GEMM runs
        # last where they are smaller than grad_w2 (then they, not grad_w2, live through W13's GEMMs).
        grad_w2 = w2_last = None
        if need_w2:
            g_col, h_col = colwise_pair(recipe, grad_out, h, f8, groups, g_col, h_col)
            h = None
            dtype = _gemm_out_dtype(recipe, backend, ctx.dtypes[3], grad_out.dtype)
            if ctx.main_grads is not None:
                recipe.mm_2d2d_add_(ctx.main_grads[2], g_col, h_col, wgrad_offs, dtype, backend)
            elif (need_x or need_w13) and statically_known_true(  # (unknown while compiling: run it now)
                    _nbytes((g_col, h_col)) < ctx.shapes[3].numel() * ctx.dtypes[3].itemsize):
                w2_last = [g_col, h_col, dtype]
            else:
                grad_w2 = recipe.mm_2d2d(g_col, h_col, wgrad_offs, dtype, backend).to(ctx.dtypes[3])
            g_col = h_col = None
        # -- input gradient: grad_h13 @ [W1; W3], one GEMM or two summed
        grad_x = grad_w1 = grad_w3 = None
        if need_x:
            dtype = _gemm_out_dtype(recipe, backend, ctx.dtypes[0], ctx.gemm_dtype)  # grad_h13's dtype
            if ctx.joint:
                rhs = _fsdp.rhs_bwd((w1, w3)) if ctx.gathered else weight_bwd(
                    "w13", ctx.keys[:2], lambda: [w1.transpose(-2, -1), w3.transpose(-2, -1)])
                grad_x = recipe.mm_2d3d(lhs13, rhs, offs, dtype, backend)
                del lhs13, rhs
            else:
                (lhs1, lhs3), lhs13 = lhs13 if lhs13 is not None else (None, None), None
                lhs1 = lhs1 if lhs1 is not None else recipe.quantize(halves[:, :hidden], f8, groups)[0]
                rhs = weight_bwd("w1", ctx.keys[:1], lambda: [w1.transpose(-2, -1)])
                grad_x = recipe.mm_2d3d(lhs1, rhs, offs, dtype, backend)
                del lhs1, rhs
                lhs3 = lhs3 if lhs3 is not None else recipe.quantize(halves[:, hidden:], f8, groups)[0]
                halves = None
                rhs = weight_bwd("w3", ctx.keys[1:2], lambda: [w3.transpose(-2, -1)])
                part = recipe.mm_2d3d(lhs3, rhs, offs, dtype, backend)
                del lhs3, rhs
                # In place in eager mode (else three (M, dim) tensors live at once, the step's peak); out
                # of place under compile (in place, torch 2.11's compiled backward drops gradients).
                grad_x = grad_x + part if torch.compiler.is_compiling() else grad_x.add_(part)
                del part
            grad_x = grad_x.to(ctx.dtypes[0])
        # -- W1 and W3 wgrad: each in a tensor of its own, in the weight's layout (autograd takes
        # it without a copy): one GEMM per half of grad_h13's colwise operand.
        if need_w13:
            g13_col, x_col = colwise_pair(recipe, grad_h13, x, f8, groups, g13_col, x_col)
            grad_h13 = x = None
            dtype = _gemm_out_dtype(recipe, backend, ctx.dtypes[1], ctx.gemm_dtype)
            parts = ((0, hidden) if need_w1 else None, (hidden, 2 * hidden) if need_w3 else None)
            if ctx.main_grads is not None:
                recipe.mm_2d2d_parts_add_(ctx.main_grads[:2], g13_col, x_col, wgrad_offs, dtype, backend, parts)
            else:
                grad_w1, grad_w3 = recipe.mm_2d2d_parts(g13_col, x_col, wgrad_offs, dtype, backend, parts)
                grad_w1 = grad_w1.to(ctx.dtypes[1]) if need_w1 else None
                grad_w3 = grad_w3.to(ctx.dtypes[2]) if need_w3 else None
            del g13_col, x_col
        if w2_last is not None:
            (g_col, h_col, dtype), w2_last = w2_last, None
            grad_w2 = recipe.mm_2d2d(g_col, h_col, wgrad_offs, dtype, backend).to(ctx.dtypes[3])
            del g_col, h_col
        return grad_x, grad_w1, grad_w3, grad_w2, None, None, None, None, None, None, None, None, None


# torch < 2.13 under compile: a Function output last written by an in-place op (the
# tail zeroing) gets all-zero gradients; a copy of it does not (tests/test_experts.py).
_COPY_COMPILED_OUTPUT = TorchVersion(torch.__version__) < "2.13"


def _check(x, w1, w3, w2, offs, recipe: Recipe, backend: str, fp8_dtype):
    for name, t in (("x", x), ("w1", w1), ("w3", w3), ("w2", w2), ("offs", offs)):
        if not isinstance(t, Tensor):
            raise TypeError(f"experts: expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or w1.dim() != 3 or w3.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"experts: expected x 2-D (M, dim) and w1, w3, w2 3-D, got {x.dim()}-D, {w1.dim()}-D, "
                         f"{w3.dim()}-D and {w2.dim()}-D")
    e, hidden, dim = w1.shape
    if tuple(w3.shape) != (e, hidden, dim) or tuple(w2.shape) != (e, dim, hidden) or x.shape[1] != dim:
        raise ValueError(f"experts: expected w1 and w3 (E, hidden, dim), w2 (E, dim, hidden) and x (M, dim), got "
                         f"w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)}, x {tuple(x.shape)}")
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] != e:
        raise ValueError(f"experts: expected offs int32 of shape ({e},), got {offs.dtype} {tuple(offs.shape)}")
    for name, t in (("w1", w1), ("w3", w3), ("w2", w2), ("offs", offs)):
        if t.device != x.device:
            raise ValueError(f"experts: expected {name} on {x.device} (the device of x), got {t.device}")
    for name, t in (("x", x), ("w1", w1), ("w3", w3), ("w2", w2)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"experts: expected {name} of dtype bfloat16, float16 or float32, got {t.dtype}")
    if w3.dtype != w1.dtype:
        raise ValueError(f"experts: expected w1 and w3 of one dtype (one [W1; W3] operand), got {w1.dtype} and {w3.dtype}")
    if hidden == 0 or dim == 0:
        raise ValueError(f"experts: expected hidden and dim > 0, got w1 of shape {tuple(w1.shape)}")
    # The recipe's own rules (K, N multiples of 16 or 32, dtypes) for the two products
    # (shapes only: weights on the meta device, no copy).
    recipe.check_inputs(x, torch.empty((e, dim, 2 * hidden), dtype=w1.dtype, device="meta"))
    recipe.check_inputs(torch.empty((0, hidden), dtype=x.dtype, device=x.device),
                        torch.empty((e, hidden, dim), dtype=w2.dtype, device="meta"))
    return resolve_fp8_dtype("experts", recipe, backend, x.device, fp8_dtype)


def experts(
    x: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    offs: Tensor,
    *,
    recipe: Union[str, Recipe] = "fp8_rowwise",
    fp8_dtype: Optional[torch.dtype] = None,
    weight_cache: Optional[WeightCache] = None,
    weight_keys: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
    pad_groups: bool = True,
    main_grads: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
) -> Tensor:
    """The SwiGLU expert FFN ``(silu(x w1[e]ᵀ) ⊙ (x w3[e]ᵀ)) w2[e]ᵀ`` for the rows of each
    token group e, differentiable in x, w1, w3 and w2.

    x (M, dim), w1 and w3 (E, hidden, dim), w2 (E, dim, hidden) (torchtitan's layout;
    bf16, fp16 or fp32), ``offs`` int32 (E,) cumulative group ends (DESIGN §3, any
    group sizes, empty groups allowed, no host sync). Returns (M, dim) in x's dtype;
    rows past ``offs[-1]`` are zero, and so is their gradient. ``recipe`` and
    ``fp8_dtype`` as for :func:`~moe_fp8_ext.grouped_mm` (the GEMMs run in bf16 out).
    ``weight_cache``: a :class:`WeightCache` to reuse quantized weights while they are
    unchanged (None: quantize every call); ``weight_keys``: the three tensors whose
    versions say whether w1, w3, w2 changed, where those are not the weights themselves
    (FSDP2's sharded parameters: :func:`moe_fp8_ext.weight_cache.weight_keys`). Works
    under ``torch.compile(fullgraph=True)`` (the cache is bypassed there), rows of
    unbacked size included (after an all-to-all). x may be rows dispatched in fp8
    (:class:`moe_fp8_ext.dispatch.Fp8Rows`, traceable too) and the weights all-gathered
    in fp8 (:class:`moe_fp8_ext.fsdp.GatheredWeight`, traceable): read as they are.
    ``pad_groups=False``: every group size is already a multiple of the recipe's
    alignment (as a padded dispatch lays them out), so nothing is padded for the weight
    gradients (checked only with ``MOE_FP8_DEBUG=1``). ``main_grads``: three float32 tensors of w1's, w3's and w2's shapes that the
    backward adds the weights' gradients to in place, returning none for the weights
    (Megatron's gradient accumulation fusion: fused into the weight-gradient GEMMs for
    both fp8 recipes on Hopper, an add after them elsewhere); eager only (under
    torch.compile a graph break).
    """
    kw = dict(recipe=recipe, fp8_dtype=fp8_dtype, weight_cache=weight_cache, weight_keys=weight_keys,
              pad_groups=pad_groups, main_grads=main_grads)
    if main_grads is not None and torch.compiler.is_compiling():
        return _experts_eager(x, w1, w3, w2, offs, **kw)
    return _experts(x, w1, w3, w2, offs, **kw)


def _experts(x, w1, w3, w2, offs, *, recipe, fp8_dtype, weight_cache, weight_keys, pad_groups, main_grads):
    r = get_recipe(recipe, "experts")
    backend = r.backend(x.device) if isinstance(x, Tensor) else None
    f8 = _check(x, w1, w3, w2, offs, r, backend, fp8_dtype)
    main_grads = _check_main_grads(main_grads, (w1, w3, w2), x.device)
    if not isinstance(pad_groups, bool):
        raise TypeError(f"experts: expected pad_groups to be a bool, got {type(pad_groups).__name__}")
    if weight_cache is not None and not isinstance(weight_cache, WeightCache):
        raise TypeError(f"experts: expected weight_cache to be a moe_fp8_ext.WeightCache or None, got "
                        f"{type(weight_cache).__name__}")
    if weight_keys is not None and (len(weight_keys) != 3 or not all(isinstance(k, Tensor) for k in weight_keys)):
        raise TypeError("experts: expected weight_keys to be None or three tensors (for w1, w3, w2)")
    check_offs_where_cheap(offs, x.shape[0], "experts", "x")
    offs = device_offs(offs, x.shape[0])
    if not pad_groups and r.alignment > 1 and _debug() and not torch.compiler.is_compiling():
        _check_debug_alignment(offs, r, "experts")
    if torch.compiler.is_compiling():
        weight_cache = None
    elif _fsdp.gathered_weights(r, f8, (w1, w3, w2)):
        weight_cache = None  # (gathered fp8 weights: FSDP2 keeps them while unsharded)
        _fsdp.note_forward_read((w1, w3, w2))
    if pad_groups and r.alignment > 1 and r.pads_token_groups(backend) and offs.shape[0] > 0:
        if isinstance(x, _dispatch.Fp8Rows):
            raise NotImplementedError(f"experts: rows dispatched in fp8 for recipe {r.name!r} on {backend!r}, which "
                                      "pads token groups: dispatch them into padded groups (perm of fp8_dispatch, as "
                                      "permute_indices makes it) and pass pad_groups=False")
        x_p, starts, ends = token_groups.pad_token_groups(x, offs, r.alignment)
        out_p = _Experts.apply(x_p, w1, w3, w2, ends, r, f8, backend, False, weight_cache, weight_keys,
                               torch.is_grad_enabled(), main_grads)
        return token_groups.unpad_token_groups(out_p, offs, starts, x.shape[0])
    return _Experts.apply(x, w1, w3, w2, offs, r, f8, backend, pads_wgrad(r, pad_groups, x.shape[0]), weight_cache,
                          weight_keys, torch.is_grad_enabled(), main_grads)


def _check_main_grads(main_grads, ws, device):
    """main_grads as a tuple of three fp32 contiguous tensors of the weights' shapes on x's device, or None."""
    if main_grads is None:
        return None
    if not isinstance(main_grads, (tuple, list)) or len(main_grads) != 3:
        raise TypeError("experts: expected main_grads to be None or three tensors (for w1, w3, w2)")
    for name, g, w in zip(("w1", "w3", "w2"), main_grads, ws):
        if not isinstance(g, Tensor) or g.dtype != torch.float32 or tuple(g.shape) != tuple(w.shape):
            raise ValueError(f"experts: expected the main gradient of {name} float32 of shape {tuple(w.shape)}, got "
                             f"{getattr(g, 'dtype', type(g).__name__)} {tuple(getattr(g, 'shape', ()))}")
        if g.device != device or not g.is_contiguous():
            raise ValueError(f"experts: expected the main gradient of {name} contiguous on {device}, got "
                             f"{'strides ' + str(g.stride()) if g.device == device else g.device}")
        if isinstance(w, _fsdp.GatheredWeight):
            raise ValueError("experts: main_grads with weights all-gathered in fp8 (FSDP2): FSDP2 reduces the "
                             "weights' .grad; leave main_grads off under FSDP2")
    return tuple(main_grads)


EAGER_REASON = ("moe_fp8_ext: main_grads are added to in place by the backward; the experts layer runs eagerly "
                "with them (fullgraph=True cannot hold that: compile without fullgraph, or without fused "
                "gradient accumulation)")


@torch.compiler.disable(reason=EAGER_REASON)
def _experts_eager(*args, **kwargs):
    return _experts(*args, **kwargs)


# ---- the module ------------------------------------------------------------------------


def offsets_from_counts(counts: Tensor, num_tokens: int, op: str = "GroupedExperts") -> Tensor:
    """int32 cumulative group ends (``offs``) from per-expert token counts, as
    torchtitan's ``GroupedExperts`` computes them, without its silent casts: counts must
    be integers (not bool or float), summed in int64 and clamped into [0, num_tokens]
    (no wrap past 2^31). Negative counts or a sum over ``num_tokens`` raise on the CPU
    (and with ``MOE_FP8_DEBUG=1``); on a GPU they clamp like any bad offs (DESIGN §3)."""
    if not isinstance(counts, Tensor):
        raise TypeError(f"{op}: expected num_tokens_per_expert to be a torch.Tensor, got {type(counts).__name__}")
    if counts.dtype == torch.bool or counts.is_floating_point() or counts.is_complex():
        raise TypeError(f"{op}: expected num_tokens_per_expert of an integer dtype, got {counts.dtype}")
    if counts.dim() != 1:
        raise ValueError(f"{op}: expected num_tokens_per_expert 1-D (E,), got shape {tuple(counts.shape)}")
    check_counts_where_cheap(op, "num_tokens_per_expert", counts, num_tokens)
    return torch.cumsum(counts, dim=0, dtype=torch.int64).clamp(0, num_tokens).to(torch.int32)


class GroupedExperts(torch.nn.Module):
    """E SwiGLU experts with torchtitan's layout: w1 and w3 (E, hidden, dim), w2
    (E, dim, hidden); ``forward(x, num_tokens_per_expert)`` for tokens sorted by
    expert, as torchtitan's ``GroupedExperts.forward``. ``recipe``: as for
    :func:`experts`. ``reuse_weights``: keep a :class:`WeightCache` (``self.weight_cache``;
    see the module docstring for when it is used and what it holds).
    ``fuse_grad_accumulation``: the backward adds each weight's gradient to its
    ``main_grad`` attribute (float32, made as zeros by the first forward) in place and
    leaves ``.grad`` None, as Megatron's ``gradient_accumulation_fusion``: the optimizer
    step reads ``main_grad`` (``p.grad = p.main_grad`` for fp32 weights) and the caller
    zeroes it after. Not under FSDP2 or other DTensor weights (their reduction reads
    ``.grad``)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, recipe: Union[str, Recipe] = "fp8_rowwise",
                 reuse_weights: bool = False, dtype: Optional[torch.dtype] = None, device=None,
                 fuse_grad_accumulation: bool = False):
        super().__init__()
        if not isinstance(fuse_grad_accumulation, bool):
            raise TypeError(f"GroupedExperts: expected fuse_grad_accumulation to be a bool, got "
                            f"{type(fuse_grad_accumulation).__name__}")
        self.fuse_grad_accumulation = fuse_grad_accumulation
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.recipe = get_recipe(recipe, "GroupedExperts")
        kw = dict(dtype=dtype, device=device)
        self.w1 = torch.nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        self.w2 = torch.nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **kw))
        self.w3 = torch.nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        self.weight_cache = WeightCache() if reuse_weights else None
        if reuse_weights:
            share_versions_in_state_dict(self)
        self.init_weights()

    def init_weights(self, init_std: float = 0.02) -> None:
        """torchtitan's init: w1 normal(0.02), w2 and w3 normal(init_std), truncated at ±2σ."""
        with torch.no_grad():
            torch.nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02, a=-0.04, b=0.04)
            for w in (self.w2, self.w3):
                torch.nn.init.trunc_normal_(w, mean=0.0, std=init_std, a=-2 * init_std, b=2 * init_std)

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        offs = offsets_from_counts(num_tokens_per_expert, x.shape[0])
        _fsdp.check_wrapped(self, (self.w1, self.w3, self.w2))
        cache = None if torch.compiler.is_compiling() else self.weight_cache  # (compiled: experts uses none)
        keys = weight_keys(self, ("w1", "w3", "w2")) if cache is not None else None
        main = self.main_grads() if self.fuse_grad_accumulation else None
        return experts(x, self.w1, self.w3, self.w2, offs, recipe=self.recipe, weight_cache=cache,
                       weight_keys=keys, main_grads=main)

    def main_grads(self) -> Tuple[Tensor, Tensor, Tensor]:
        """w1's, w3's and w2's ``main_grad`` (fuse_grad_accumulation), made as float32 zeros where missing."""
        from torch.distributed.tensor import DTensor

        ws = (self.w1, self.w3, self.w2)
        if any(isinstance(w, DTensor) for w in ws):
            raise ValueError("GroupedExperts: fuse_grad_accumulation adds the weight gradients to main_grad, which "
                             "FSDP2 and DTensor sharding do not reduce (they read .grad): turn it off there")
        for w in ws:
            if getattr(w, "main_grad", None) is None:
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        return tuple(w.main_grad for w in ws)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, "
                f"recipe={self.recipe.name!r}, reuse_weights={self.weight_cache is not None}"
                + (", fuse_grad_accumulation=True" if self.fuse_grad_accumulation else ""))
