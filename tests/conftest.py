"""Shared test helpers: devices, realistic random data, output poisoning and
bit-exact comparison of fp8 codes and scales."""

import pytest
import torch

import moe_fp8_ext  # noqa: F401  (registers the ops)

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
IN_DTYPES = [torch.bfloat16, torch.float16, torch.float32]

HAS_CUDA = torch.cuda.is_available() and moe_fp8_ext.build_info()["cuda"]
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")
DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.gpu)] * HAS_CUDA


def randn(shape, dtype, device="cpu", outliers=True, seed=None):
    """N(0, 1) with a few large outliers, in dtype; a fresh draw unless seeded."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if outliers and x.numel() > 0:
        idx = torch.randint(0, x.numel(), (max(1, x.numel() // 500),), generator=g)
        x.view(-1)[idx] *= 50.0
    return x.to(dtype).to(device)


def poison(device):
    """Fill the caching allocator's free memory with 0xFF bytes (fp8 e4m3fn NaN, fp32
    NaN), so that any output element a kernel forgets to write shows up."""
    if device != "cuda":
        return
    torch.cuda.synchronize()
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda") for n in (1 << 29, 1 << 24, 1 << 20, 1 << 16, 4096, 512)]
    del blocks


def assert_fp8_equal(q, ref):
    """Bit-exact fp8 codes, except that NaN only has to match NaN."""
    assert q.dtype == ref.dtype, (q.dtype, ref.dtype)
    assert q.shape == ref.shape, (q.shape, ref.shape)
    qn, rn = torch.isnan(q.float()), torch.isnan(ref.float())
    assert torch.equal(qn.cpu(), rn.cpu()), f"NaN positions differ: {int((qn != rn).sum())} elements"
    a = q.view(torch.uint8).cpu()
    b = ref.view(torch.uint8).cpu()
    diff = (a != b) & ~rn.cpu()
    if diff.any():
        i = diff.nonzero()[0].tolist()
        raise AssertionError(f"{int(diff.sum())} of {a.numel()} codes differ; first at {i}: {a[tuple(i)]} vs {b[tuple(i)]}")


def assert_scale_equal(s, ref):
    assert s.shape == ref.shape, (s.shape, ref.shape)
    torch.testing.assert_close(s.cpu(), ref.cpu(), rtol=0, atol=0, equal_nan=True)
