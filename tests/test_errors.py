"""Bad inputs give the stated "<op>: expected X, got Y" errors."""

import pytest
import torch

import moe_fp8_ext

F8 = torch.float8_e4m3fn
x2d = torch.randn(8, 16, dtype=torch.bfloat16)
offs = torch.tensor([4, 8], dtype=torch.int32)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: moe_fp8_ext.quantize_rowwise(torch.randn(2, 3, 4), F8), "quantize_rowwise: expected x to be a 2-D tensor, got 3-D"),
        (lambda: moe_fp8_ext.quantize_rowwise(torch.ones(4, 4, dtype=torch.int32), F8), "quantize_rowwise: expected x of dtype bfloat16, float16 or float32, got Int"),
        (lambda: moe_fp8_ext.quantize_rowwise(x2d, torch.bfloat16), "quantize_rowwise: expected fp8_dtype float8_e4m3fn, float8_e4m3fnuz or float8_e5m2, got BFloat16"),
        (lambda: moe_fp8_ext.quantize_experts_fwd(x2d, F8), "quantize_experts_fwd: expected b_t to be a 3-D tensor, got 2-D"),
        (lambda: moe_fp8_ext.quantize_experts_bwd(torch.randn(2, 2, 2, dtype=torch.float64), F8), "quantize_experts_bwd: expected b_t of dtype bfloat16, float16 or float32, got Double"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise(x2d, offs.long(), F8), "quantize_jagged_colwise: expected offs of dtype int32, got Long"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise(x2d, offs.view(2, 1), F8), "quantize_jagged_colwise: expected offs to be a 1-D tensor, got 2-D"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise(x2d, torch.tensor([6, 4], dtype=torch.int32), F8), "quantize_jagged_colwise: expected non-decreasing offs, got offs[1] = 4 < offs[0] = 6"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise(x2d, torch.tensor([4, 9], dtype=torch.int32), F8), "quantize_jagged_colwise: expected offs[1] in [0, 8], got 9"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise(x2d, torch.tensor([-1, 8], dtype=torch.int32), F8), "quantize_jagged_colwise: expected offs[0] in [0, 8], got -1"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise_dual(x2d, torch.randn(8, 4), offs, F8), "quantize_jagged_colwise_dual: expected x1 and x2 of one dtype, got BFloat16 and Float"),
        (lambda: moe_fp8_ext.quantize_jagged_colwise_dual(x2d, x2d[:4], offs, F8), "quantize_jagged_colwise_dual: expected x1 and x2 with the same number of rows, got 8 and 4"),
    ],
)
def test_bad_inputs(call, message):
    with pytest.raises(RuntimeError) as e:
        call()
    assert message in str(e.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offs_on_other_device():
    with pytest.raises(RuntimeError, match="quantize_jagged_colwise: expected offs on cuda:0 \\(the device of x\\), got cpu"):
        moe_fp8_ext.quantize_jagged_colwise(x2d.cuda(), offs, F8)
