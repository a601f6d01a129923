"""FSDP2 (``fully_shard``) over moe_fp8_ext's SwiGLU experts layer, trained in FP8.

    torchrun --nproc-per-node=4 examples/fsdp2_experts.py                # GPUs (NCCL)
    torchrun --nproc-per-node=4 examples/fsdp2_experts.py --device cpu   # gloo

The usual mixed-precision set-up: fp32 master weights sharded over the ranks, all-gathered
as bf16 for the forward and backward (``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``), gradients reduce-scattered in fp32. Each rank trains on its own
tokens, two gradient-accumulation micro-batches a step, with weight reuse on: the
quantized weights are made once a step, keyed on the sharded parameters.

The run checks itself against an unsharded copy on every rank that does the same math
by hand: bf16 weights cast from the fp32 master, each micro-batch's bf16 gradients
accumulated in fp32, summed over the ranks in fp32, divided by the ranks, and the same
SGD step. Step 0's output must
be bit for bit the copy's (same weights, same inputs). The two reductions add the same
fp32 gradients in a different order, so later weights agree to fp32 rounding
(relative 1e-5 here) and later outputs to a relative 1e-3 (a bf16 or fp8 rounding of a
weight may flip). Every step must hit the weight cache. Exit status 1 on a mismatch.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

WEIGHT_RTOL = 1e-5  # fp32 sums in another order, over a few SGD steps
OUT_RTOL = 1e-3  # (norm of the difference over the norm) a few weights' roundings flipped


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()  # host-sync-ok: the check


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank and micro-batch (default 4096 on GPUs, 96 on the CPU)")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--recipe", default="fp8_rowwise")
    args = p.parse_args()

    import moe_fp8_ext
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    tokens = args.tokens or (4096 if gpu else 96)
    dim, hidden = args.dim or (1024 if gpu else 64), args.hidden or (512 if gpu else 32)

    torch.manual_seed(0)  # the same initial weights on every rank
    master = moe_fp8_ext.GroupedExperts(dim, hidden, args.experts, recipe=args.recipe, dtype=torch.float32,
                                        device=device)
    ref = moe_fp8_ext.GroupedExperts(dim, hidden, args.experts, recipe=args.recipe, dtype=torch.bfloat16,
                                     device=device)
    layer = moe_fp8_ext.GroupedExperts(dim, hidden, args.experts, recipe=args.recipe, reuse_weights=True,
                                       dtype=torch.float32, device=device)
    layer.load_state_dict(master.state_dict())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(layer, mesh=init_device_mesh(device.type, (world,)), mp_policy=policy)
    opt = torch.optim.SGD(layer.parameters(), lr=args.lr)
    g = torch.Generator(device=device).manual_seed(100 + rank)  # each rank its own tokens
    ok = True
    for step in range(args.steps):
        with torch.no_grad():
            for w, w_master in zip(ref.parameters(), master.parameters()):
                w.copy_(w_master)  # the bf16 compute copy of the fp32 master
        outs, grad_sums = [], [torch.zeros_like(w) for w in master.parameters()]
        for _ in range(2):  # micro-batches
            x = torch.randn(tokens, dim, device=device, generator=g).to(torch.bfloat16)
            counts = torch.full((args.experts,), tokens // args.experts, device=device, dtype=torch.int64)
            counts[-1] += tokens - int(counts.sum())  # host-sync-ok: set-up of the example
            # (the gradient of a loss averaged over the tokens: weight updates of a sane size)
            grad = (torch.randn(tokens, dim, device=device, generator=g) / tokens).to(torch.bfloat16)
            out = layer(x, counts)
            out.backward(grad)
            ref_out = ref(x, counts)
            ref_out.backward(grad)
            outs.append((out.detach(), ref_out.detach()))
            for w, grad_sum in zip(ref.parameters(), grad_sums):  # fp32 accumulation, as FSDP2's
                grad_sum += w.grad.float()
                w.grad = None
        hits = layer.weight_cache.hits
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for w_master, grad_sum in zip(master.parameters(), grad_sums):
                dist.all_reduce(grad_sum)
                w_master -= args.lr * (grad_sum / world)
        out_err = max(rel(o, r) for o, r in outs)
        exact = all(torch.equal(o, r) for o, r in outs)
        w_err = {n: rel(w.full_tensor(), w_master) for (n, w), w_master in zip(layer.named_parameters(),
                                                                                 master.parameters())}
        good = (exact if step == 0 else out_err < OUT_RTOL) and max(w_err.values()) < WEIGHT_RTOL and hits > 0
        if rank == 0:
            print(f"step {step}: outputs {'bit for bit' if exact else f'rel. diff {out_err:.1e}'}; weights after "
                  "the step, rel. diff " + ", ".join(f"{n} {v:.1e}" for n, v in w_err.items())
                  + f"; weight cache hits {hits}", flush=True)
        ok = ok and good
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag)
    failed = flag.item() != 0  # host-sync-ok: the result
    if rank == 0:
        print(f"fsdp2_experts on {world} ranks ({torch.cuda.get_device_name() if gpu else 'CPU'}, {args.recipe}): "
              + ("MISMATCH" if failed else "OK"), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown: with torch 2.13 on the CPU (gloo), exit-time destructors after
    # this FSDP2 run can abort the process (SIGABRT, "terminate called without an active exception") after the
    # result is printed. Nothing is left to flush or free.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
