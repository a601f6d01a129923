"""Every op registered in the moe_fp8 namespace has a torch.library.opcheck case in
its family's test file (STYLE 9: "every op gets opcheck"). A new op fails this test
until its family's OPCHECK_CASES list gets a case for it."""

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
