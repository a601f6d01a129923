"""FSDP2 (plain ``fully_shard``) over moe_fp8_ext.GroupedExperts with the fp8 all-gather,
against the same layer gathered in bf16, on every rank (torchrun; gloo or NCCL).

    torchrun --nproc-per-node=2 tests/fsdp_fp8_all_gather.py [--device cuda] [--recipe fp8_rowwise]

Checks, exit status 1 on a failure:
- the gathered fp8 and scales are, bit for bit, the whole weight's quantization (cast to
  the mixed-precision param_dtype first, as FSDP2 casts it); the backward's gathers carry
  the transposed operands;
- outputs and every gradient (x, w1, w3, w2) equal the bf16-gather layer's bit for bit,
  step after step of SGD (no stale weight), with reshard_after_forward True and False,
  with activation checkpointing (plain, reentrant, selective: the recompute reads the
  forward's operands), and over two micro-batches with resharding after
  backward off;
- the state_dict holds the high-precision shards as plain tensors (torch.save with
  weights_only loads, a distributed checkpoint round trip), and a load_state_dict is seen,
  also one that assigns (set_model_state_dict into a meta-device layer);
- weights sharded on their rows (Shard(1)): the same operands and training bits;
- under torch.compile (fullgraph too) the same, the backward's gathers carrying the
  forward's operands;
- the set-up errors: after fully_shard, experts not divisible by the ranks, w1 and w3
  sharded on different dims, and fp8_blockwise rows sharded off its 128-row tiles (by
  FSDP2, or by tensor parallelism).
fp8_blockwise bit for bit everywhere; fp8_rowwise where a gather serves one pass.
"""

import argparse
import io
import os
import sys
import tempfile

import torch
import torch.distributed as dist

# A second rounding to fp8 (fp8_rowwise quantizing its dequantized weights again):
# outputs and gradients within this (relative norm) of the one-rounding run.
INEXACT_RTOL = 1e-3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--recipe", choices=["fp8_blockwise", "fp8_rowwise"], default="fp8_blockwise")
    args = p.parse_args()
    import moe_fp8_ext
    from moe_fp8_ext import fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    gpu = args.device == "cuda"
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    E, DIM, HIDDEN = 2 * world, 144, 256  # (dim: partial 128-wide tiles)
    failures = []

    def check(ok, what):
        if not ok:
            failures.append(what)
            print(f"rank {rank}: FAILED {what}", flush=True)

    class Block(torch.nn.Module):  # (a root above the experts, as in a model: FSDP2 keeps a root unsharded)
        def __init__(self, experts, ac):
            super().__init__()
            self.experts, self.ac = experts, ac

        def forward(self, x, counts):
            if not self.ac:
                return self.experts(x, counts)
            # activation checkpointing ("reentrant", "selective" or plain): the backward recomputes the forward
            from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

            kw = dict(use_reentrant=self.ac == "reentrant")
            if self.ac == "selective":  # (torchtitan's default form: it replays the forward's ops)
                kw["context_fn"] = lambda: create_selective_checkpoint_contexts(
                    lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
            return checkpoint(self.experts, x, counts, **kw)

    def layer(fp8, ac=False, dims=(DIM, HIDDEN, E), **kw):
        torch.manual_seed(0)
        m = moe_fp8_ext.GroupedExperts(*dims, recipe=args.recipe, dtype=torch.float32, device=device)
        if fp8:
            fsdp.fp8_all_gather(m)
        fully_shard(m, mesh=mesh, mp_policy=policy, **kw)
        block = Block(m, ac)
        fully_shard(block, mesh=mesh, mp_policy=policy)
        return block

    # (each quantization of a gather: whether for the backward (transposed), whether of [W1; W3])
    gathers, rowwise = [], args.recipe == "fp8_rowwise"
    quantize_shard = fsdp._quantize_shard
    fsdp._quantize_shard = lambda *a, **k: gathers.append(
        (a[2] if len(a) > 2 else False, k.get("whole", False))) or quantize_shard(*a, **k)

    # The gathered operands: the whole weight's, bit for bit.
    m = layer(True).experts
    full = {n: p.full_tensor() for n, p in m.named_parameters()}
    m.unshard()
    r = moe_fp8_ext.get_recipe(args.recipe)
    for n in ("w1", "w3", "w2"):
        g = getattr(m, n)
        q, s = quantize_shard(r, full[n].bfloat16())
        gq, gs = g.storage(False)
        check(isinstance(g, fsdp.GatheredWeight) and torch.equal(gq.view(torch.uint8), q.view(torch.uint8))
              and torch.equal(gs, s), f"gathered {n} = quantized whole weight")
    m.reshard()
    sd = m.state_dict()
    check(all(torch.equal(sd[n].full_tensor(), full[n]) and type(sd[n].to_local()) is torch.Tensor
              and sd[n].dtype == torch.float32 for n in full), "state_dict holds the fp32 shards, plain tensors")
    buf = io.BytesIO()
    torch.save({n: v.to_local() for n, v in sd.items()}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    check(all(torch.equal(back[n], sd[n].to_local()) for n in sd), "torch.save / torch.load(weights_only=True)")
    # A distributed checkpoint round trip into another fp8-gathered layer.
    import torch.distributed.checkpoint as dcp

    where = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(where)
    dcp.save(m.state_dict(), checkpoint_id=where[0])
    fresh = layer(True).experts
    with torch.no_grad():
        for p_ in fresh.parameters():
            p_.to_local().zero_()
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=where[0])
    fresh.load_state_dict(sd)
    check(all(torch.equal(p_.full_tensor(), full[n]) for n, p_ in fresh.named_parameters()),
          "dcp.save / dcp.load into an fp8-gathered layer")
    # A meta-device layer loaded by set_model_state_dict (assign=True): the loaded weights keep the fp8 all-gather.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    with torch.device("meta"):
        meta = moe_fp8_ext.GroupedExperts(DIM, HIDDEN, E, recipe=args.recipe, dtype=torch.float32)
    fsdp.fp8_all_gather(meta)
    fully_shard(meta, mesh=mesh, mp_policy=policy)
    set_model_state_dict(meta, dict(full) if rank == 0 else {},  # (it replaces the values it is given)
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    x0 = torch.randn(7 * E, DIM, device=device).bfloat16()
    c0 = torch.tensor([3, 11] * (E // 2), device=device)
    check(all(isinstance(p_._local_tensor, fsdp.ShardedWeight) and torch.equal(p_.full_tensor(), full[n])
              for n, p_ in meta.named_parameters()) and torch.equal(meta(x0, c0), fresh(x0, c0)),
          "set_model_state_dict into a meta-device fp8-gathered layer")

    g = torch.Generator(device=device).manual_seed(100 + rank)

    def close(a, b, exact):
        if exact:
            return torch.equal(a, b)
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item() < INEXACT_RTOL

    def train(pairs, steps=3, micro=1, name="", exact=True):
        opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in pairs]
        inner = getattr(pairs[0], "experts", pairs[0])
        dim, experts = inner.dim, inner.num_experts
        for step in range(steps):
            for mb in range(micro):
                last = mb == micro - 1
                tokens = 301 + 17 * mb
                x = torch.randn(tokens, dim, device=device, generator=g).bfloat16()
                # (5 rows past the groups)
                expert = torch.randint(0, experts, (tokens - 5,), device=device, generator=g)
                counts = torch.bincount(expert.masked_fill(expert == 1, 0), minlength=experts)  # (expert 1: none)
                grad = torch.randn(tokens, dim, device=device, generator=g).bfloat16()
                res = []
                for m in pairs:
                    if micro > 1:
                        m.set_reshard_after_backward(last)
                        m.set_requires_gradient_sync(last)
                    xi = x.clone().requires_grad_()
                    out = m(xi, counts)
                    out.backward(grad)
                    res.append((out, xi.grad))
                check(all(close(a, b, exact) for a, b in zip(*res)), f"{name} step {step} micro {mb}: output, grad x")
            grads = [[p.grad.full_tensor() for p in m.parameters()] for m in pairs]
            check(all(close(a, b, exact) for a, b in zip(*grads)), f"{name} step {step}: weight gradients")
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)

    gathers.clear()
    train([layer(False), layer(True)], name="reshard_after_forward=True")
    # (W1's gather quantizes [W1; W3], W3's nothing: two quantizations a gather)
    check(len(gathers) == 2 * 2 * 3 and sum(t for t, _ in gathers) == 2 * 3
          and sum(w for _, w in gathers) == 2 * 3,
          f"gathers: [W1; W3] and W2, forward and backward (transposed), 3 steps; got {gathers}")
    gathers.clear()
    # One gather for both passes: fp8_rowwise quantizes the dequantized weights again
    # for the other pass (fp8_blockwise transposes them, the same bits).
    exact = args.recipe == "fp8_blockwise"
    train([layer(False, reshard_after_forward=False), layer(True, reshard_after_forward=False)],
          name="reshard_after_forward=False", exact=exact)
    check(len(gathers) == 2 * 3, f"gathers: [W1; W3] and W2 once a step; got {len(gathers)}")
    gathers.clear()
    # (the backward's gather carries the forward's operands again, which the recompute reads as the
    # forward did; the backward transposes them or, fp8_rowwise, quantizes them again)
    for ac in ("plain", "reentrant", "selective"):
        train([layer(False, ac=ac), layer(True, ac=ac)], name=f"activation checkpointing ({ac})", exact=exact)
        check(len(gathers) == 2 * 2 * 3 and not any(t for t, _ in gathers),
              f"gathers with activation checkpointing ({ac}), none transposed: {gathers}")
        gathers.clear()
    # Reentrant AC, two forwards before their backwards: each backward's gather still carries the
    # forward's operands (the first recompute marks them again for the second).
    blk = layer(True, ac="reentrant")
    counts2 = torch.full((E,), 48 // E, device=device)
    outs = [blk(torch.randn(50, DIM, device=device, generator=g).bfloat16().requires_grad_(), counts2)
            for _ in range(2)]
    for o in reversed(outs):
        o.float().sum().backward()
    check(len(gathers) == 2 * 4 and not any(t for t, _ in gathers),
          f"reentrant AC, two forwards first: gathers, none transposed: {gathers}")
    gathers.clear()
    train([layer(False), layer(True)], micro=2, name="micro-batches", exact=exact)
    # (the first micro-batch's forward and backward; the second's backward after its
    # forward resharded)
    check(len(gathers) == 2 * 3 * 3, f"gathers: [W1; W3] and W2, 3 a micro-batch step; got {len(gathers)}")
    # dim above twice the hidden size: [W1; W3]'s fp8_rowwise row scales padded to dim for the gather
    train([layer(False, dims=(608, 128, E)), layer(True, dims=(608, 128, E))], steps=2, name="dim > 2 hidden")

    # Rows sharded (Shard(1), torchtitan's placement where the ranks outnumber the experts):
    # FSDP2 joins the fp8 rank shards along the rows; the scales are gathered beside it,
    # fp8_rowwise's column scales from amaxes reduced over the ranks.
    from torch.distributed.tensor import Shard

    rows = (128 * world, 128 * world) if args.recipe == "fp8_blockwise" else (DIM, HIDDEN)
    by_rows = dict(dims=(*rows, max(world // 2, 1)), shard_placement_fn=lambda p_: Shard(1))
    m = layer(True, **by_rows).experts
    full = {n: p_.full_tensor() for n, p_ in m.named_parameters()}
    check(all(p_.placements == (Shard(1),) for p_ in m.parameters()), "rows sharded: Shard(1) placements")
    m.unshard()
    for n in ("w1", "w3", "w2"):
        q, s = quantize_shard(r, full[n].bfloat16())
        gq, gs = getattr(m, n).storage(False)
        check(torch.equal(gq.view(torch.uint8), q.view(torch.uint8))
              and torch.equal(gs, s), f"rows sharded: gathered {n} = quantized whole weight")
    m.reshard()
    gathers.clear()
    reduced, takes = [], []
    reduce_amax, take = fsdp._reduce_amax, fsdp._Ahead.take
    fsdp._reduce_amax = lambda a, group, async_op=False: reduced.append(async_op) or reduce_amax(a, group, async_op)
    fsdp._Ahead.take = lambda self, kind, shards: (lambda got: takes.append((kind, got is not None)) or got)(
        take(self, kind, shards))
    train([layer(False, **by_rows), layer(True, **by_rows)], name="rows sharded")
    # (fp8_rowwise: W1's and W3's backward gathers make their joint operand once a step)
    made_once = takes.count(("operand", True)) == takes.count(("operand", False)) == 3 * rowwise
    check(made_once, f"rows sharded: joint backward operand made once a backward: {takes}")
    fsdp._Ahead.take = take
    # (fp8_rowwise: the first backward reduces the column amaxes of [W1; W3] and of W2 itself;
    # after it, each forward gather starts them and the backward waits on them)
    check(reduced == ([False] * 2 + [True] * 4) * rowwise, f"rows sharded: column amax reductions {reduced}")
    fsdp._reduce_amax = reduce_amax
    # (fp8_blockwise: the forward's tiles, transposed by the layer for the backward)
    backward = 3 * 3 if args.recipe == "fp8_rowwise" else 0
    check(len(gathers) == 3 * 2 * 3 and sum(t for t, _ in gathers) == backward and not any(w for _, w in gathers),
          f"rows sharded: gathers {gathers}")
    train([layer(False, ac="plain", reshard_after_forward=False, **by_rows),
           layer(True, ac="plain", reshard_after_forward=False, **by_rows)], steps=2, micro=2,
          name="rows sharded, one gather a step, activation checkpointing", exact=exact)
    train([layer(False, ac="selective", **by_rows), layer(True, ac="selective", **by_rows)], steps=2,
          name="rows sharded, activation checkpointing (selective)", exact=exact)

    # The column amaxes reduced over the ranks: the largest |value| anywhere, NaN where any
    # rank has one (over an Inf elsewhere), in the weights' dtype.
    col = torch.zeros(1, 3, 4, device=device, dtype=torch.bfloat16)
    col[0, rank % 3, 0] = -(rank + 1.5)
    col[0, 0, 1] = float("inf") if rank == 0 else 2.0
    col[0, 1, 1] = float("nan") if rank == world - 1 else 1.0
    col[0, 2, 2] = float("-inf") if rank == world - 1 else -3.0
    got = fsdp._column_amax([col[:, :2], col[:, 2:]], mesh.get_group())
    want = torch.tensor([[[world + 0.5, float("nan"), float("inf"), 0.0]]], dtype=torch.bfloat16)
    check(got.dtype == torch.bfloat16 and torch.equal(torch.isnan(got.cpu()), torch.isnan(want))
          and torch.equal(got.cpu().nan_to_num(), want.nan_to_num()), f"reduced column amaxes: {got.tolist()}")

    # torch.compile: the backward's gathers carry the forward's operands again (none transposed),
    # which the backward transposes (fp8_blockwise: the eager bits) or quantizes again from their
    # dequantized values (fp8_rowwise: a second rounding). Record 059.
    backend = "inductor" if gpu else "aot_eager"
    gathers.clear()
    train([layer(True), torch.compile(layer(True), backend=backend)], steps=2, name="torch.compile", exact=exact)
    check(len(gathers) == 2 * 2 * 2 * 2 and sum(t for t, _ in gathers) == 2 * 2,
          f"gathers under torch.compile: the eager layer's backward ones only transposed; got {gathers}")
    # (fullgraph: the experts alone, FSDP2's root, which keeps its weights for the backward)
    train([layer(True).experts, torch.compile(layer(True).experts, backend=backend, fullgraph=True)], steps=2,
          name="torch.compile, fullgraph", exact=exact)

    # A load_state_dict (or checkpoint load) into the shards is what the next gather sees.
    a, b = layer(False).experts, layer(True).experts
    torch.manual_seed(1)
    new = moe_fp8_ext.GroupedExperts(DIM, HIDDEN, E, recipe=args.recipe, dtype=torch.float32, device=device)
    for m in (a, b):
        sd = m.state_dict()
        for n, v in new.state_dict().items():
            sd[n].to_local().copy_(v.chunk(world)[rank])
        m.load_state_dict(sd)
    train([a, b], steps=1, name="after load_state_dict")
    x = torch.randn(64, DIM, device=device).bfloat16()
    counts = torch.full((E,), 64 // E, device=device)
    torch.manual_seed(2)
    check(torch.equal(a(x, counts), b(x, counts)), "after load_state_dict: outputs")

    # Set-up errors.
    try:
        fsdp.fp8_all_gather(a)
        check(False, "fp8_all_gather after fully_shard raises")
    except RuntimeError as e:
        check("before fully_shard" in str(e), "fp8_all_gather after fully_shard: message")
    if world > 1:
        torch.manual_seed(0)
        odd = moe_fp8_ext.GroupedExperts(DIM, HIDDEN, world + 1, recipe=args.recipe, dtype=torch.float32,
                                         device=device)
        fsdp.fp8_all_gather(odd)
        fully_shard(odd, mesh=mesh, mp_policy=policy)
        try:
            odd(torch.randn(8, DIM, device=device).bfloat16(), torch.full((world + 1,), 1, device=device))
            check(False, "experts not divisible by the ranks raises")
        except ValueError as e:
            check("multiple of the shard group's size" in str(e), "experts not divisible: message")

    if world > 1:  # (W1's gather carries [W1; W3] only where both are sharded alike)
        torch.manual_seed(0)
        mixed = moe_fp8_ext.GroupedExperts(DIM, 128 * world, world, recipe=args.recipe, dtype=torch.float32,
                                           device=device)
        fsdp.fp8_all_gather(mixed)
        w3 = mixed.w3
        fully_shard(mixed, mesh=mesh, mp_policy=policy, shard_placement_fn=lambda p_: Shard(1 if p_ is w3 else 0))
        try:
            mixed(torch.randn(8, DIM, device=device).bfloat16(), torch.full((world,), 1, device=device))
            check(False, "w1 and w3 sharded on different dims raises")
        except ValueError as e:
            check("w1 and w3 sharded alike" in str(e), f"w1 and w3 sharded on different dims: message {e}")

    if world > 1 and args.recipe == "fp8_blockwise":
        odd = layer(True, dims=(DIM, 128 * world, 1), shard_placement_fn=lambda p_: Shard(1))
        try:
            odd(torch.randn(8, DIM, device=device).bfloat16(), torch.full((1,), 8, device=device))
            check(False, "fp8_blockwise rows sharded off 128-row tiles raises")
        except ValueError as e:
            check("multiple of 128 for fp8_blockwise" in str(e), "rows sharded off 128-row tiles: message")

    if world > 1 and args.recipe == "fp8_blockwise":  # (tensor parallelism: each rank's part of the hidden size)
        from torch.distributed.tensor import distribute_tensor

        # (parts of 128 rows but the last: every rank must raise, or the others hang at the first gather)
        tp = moe_fp8_ext.GroupedExperts(DIM, 128 * world - 2, E, recipe=args.recipe, device=device)
        for n, d in (("w1", 1), ("w3", 1), ("w2", 2)):
            setattr(tp, n, torch.nn.Parameter(distribute_tensor(getattr(tp, n).detach(), mesh, [Shard(d)])))
        try:
            fsdp.fp8_all_gather(tp)
            check(False, "fp8_blockwise with tensor-parallel parts off 128-row tiles raises")
        except ValueError as e:
            check(f"over {world} tensor-parallel rank(s)" in str(e), f"tensor-parallel parts: message {e}")

    flag = torch.tensor([len(failures)], device=device)
    dist.all_reduce(flag)
    if rank == 0:
        print(f"fsdp_fp8_all_gather on {world} ranks ({device.type}): " + ("OK" if flag.item() == 0 else "FAILED"),
              flush=True)
    return 1 if flag.item() else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # (no teardown: gloo's destructors have aborted processes at exit)
