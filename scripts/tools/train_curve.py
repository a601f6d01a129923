"""Training curves, bf16 against fp8 (issue 15's numerics target: 150 steps within 1%
of the bf16 curve). One MoE layer trained from the same initial weights on the same
data stream twice: in bf16, and converted to fp8 (the experts only; router and shared
experts stay bf16). With torchtitan installed the layer is torchtitan 0.3.0's real
``MoE`` (router, LocalTokenDispatcher, GroupedExperts, shared experts) converted by
``moe_fp8_ext.integrations.torchtitan.convert``; without it, our ``GroupedExperts`` on
router-like unequal groups. The task: regress a fixed random teacher (tanh of a linear
map), AdamW.

Prints the losses every tenth of the run and the largest relative gap between the two
curves, per step and on 10-step moving averages (after 10 warm-up steps), against the
1% target. Run: python scripts/tools/train_curve.py [--steps 150] [--recipe fp8_rowwise]
[--dswiglu-in-gemm] (fp8_blockwise with the W2 dgrad GEMM's dSwiGLU epilogue)
"""

import argparse
import copy
import sys

import torch
import torch.nn.functional as F

import moe_fp8_ext


def titan_moe(dim, hidden, experts, top_k, device):
    """torchtitan's MoE layer, bf16, weights ~ N(0, 1/fan_in); None without torchtitan."""
    try:
        from moe_fp8_ext.integrations.torchtitan import build_moe
        return build_moe(dim, hidden, experts, top_k, device=device)
    except ImportError:
        return None


class OurLayer(torch.nn.Module):
    """moe_fp8_ext.GroupedExperts on fixed router-like group sizes (no router)."""

    def __init__(self, dim, hidden, experts, tokens, recipe, device):
        super().__init__()
        torch.manual_seed(0)
        self.experts = moe_fp8_ext.GroupedExperts(dim, hidden, experts, recipe=recipe, reuse_weights=False,
                                                  dtype=torch.bfloat16, device=device)
        weights = torch.linspace(0.2, 1.8, experts)
        counts = (weights / weights.sum() * tokens).floor().to(torch.int32)
        counts[-1] += tokens - int(counts.sum())
        self.register_buffer("counts", counts.to(device))

    def forward(self, x):
        shape = x.shape
        return self.experts(x.reshape(-1, shape[-1]), self.counts).reshape(shape)


def train(model, steps, tokens, dim, device, seed=1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device=device).manual_seed(seed)
    teacher = torch.randn(dim, dim, device=device, generator=g) / dim ** 0.5
    losses = []
    for _ in range(steps):
        x = torch.randn(1, tokens, dim, device=device, generator=g)
        y = torch.tanh(x @ teacher)
        loss = F.mse_loss(model(x.to(torch.bfloat16)).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses).tolist()  # host-sync-ok: one sync at the end of a run


def moving(v, w=10):
    return [sum(v[i - w + 1:i + 1]) / w for i in range(w - 1, len(v))]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--recipe", default="fp8_rowwise")
    p.add_argument("--tokens", type=int, default=None, help="default 8192 on a GPU, 256 on the CPU")
    p.add_argument("--dim", type=int, default=None, help="default 1024 on a GPU, 64 on the CPU")
    p.add_argument("--hidden", type=int, default=None, help="default 512 on a GPU, 32 on the CPU")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--dswiglu-in-gemm", action="store_true", help="fp8_blockwise: Fp8Blockwise(dswiglu_in_gemm=True)")
    p.add_argument("--target", type=float, default=0.01, help="largest relative gap allowed (exit 1 above it)")
    args = p.parse_args()
    recipe = args.recipe
    if args.dswiglu_in_gemm:
        if recipe != "fp8_blockwise":
            p.error("--dswiglu-in-gemm is an option of fp8_blockwise")
        recipe = moe_fp8_ext.Fp8Blockwise(dswiglu_in_gemm=True)
    device = "cuda" if torch.cuda.is_available() and moe_fp8_ext.build_info()["cuda"] else "cpu"
    gpu = device == "cuda"
    tokens, dim, hidden = args.tokens or (8192 if gpu else 256), args.dim or (1024 if gpu else 64), args.hidden or (512 if gpu else 32)

    base = titan_moe(dim, hidden, args.experts, 2, device)
    if base is not None:
        from moe_fp8_ext.integrations.torchtitan import convert
        fp8 = copy.deepcopy(base)
        assert convert(fp8, recipe) == 1
        what = "torchtitan 0.3.0 MoE (top-2 router, shared experts), experts converted"
    else:
        base = OurLayer(dim, hidden, args.experts, tokens, "bf16", device)
        fp8 = OurLayer(dim, hidden, args.experts, tokens, recipe, device)
        fp8.load_state_dict(base.state_dict())
        what = "moe_fp8_ext.GroupedExperts, router-like fixed groups (torchtitan not installed)"
    where = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"{what}; {where}; tokens={tokens} dim={dim} hidden={hidden} experts={args.experts} steps={args.steps}; "
          f"bf16 vs {recipe}")
    lb = train(base, args.steps, tokens, dim, device)
    l8 = train(fp8, args.steps, tokens, dim, device)
    every = max(1, args.steps // 10)
    print(f"{'step':>5} {'bf16':>9} {args.recipe:>12} {'gap':>8}")
    for i in list(range(0, args.steps, every)) + ([args.steps - 1] if (args.steps - 1) % every else []):
        print(f"{i + 1:>5} {lb[i]:9.5f} {l8[i]:12.5f} {100 * (l8[i] - lb[i]) / lb[i]:+7.2f}%")
    warm = min(10, args.steps - 1)
    step_gap = max(abs(a - b) / b for a, b in zip(l8[warm:], lb[warm:]))
    avg_gap = max(abs(a - b) / b for a, b in zip(moving(l8), moving(lb))) if args.steps >= 10 else step_gap
    ok = step_gap <= args.target
    print(f"largest gap after step {warm}: per step {100 * step_gap:.2f}%, 10-step averages {100 * avg_gap:.2f}%; "
          f"target {100 * args.target:.0f}% per step: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
