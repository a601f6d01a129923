"""Every op registered in the moe_fp8 namespace has a torch.library.opcheck case in
its family's test file (STYLE 9: "every op gets opcheck"). A new op fails this test
until its family's OPCHECK_CASES list gets a case for it."""

import pytest
import torch

import moe_fp8_ext  # noqa: F401  (registers the ops)
import test_blockwise
import test_blockwise_gemm
import test_mxfp8
import test_rowwise
import test_rowwise_gemm
import test_swiglu
import test_token_groups

# The family files that hold opcheck cases: (op name, device -> args) in OPCHECK_CASES.
FAMILIES = [test_blockwise, test_blockwise_gemm, test_mxfp8, test_rowwise, test_rowwise_gemm, test_swiglu,
            test_token_groups]


def registered_ops():
    """Names of the ops of the moe_fp8 namespace, overloads folded, as the dispatcher
    lists them (C++ and Python registrations alike)."""
    names = {n.split("::", 1)[1].split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("moe_fp8::")}
    return sorted(names)


def opchecked_ops():
    return {op: family.__name__ for family in FAMILIES for op, _ in family.OPCHECK_CASES}


def test_every_registered_op_has_an_opcheck():
    ops = registered_ops()
    assert "quantize_rowwise" in ops and "pad_token_groups" in ops, ops  # the listing works
    missing = [op for op in ops if op not in opchecked_ops()]
    assert not missing, f"ops without a torch.library.opcheck case (add one to the family's OPCHECK_CASES): {missing}"


def test_opcheck_cases_name_registered_ops():
    ops = set(registered_ops())
    stale = {op: where for op, where in opchecked_ops().items() if op not in ops}
    assert not stale, f"OPCHECK_CASES name ops that are not registered in torch.ops.moe_fp8: {stale}"


def _writes_an_input(op):
    schema = getattr(torch.ops.moe_fp8, op).default._schema
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def test_every_functional_op_refuses_a_backward():
    """A raw op has no derivative: its Autograd kernel makes a backward through it raise
    (csrc/bindings.cpp's list) rather than drop the gradient with a warning."""
    ops = [op for op in registered_ops() if not _writes_an_input(op)]
    assert len(ops) > 40 and "swiglu" in ops, ops
    missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_fp8::{op}", "Autograd")]
    assert not missing, f"ops without an Autograd kernel (add them to csrc/bindings.cpp's kFunctionalOps): {missing}"
    h13 = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match="derivative for moe_fp8::swiglu is not implemented"):
        moe_fp8_ext.swiglu(h13).sum().backward()
    x = torch.randn(4, 128, requires_grad=True)
    with pytest.raises(RuntimeError, match="derivative for moe_fp8::quantize_rowwise is not implemented"):
        moe_fp8_ext.quantize_rowwise(x)[1].sum().backward()
    with torch.no_grad():
        assert not moe_fp8_ext.swiglu(h13).requires_grad


def test_every_op_that_writes_an_input_bumps_its_version():
    """An op that writes an input bumps its version counter (csrc/bindings.cpp's
    ADInplaceOrView kernel), as torch's in-place ops do: a tensor that autograd saved and
    the op then wrote makes the backward raise instead of reading the new values."""
    ops = [op for op in registered_ops() if _writes_an_input(op)]
    assert "zero_rows_past_groups_" in ops, ops
    missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_fp8::{op}", "ADInplaceOrView")]
    assert not missing, f"ops that write an input without an ADInplaceOrView kernel (csrc/bindings.cpp): {missing}"
    w = torch.randn(6, 4, requires_grad=True)
    x = torch.randn(6, 4)
    y = w * x  # saves x
    offs = torch.tensor([2, 5], dtype=torch.int32)
    before = x._version
    torch.ops.moe_fp8.zero_rows_past_groups_(x, offs)
    assert x._version > before and torch.equal(x[5], torch.zeros(4))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    with torch.inference_mode():
        torch.ops.moe_fp8.zero_rows_past_groups_(torch.randn(6, 4), offs)


def test_module_is_stable_abi_and_reports_its_build():
    # `_C.abi3.so`: CPython's stable ABI (csrc/bindings.cpp), one module for every Python
    # from 3.10 on, so a module built elsewhere for the same torch loads here
    # (scripts/prebuild.sh); a leftover `_C.cpython-*.so` would shadow it.
    import os

    from moe_fp8_ext import _C

    assert os.path.basename(_C.__file__) == "_C.abi3.so", _C.__file__
    info = moe_fp8_ext.build_info()
    assert set(info) == {"torch_version", "cuda", "cuda_version", "cuda_archs", "hip", "hip_version", "hip_archs"}
    assert torch.__version__.startswith(info["torch_version"]), (torch.__version__, info)
    assert not (info["cuda"] and info["hip"])
    for gpu in ("cuda", "hip"):
        assert isinstance(info[gpu], bool) and isinstance(info[gpu + "_archs"], str)
        if info[gpu]:
            assert isinstance(info[gpu + "_version"], str) and info[gpu + "_version"] and info[gpu + "_archs"]
        else:
            assert info[gpu + "_version"] is None and info[gpu + "_archs"] == ""
    assert isinstance(_C.dual_l2_budget(0), int)
    for bad in ("0", None, 0.5):
        try:
            _C.dual_l2_budget(bad)
        except TypeError:
            continue
        raise AssertionError(f"dual_l2_budget({bad!r}) did not raise TypeError")
    try:
        _C.dual_l2_budget(2**40)  # not truncated to some other device's index
    except OverflowError:
        pass
    else:
        raise AssertionError("dual_l2_budget(2**40) did not raise OverflowError")
