"""Run under compute-sanitizer: every op with garbage offs and odd shapes, so that
memcheck sees any out-of-bounds access (scripts/gpu_ci.sh runs it)."""

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
big = torch.sort(torch.randint(0, 4100, (6000,), dtype=torch.int32)).values.cuda()  # global-table path
moe_fp8_ext.pad_token_groups(x, big, 32)
moe_fp8_ext.permute_indices(torch.tensor([5, -3, 2**30, 7, 0, 9], dtype=torch.int32, device="cuda"), 3, 2, 16, 100)
torch.cuda.synchronize()
print("sanitize_offs: done")
