"""torch.library.opcheck on every op (schema, fake tensor, AOT dispatch) and
torch.compile(fullgraph=True) over a function that calls them."""

import pytest
import torch

import moe_fp8_ext
from conftest import DEVICES, randn

F8 = torch.float8_e4m3fn


def op_cases(device):
    x = randn((64, 48), torch.bfloat16, device)
    w = randn((3, 32, 48), torch.bfloat16, device)
    offs = torch.tensor([16, 16, 40, 64], dtype=torch.int32, device=device)
    return [
        (torch.ops.moe_fp8.quantize_rowwise.default, (x, F8, True)),
        (torch.ops.moe_fp8.quantize_rowwise.default, (x.t(), torch.float8_e4m3fnuz, False)),
        (torch.ops.moe_fp8.quantize_experts_fwd.default, (w, F8, True)),
        (torch.ops.moe_fp8.quantize_experts_bwd.default, (w.transpose(1, 2), F8, True)),
        (torch.ops.moe_fp8.quantize_jagged_colwise.default, (x, offs, F8, True)),
        (torch.ops.moe_fp8.quantize_jagged_colwise_dual.default, (x, x[:, :16], offs, F8, True)),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(6))
def test_opcheck(device, case):
    op, args = op_cases(device)[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    def step(a, w, offs):
        qa, sa = moe_fp8_ext.quantize_rowwise(a, F8)
        qw, sw = moe_fp8_ext.quantize_experts_fwd(w, F8)
        qg, sg, qx, sx = moe_fp8_ext.quantize_jagged_colwise_dual(a, a * 2, offs, F8)
        # Some surrounding math so that the ops sit inside a real graph.
        return qa.float() * sa, qw.float() * sw, sg + sx, qg.float().sum() + qx.float().sum()

    a = randn((64, 48), torch.bfloat16, device)
    w = randn((3, 32, 48), torch.bfloat16, device)
    offs = torch.tensor([16, 16, 40, 64], dtype=torch.int32, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    for got, want in zip(compiled(a, w, offs), step(a, w, offs)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
