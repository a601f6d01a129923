"""Workloads the benchmarks and tests share (not part of the package): a minimal MoE
expert layer on top of grouped_mm, and router-like aligned token groups. Tests import it
with bench/ on sys.path."""

import torch
import torch.nn.functional as F

from moe_fp8_ext import grouped_mm


class MoEExperts(torch.nn.Module):
    """E experts with weights w1, w3 (E, hidden, dim) and w2 (E, dim, hidden), the usual
    nn.Linear layout; tokens arrive sorted by expert with group ends ``offs``: the
    experts' SwiGLU FFN ``w2(silu(x w1^T) * (x w3^T))`` as three grouped_mm calls."""

    def __init__(self, experts: int, dim: int, hidden: int, recipe="fp8_rowwise", dtype=torch.bfloat16,
                 device=None, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def init(*shape):
            return torch.nn.Parameter((torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype).to(device))

        self.w1, self.w3, self.w2 = init(experts, hidden, dim), init(experts, hidden, dim), init(experts, dim, hidden)
        self.recipe = recipe

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        def mm(a, w):
            return grouped_mm(a, w.transpose(1, 2), offs, recipe=self.recipe, out_dtype=x.dtype)

        return mm(F.silu(mm(x, self.w1)) * mm(x, self.w3), self.w2)


def balanced_offs(tokens: int, experts: int, alignment: int = 16, generator=None, device=None) -> torch.Tensor:
    """Router-like group ends: random sizes around tokens/experts, multiples of
    `alignment`, summing to `tokens` (which must be a multiple of it)."""
    w = torch.rand(experts, generator=generator) + 0.5
    sizes = (w / w.sum() * tokens / alignment).floor().long() * alignment
    sizes[-1] += tokens - int(sizes.sum())
    return torch.cumsum(sizes, 0).to(torch.int32).to(device)
