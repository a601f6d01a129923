"""Index tensors of any strides (issue 66): every op that takes a 1-D int32 tensor
(offs, padded_starts, tokens_per_expert_group, indices) reads its values, not the
memory after its data pointer. For every case of every family's OPCHECK_CASES, the
op called with each index tensor as a strided view (stride 2, other values between)
and with expanded index tensors (stride 0) gives the bytes of the same call with
contiguous copies. CPU always; the GPU when there is one (the grouped GEMMs on sm90)."""

import pytest
import torch

import test_blockwise
import test_blockwise_gemm
import test_mxfp8
import test_rowwise
import test_rowwise_gemm
import test_token_groups
from conftest import DEVICES, poison

FAMILIES = [test_blockwise, test_blockwise_gemm, test_mxfp8, test_rowwise, test_rowwise_gemm, test_token_groups]
SM90_ONLY = {test_blockwise_gemm: test_blockwise_gemm.HAS_SM90, test_rowwise_gemm: test_rowwise_gemm.HAS_SM90}


def _is_index(t):
    return isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1


def _cases():
    out = []
    for family in FAMILIES:
        for i, (op, build) in enumerate(family.OPCHECK_CASES):
            names = [a.name for a in getattr(torch.ops.moe_fp8, op).default._schema.arguments]
            out.append(pytest.param(family, op, build, names, id=f"{op}-{i}"))
    return out


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_clone(t) for t in v)
    return v


def _outputs(op, args):
    """The op's outputs (for the in-place op: its first argument afterwards), flat."""
    poison(args[0].device.type if isinstance(args[0], torch.Tensor) else args[0][0].device.type)
    out = getattr(torch.ops.moe_fp8, op)(*args)
    if out is None:
        out = args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _strided(t):
    """The values of t in a view of stride 2 (-7 between them)."""
    return torch.stack([t, torch.full_like(t, -7)], 1)[:, 0]


def _run(op, args):
    try:
        return _outputs(op, args), None
    except RuntimeError as e:
        return None, str(e).splitlines()[0]


def _assert_same(op, what, got, want):
    (g, ge), (w, we) = got, want
    assert ge == we, f"{op}: expected the error of the contiguous call ({we}) with {what}, got {ge}"
    if we is not None:
        return
    assert len(g) == len(w)
    for k, (a, b) in enumerate(zip(g, w)):
        assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride(), (
            f"{op}: output {k} with {what}: expected {tuple(b.shape)} {b.dtype} {b.stride()}, got "
            f"{tuple(a.shape)} {a.dtype} {a.stride()}")
        ab = a.detach().contiguous().view(-1).view(torch.uint8).cpu()
        bb = b.detach().contiguous().view(-1).view(torch.uint8).cpu()
        diff = int((ab != bb).sum())
        assert diff == 0, f"{op}: output {k} with {what}: expected the contiguous call's bytes, got {diff} differing"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family, op, build, names", _cases())
def test_strided_and_expanded_index_tensors(device, family, op, build, names):
    if family in SM90_ONLY and not (device == "cuda" and SM90_ONLY[family]):
        pytest.skip("the grouped GEMMs run on an sm90 GPU only")
    base = list(build(device))
    where = [i for i, a in enumerate(base) if _is_index(a)]
    if not where:
        pytest.skip(f"{op}: this case takes no index tensor")
    for i in where:
        if base[i].numel() < 2:
            continue
        args = _clone(base)
        contiguous = _run(op, _clone(base))
        args[i] = _strided(base[i].clone())
        assert not args[i].is_contiguous()
        _assert_same(op, f"{names[i]} strided", _run(op, args), contiguous)
    # Expanded (stride 0): every index tensor one value repeated. With padded_starts,
    # offs and padded_starts all zero (every group empty: a valid layout); otherwise the
    # last value (the first group takes every row); scatter_rows' indices all -1 (padding).
    k = names.index("padded_starts") if "padded_starts" in names else len(base)
    padded = k < len(base) and base[k] is not None
    expanded, values = _clone(base), _clone(base)
    for i in where:
        n = base[i].numel()
        if n == 0:
            continue
        v = 0 if padded else (-1 if op == "scatter_rows" else int(base[i][-1]))
        expanded[i] = torch.full((1,), v, dtype=torch.int32, device=base[i].device).expand(n)
        values[i] = torch.full((n,), v, dtype=torch.int32, device=base[i].device)
    if any(expanded[i].stride(0) == 0 for i in where if expanded[i].numel() > 1):
        _assert_same(op, "expanded index tensors", _run(op, expanded), _run(op, values))


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp8_rowwise_blocked_offs_strided_issue66(device):
    # The issue's repro: offs (20, 64) as every other element of (20, -7, 64, -7).
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(66)).to(torch.bfloat16).to(device)
    offs = torch.tensor([20, -7, 64, -7], dtype=torch.int32, device=device)[::2]
    got = _run("quantize_mxfp8_rowwise", [x, "rceil", True, offs])
    _assert_same("quantize_mxfp8_rowwise", "offs (20, 64) strided", got,
                 _run("quantize_mxfp8_rowwise", [x, "rceil", True, offs.contiguous()]))
