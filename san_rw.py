import torch, moe_fp8_ext
from moe_fp8_ext import rowwise_gemm as rg
e4 = torch.float8_e4m3fn
qa = torch.randn(1024, 96, device="cuda").to(e4)
n = 0
for offs in ([700, -5, 100, 2**31 - 1, 30, -2**31], [1000 * 3] * 3, [-1] * 5, [960, 32, 1000, 0, 7, 128], [128, 512, 1024]):
    o = torch.tensor(offs, dtype=torch.int32, device="cuda")
    e = o.numel()
    try:
        rg.rowwise_grouped_mm_2d2d_add_(torch.zeros(e, 64, 96, device="cuda"), torch.randn(64, 1024, device="cuda").to(e4),
                                        torch.rand(e, 64, device="cuda"), qa.t().contiguous().t(), torch.rand(e, 96, device="cuda"), o)
        n += 1
    except (RuntimeError, ValueError) as err:
        print("refused:", str(err)[:100])
torch.cuda.synchronize()
print("launched", n)
