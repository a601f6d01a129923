"""Same-run A/B (a GPU; run from the repository root): the SwiGLU experts layer, forward +
backward, in fp8_blockwise with h's and grad_h13's two fp8 operands each made together
(Recipe.makes_swiglu_operands, the default on a GPU: h's weight-gradient operand kept
from the forward, grad_h13 read once by act_dual in the backward) against the same
recipe without (lhs_swiglu / lhs_swiglu_backward_joint: h recomputed in the backward,
act_lhs and act_rhs of grad_h13 apart), bf16 beside, at the experts benchmark's shapes.
The two fp8 variants' output and gradients are checked bit-equal first; the three steps
run interleaved (five rounds); peak MiB with x entering as a fresh clone. Prints a
markdown table (bench/RESULTS.md, "the experts layer with fp8_blockwise")."""
import sys

import torch

from moe_fp8_ext import recipes
from moe_fp8_ext.experts import experts

sys.path.insert(0, "bench")
from bench_experts import SHAPES, bf16_layer, problem  # noqa: E402
from common import bench_interleaved_us, peak_mib  # noqa: E402

QUICK = "--quick" in sys.argv
default = recipes.Fp8Blockwise.makes_swiglu_operands


def never(self, h13):
    return False


def ours(together):
    def step(x, w1, w3, w2, offs):
        recipes.Fp8Blockwise.makes_swiglu_operands = default if together else never
        return experts(x, w1, w3, w2, offs, recipe="fp8_blockwise")
    return step


def fresh_step(f, x, w1, w3, w2, offs, grad):
    """One forward + backward with x a fresh clone (as the permuted tokens), every
    gradient asked for."""
    xc = x.detach().clone().requires_grad_()
    return torch.autograd.grad(f(xc, w1, w3, w2, offs), (xc, w1, w3, w2), grad)


print(torch.cuda.get_device_name())
print("| (tokens, dim, hidden, E) | bf16 ms | together ms | apart ms | together vs apart (time) | together vs bf16 "
      "| apart vs bf16 | peak MiB bf16 / together / apart |")
print("|---|---|---|---|---|---|---|---|")
for t, d, h, e in SHAPES[-2:] if QUICK else SHAPES:
    x, w1, w3, w2, offs, grad = problem(t, d, h, e)
    fns = [bf16_layer, ours(True), ours(False)]
    outs = []
    for f in fns[1:]:
        y = f(x, w1, w3, w2, offs)
        outs.append((y, *torch.autograd.grad(y, (x, w1, w3, w2), grad)))
    assert all(torch.equal(a, b) for a, b in zip(*outs)), "together and apart differ"
    del outs, y
    steps = [lambda f=f: torch.autograd.grad(f(x, w1, w3, w2, offs), (x, w1, w3, w2), grad) for f in fns]
    times, ratios = bench_interleaved_us(steps, rounds=5, rep_ms=150)
    mem = [peak_mib(lambda f=f: fresh_step(f, x, w1, w3, w2, offs, grad)) for f in fns]
    print(f"| ({t}, {d}, {h}, {e}) | {times[0]/1e3:.2f} | {times[1]/1e3:.2f} | {times[2]/1e3:.2f} "
          f"| {ratios[1]/ratios[2]:.3f} | {1/ratios[1]:.2f}x | {1/ratios[2]:.2f}x "
          f"| {mem[0]:.0f} / {mem[1]:.0f} / {mem[2]:.0f} |", flush=True)
    del x, w1, w3, w2, grad, steps

recipes.Fp8Blockwise.makes_swiglu_operands = default
