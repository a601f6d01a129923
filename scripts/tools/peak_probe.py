"""The experts layer's peak memory on the CPU: the most tensor-storage bytes alive at once
over one forward + backward (fresh gradients, as bench_experts' "fresh" step), and what
is alive then. The GEMMs are not run (each returns zeros of its output's shape) and
fp8_blockwise's activation dual reads once as on a GPU, so the peak is the GPU's minus
what the GPU ops allocate inside: it gave bench_experts' peak_mib within 3 MiB for
fp8_blockwise and fp8_rowwise (H100, 4ff16d4) and for a lifetime bug (H200, e8cb0a6).

    PYTHONPATH=<tree> python scripts/tools/peak_probe.py [--recipe fp8_blockwise]
        [--shape 32768,7168,2048,8] [--top 20] [--real-gemms]

Prints peak − inputs in MiB (bench_experts' peak_mib), where the peak was reached and
the largest storages alive then, each with the op and the line of moe_fp8_ext that made it.
"""

import argparse
import os
import traceback
import types
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import moe_fp8_ext
import moe_fp8_ext.blockwise as _bw
from moe_fp8_ext.recipes import get_recipe

MiB = 2**20


class Live:
    """Storages alive (by data pointer), their bytes, and the snapshot at the most bytes."""

    def __init__(self):
        self.alive, self.now, self.peak, self.at, self.snapshot = {}, 0, 0, None, []
        self.paused = 0

    def add(self, t, what):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or ptr in self.alive:
            return
        self.alive[ptr] = (size, f"{what} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}")
        self.now += size
        weakref.finalize(storage, self._drop, ptr)
        if self.now > self.peak:
            self.peak, self.at = self.now, what
            self.snapshot = sorted(self.alive.values(), key=lambda v: -v[0])

    def _drop(self, ptr):
        self.now -= self.alive.pop(ptr)[0]


def caller():
    """The innermost line of moe_fp8_ext on the stack."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if os.sep + "moe_fp8_ext" + os.sep in frame.filename:
            return f"{frame.filename.split(os.sep + 'moe_fp8_ext' + os.sep)[-1]}:{frame.lineno}"
    return "autograd"


class Track(TorchDispatchMode):
    def __init__(self, live):
        super().__init__()
        self.live = live

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.live.paused:
            for t in tree_flatten(out)[0]:
                self.live.add(t, f"{func.__name__} @ {caller()}")
        return out


def count_gemms(recipe, live, fake=True):
    """The recipe's GEMMs untracked inside, their outputs counted; ``fake``: zeros of the
    output's shape (no CPU math)."""
    def first(op):
        return op if isinstance(op, torch.Tensor) else op[0]

    cls = type(recipe)
    shapes = {"mm_2d3d": lambda a, b, offs: (a.shape[0], b.shape[-1]),
              "mm_2d2d": lambda g, a, offs: (offs.numel(), g.shape[1], a.shape[1])}  # (Mp, N), (Mp, K) colwise
    for name, shape_of in shapes.items():
        def gemm(self, a, b, offs, out_dtype, backend, real=getattr(cls, name), shape_of=shape_of):
            live.paused += 1
            try:
                out = (torch.zeros(shape_of(first(a), first(b), offs), dtype=out_dtype) if fake
                       else real(self, a, b, offs, out_dtype, backend))
            finally:
                live.paused -= 1
            live.add(out, f"GEMM @ {caller()}")
            return out
        setattr(cls, name, gemm)


def gpu_reads_once():
    """act_dual_reads_once as on a GPU: its rule, asked of x on a CUDA device."""
    rule = _bw.act_dual_reads_once

    def reads_once(x):
        return rule(types.SimpleNamespace(device=torch.device("cuda"), dtype=x.dtype, dim=x.dim, shape=x.shape,
                                          stride=x.stride, storage_offset=x.storage_offset))
    _bw.act_dual_reads_once = reads_once


def router_offs(m, e, seed=0):
    """Unaligned router-like group ends, an eighth of the groups empty."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(e, generator=g) ** 2
    w[torch.randperm(e, generator=g)[: max(1, e // 8)]] = 0
    counts = (w / w.sum() * m).floor().long()
    counts[torch.argmax(counts)] += m - counts.sum()
    return torch.cumsum(counts, 0).to(torch.int32)


def probe(recipe_name, m, dim, hidden, e, fake=True):
    """(peak − inputs in bytes, where, the largest storages alive at the peak). Patches
    the recipe's class: once a process."""
    recipe = get_recipe(recipe_name)
    live = Live()
    count_gemms(recipe, live, fake)
    gpu_reads_once()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, dim, generator=g).bfloat16().requires_grad_()
    w1, w3 = ((torch.randn(e, hidden, dim, generator=g) * dim**-0.5).bfloat16().requires_grad_() for _ in range(2))
    w2 = (torch.randn(e, dim, hidden, generator=g) * hidden**-0.5).bfloat16().requires_grad_()
    offs, grad = router_offs(m, e), torch.randn(m, dim, generator=g).bfloat16()
    moe_fp8_ext.experts(x, w1, w3, w2, offs, recipe=recipe).backward(grad)  # (first-call work, untracked)
    for t in (x, w1, w3, w2):
        t.grad = None
    for name, t in (("x", x), ("w1", w1), ("w3", w3), ("w2", w2), ("offs", offs), ("grad", grad)):
        live.add(t, "input " + name)
    inputs = live.now
    with Track(live):
        out = moe_fp8_ext.experts(x, w1, w3, w2, offs, recipe=recipe)
        out.backward(grad)  # (out alive through the backward, as in the benchmark's step)
    return live.peak - inputs, live.at, live.snapshot


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="fp8_blockwise")
    p.add_argument("--shape", default="2048,512,256,8", help="tokens,dim,hidden,experts")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--real-gemms", action="store_true", help="run the GEMMs (the CPU emulation: slow at big shapes)")
    args = p.parse_args()
    m, dim, hidden, e = map(int, args.shape.split(","))
    peak, at, alive = probe(args.recipe, m, dim, hidden, e, fake=not args.real_gemms)
    print(f"{args.recipe} {args.shape}: peak - inputs {peak / MiB:.1f} MiB ({peak} bytes), reached at {at}")
    for size, what in alive[: args.top]:
        print(f"  {size / MiB:10.2f} MiB  {what}")


if __name__ == "__main__":
    main()
