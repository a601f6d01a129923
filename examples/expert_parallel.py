"""Expert parallelism on moe_fp8_ext: an MoE layer whose experts are split over the
ranks, trained in FP8.

    torchrun --nproc-per-node=2 examples/expert_parallel.py            # GPUs (NCCL)
    torchrun --nproc-per-node=2 examples/expert_parallel.py --device cpu   # gloo
    torchrun --nproc-per-node=2 examples/expert_parallel.py --recipe fp8_blockwise --fp8-dispatch
    torchrun --nproc-per-node=2 examples/expert_parallel.py --fp8-dispatch --compile   # torch.compile, fullgraph

Per step: route every token to its top-k experts, send each (token, expert) row to
the rank that owns the expert (torch.distributed all-to-all), reorder the rows that
arrive rank-major into padded expert-major groups (``permute_and_pad``), run the
experts' SwiGLU FFN (``moe_fp8_ext.experts``), undo the reordering (``unpermute``),
send the rows back and combine them with the routing weights (``moe_fp8_ext.dispatch``'s
``gather`` and ``combine``: one pass over the rows each way). With ``--fp8-dispatch``
the rows travel as the first GEMM's fp8 operand (``moe_fp8_ext.dispatch``: each token
quantized once, about half the bytes); the combine stays bf16.

The run then checks itself: every rank rebuilds the same layer in one process (all
experts, all ranks' tokens, from the same seed) and compares its outputs and the
gradients of its input, its experts and the router with that single-process run.
Exit status 1 on a mismatch.

The only host syncs are the all-to-all split sizes (torch.distributed needs them as
Python ints); the permutation and the FP8 experts never sync.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

import moe_fp8_ext
from moe_fp8_ext.dispatch import combine, fp8_dispatch, gather
from moe_fp8_ext.ops.token_groups import padded_rows, permute_indices

ALIGN = 16


def make_layer(args, device, dtype):
    """Router and all experts' weights, identical on every rank (one seed)."""
    g = torch.Generator().manual_seed(args.seed)
    experts = args.experts_per_rank * args.world

    def init(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype).to(device)

    return {
        "gate": init(experts, args.dim).float(),
        "w1": init(experts, args.hidden, args.dim),
        "w3": init(experts, args.hidden, args.dim),
        "w2": init(experts, args.dim, args.hidden),
    }


def route(x, gate, topk):
    """The (token, expert) pairs stably sorted by expert: each pair's token (int32) and
    routing weight, and the tokens each expert gets."""
    scores = torch.softmax(x.float() @ gate.t(), dim=-1)
    weights, experts = torch.topk(scores, topk, dim=-1)
    flat = experts.flatten()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(gate.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return (order // topk).to(torch.int32), weights.flatten()[order], counts


def swiglu(x, offs, w1, w3, w2, recipe):
    return moe_fp8_ext.experts(x, w1, w3, w2, offs, recipe=recipe)


def moe_expert_parallel(x, layer, local, args):
    """The EP forward on this rank: x (T, D) its tokens, local its experts' weights."""
    world, epr, topk = args.world, args.experts_per_rank, args.topk
    token, scores, counts = route(x, layer["gate"], topk)
    # counts is destination-rank-major (expert e lives on rank e // epr): exchange it.
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    send_splits = counts.view(world, epr).sum(1).tolist()  # host-sync-ok: all-to-all split sizes
    recv_splits = recv_counts.view(world, epr).sum(1).tolist()  # host-sync-ok: all-to-all split sizes
    received = sum(recv_splits)
    # Rows arrive rank-major: (rank 0: e0, e1, ...), (rank 1: e0, e1, ...).
    if args.fp8_dispatch:  # each token quantized once; its rows sent as fp8 + scales
        idx, _, ends = permute_indices(recv_counts, epr, world, ALIGN, padded_rows(received, epr, ALIGN))
        xp = fp8_dispatch(x, token, moe_fp8_ext.get_recipe(args.recipe), None, send_splits, recv_splits, perm=idx)
    else:
        rows = gather(x, token)  # (T·k, D), sorted by global expert
        recv = all_to_all_single_autograd(rows, recv_splits, send_splits, dist.group.WORLD)
        xp, ends, idx = moe_fp8_ext.permute_and_pad(recv, recv_counts, epr, world, ALIGN)
    yp = swiglu(xp, ends, local["w1"], local["w3"], local["w2"], args.recipe)
    y_recv = moe_fp8_ext.unpermute(yp, idx, received)
    y_rows = all_to_all_single_autograd(y_recv, send_splits, recv_splits, dist.group.WORLD)
    return combine(y_rows, scores, token, x.shape[0])


def moe_single_process(x, layer, args):
    """The same layer in one process: all experts, all tokens. With --fp8-dispatch the
    experts read the dispatched values: the rows quantized as the first GEMM's operand
    and dequantized (the gradient passes straight through to x)."""
    token, scores, counts = route(x, layer["gate"], args.topk)
    rows = gather(x, token)
    if args.fp8_dispatch:
        recipe = moe_fp8_ext.get_recipe(args.recipe)
        q, s = recipe.quantize(rows.detach(), recipe.default_fp8_dtype(x.device))[0]
        s = s.repeat_interleave(128, dim=1)[:, :q.shape[1]] if s.dim() == 2 else s[:, None]
        rows = rows + ((q.float() * s).to(rows.dtype) - rows).detach()
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    y = swiglu(rows, offs, layer["w1"], layer["w3"], layer["w2"], args.recipe)
    return combine(y, scores, token, x.shape[0])


def rel_err(got, want):
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 4096 on GPU, 64 on CPU)")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe", default="fp8_rowwise")
    p.add_argument("--fp8-dispatch", action="store_true", help="send the routed tokens in fp8 (moe_fp8_ext.dispatch)")
    p.add_argument("--tol", type=float, default=1e-2, help="max relative error (norm) against one process")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile the EP forward (fullgraph; the split sizes as unbacked ints)")
    args = p.parse_args()
    gpu = args.device == "cuda"
    args.tokens = args.tokens or (4096 if gpu else 64)
    args.dim = args.dim or (1024 if gpu else 64)
    args.hidden = args.hidden or (2048 if gpu else 128)

    dist.init_process_group("nccl" if gpu else "gloo")
    rank, args.world = dist.get_rank(), dist.get_world_size()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32  # gloo: fp32 rows; the fp8 math is the same

    layer = make_layer(args, device, dtype)
    g = torch.Generator().manual_seed(args.seed + 1)
    x_all = torch.randn(args.world * args.tokens, args.dim, generator=g).to(dtype).to(device)
    grad_all = torch.randn(args.world * args.tokens, args.dim, generator=g).to(dtype).to(device)
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)
    local_experts = slice(rank * args.experts_per_rank, (rank + 1) * args.experts_per_rank)

    # Expert parallel: this rank's tokens and experts.
    x = x_all[mine].clone().requires_grad_()
    gate = layer["gate"].clone().requires_grad_()
    local = {k: layer[k][local_experts].clone().requires_grad_() for k in ("w1", "w3", "w2")}
    forward = moe_expert_parallel
    if args.compile:  # (as torchtitan compiles its blocks: .tolist() of the split sizes traced)
        torch._dynamo.config.capture_scalar_outputs = True
        forward = torch.compile(moe_expert_parallel, backend=args.compile, fullgraph=True)
    out = forward(x, {"gate": gate}, local, args)
    out.backward(grad_all[mine])
    dist.all_reduce(gate.grad)  # the router is replicated: sum its gradient over ranks

    # One process: every expert, every rank's tokens.
    xr = x_all.clone().requires_grad_()
    full = {k: v.clone().requires_grad_() for k, v in layer.items()}
    out_ref = moe_single_process(xr, full, args)
    out_ref.backward(grad_all)

    checks = {
        "output": rel_err(out, out_ref[mine]),
        "grad x": rel_err(x.grad, xr.grad[mine]),
        "grad router": rel_err(gate.grad, full["gate"].grad),
        **{f"grad {k}": rel_err(local[k].grad, full[k].grad[local_experts]) for k in ("w1", "w3", "w2")},
    }
    worst = torch.tensor(max(checks.values()), device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    line = ", ".join(f"{k} {v:.2e}" for k, v in checks.items())
    backend = moe_fp8_ext.grouped_mm_backend(device, args.recipe)
    print(f"rank {rank}/{args.world} ({args.recipe}: {backend}, {args.tokens} tokens, "
          f"{args.experts_per_rank} experts/rank, top-{args.topk}): relative error vs one process: {line}", flush=True)
    ok = worst.item() <= args.tol
    if rank == 0:
        print(f"expert_parallel: {'OK' if ok else 'MISMATCH'} (worst {worst.item():.2e}, tolerance {args.tol:.0e})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown: on the CPU (gloo), exit-time destructors after a
    # compiled run have aborted a rank ("terminate called without an active exception") after the result.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
