"""Same-run A/B (a GPU; run from the repository root): one grouped linear, forward +
backward, fp8_blockwise with its one-read activation operands (quantize_blockwise_act_dual
for A in the forward and grad_out in the backward, A's fp8 weight-gradient operand saved)
against the same recipe with Recipe.keeps_fp8_activations off (act_lhs and act_rhs each,
A saved in bf16), bf16 beside, at issue 14's shapes. The two fp8 variants' gradients are
checked bit-equal first; the three steps run interleaved (five rounds), then the two fp8
ones again (seven rounds) for their ratio; peak MiB with A entering as a fresh clone.
Prints a markdown table (bench/RESULTS.md, "grouped linear per recipe")."""
import dataclasses
import sys

import torch

import moe_fp8_ext
from moe_fp8_ext.recipes import Fp8Blockwise

sys.path.insert(0, "bench")
from common import bench_interleaved_us, linear_problem, peak_mib  # noqa: E402


@dataclasses.dataclass(frozen=True)
class NoDual(Fp8Blockwise):
    keeps_fp8_activations = False

    def reads_activations_once(self, x=None):
        return False


nodual = NoDual()
print(torch.cuda.get_device_name())
print("| (M, K, N, E) | bf16 ms | dual ms | two ops ms | dual vs two ops (time) | dual vs bf16 | two ops vs bf16 | peak MiB bf16 / dual / two ops |")
print("|---|---|---|---|---|---|---|---|")
for m, k, n, e in [(16384, 7168, 2048, 8), (32768, 5120, 1536, 16), (65536, 2048, 1408, 64)]:
    a, w, offs, grad = linear_problem(m, k, n, e)
    fs = {"bf16": lambda x: moe_fp8_ext.grouped_mm(x, w.transpose(1, 2), offs, recipe="bf16"),
          "dual": lambda x: moe_fp8_ext.grouped_mm(x, w.transpose(1, 2), offs, recipe="fp8_blockwise"),
          "two": lambda x: moe_fp8_ext.grouped_mm(x, w.transpose(1, 2), offs, recipe=nodual)}
    r1 = torch.autograd.grad(fs["dual"](a), (a, w), grad)
    r2 = torch.autograd.grad(fs["two"](a), (a, w), grad)
    assert all(torch.equal(x, y) for x, y in zip(r1, r2)), "dual and two ops differ"
    steps = [lambda f=f: torch.autograd.grad(f(a), (a, w), grad) for f in fs.values()]
    times, ratios = bench_interleaved_us(steps, rounds=5, rep_ms=150)
    _, r = bench_interleaved_us([steps[2], steps[1]], rounds=7, rep_ms=150)
    mem = [peak_mib(lambda f=f: torch.autograd.grad(f(a.clone()), (a, w), grad)) for f in fs.values()]
    print(f"| ({m}, {k}, {n}, {e}) | {times[0]/1e3:.3f} | {times[1]/1e3:.3f} | {times[2]/1e3:.3f} | {r[1]:.3f} "
          f"| {1/ratios[1]:.2f}x | {1/ratios[2]:.2f}x | {mem[0]:.0f} / {mem[1]:.0f} / {mem[2]:.0f} |", flush=True)
    del a, w, grad
