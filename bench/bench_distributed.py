"""FP8 communication under torchrun: step time, bytes moved and peak memory per rank, for
bf16, fp8 with bf16 communication and fp8 with fp8 communication, and a paper model of
the bytes at 64-1024 GPUs.

    torchrun --nproc-per-node=2 bench/bench_distributed.py
    torchrun --nproc-per-node=2 bench/bench_distributed.py --device cpu --tokens 512 --dim 256 \\
        --hidden 256 --experts 8 --steps 2 --warmup 1          # a smoke run (gloo)

One MoE layer per rank (a softmax top-k router, the SwiGLU experts of
``moe_fp8_ext.GroupedExperts``, the rows gathered and combined by ``moe_fp8_ext.dispatch``
as in a converted torchtitan MoE layer), x (tokens, dim) bf16 with a
gradient, ``loss.backward()`` and an SGD step, in two layouts:

- ``ep``: the experts split over all ranks; tokens go to their experts and back by
  all-to-all (the path of examples/expert_parallel.py). As torchtitan's EP over every
  rank: the experts in one-rank FSDP2 groups, the router data-parallel over all ranks
  (fp32 master weights, bf16 param_dtype). fp8 communication: the routed tokens sent as
  fp8 (``moe_fp8_ext.dispatch``); the combine and the backward stay bf16.
- ``fsdp``: every rank runs every expert on its own tokens; the expert weights (fp32
  master) are sharded by FSDP2 (``fully_shard``, bf16 param_dtype, fp32 reduce) and
  all-gathered for the forward and the backward. fp8 communication: the fp8 all-gather
  (``moe_fp8_ext.fsdp``). With EP over all ranks nothing is left for FSDP2 to gather,
  hence two layouts.
- ``fsdp_rows`` (not in the default ``--layouts``): ``fsdp`` with the expert weights
  sharded on their rows (``Shard(1)``, what torchtitan picks where EP x FSDP exceeds the
  experts); fp8_blockwise needs each rank's rows a multiple of 128.

With ``--curve N`` each variant, and a reference in fp32 (compute and communication),
trains N steps: each curve's largest per-step loss gap to bf16 and to fp32. bf16's own
gap to fp32 is the floor that fp8's gap to bf16 is read against.

``--recipe`` picks the fp8 recipe (fp8_blockwise, the default, or fp8_rowwise). Bytes
are per rank and step: all-to-all, the bytes a rank sends; all-gather, the bytes it
receives (its own shard included); reduce-scatter, its input. Writes
$OUT/bench_distributed_<blockwise|rowwise>_x<ranks>[_compiled].json (rank 0). ``--profile`` (CUDA)
also splits each variant's step into GPU kernel time by family (rank 0's, torch.profiler)
and writes ..._x<ranks>_profile.json instead.
"""

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = (("bf16", False), ("fp8", False), ("fp8_comm", True))  # (name, fp8 communication)
FP32 = ("fp32", False)  # the loss curves' reference: fp32 compute and communication, no fp8
# --profile's kernel families (by name) ahead of bench_experts': FSDP2's copies and casts of the
# weights and gradients, and the optimizer's foreach kernels.
DIST_FAMILIES = (("communication (NCCL)", r"nccl"),
                 ("FSDP2 copies and casts, optimizer", r"Memcpy DtoD|chunk_cat|multi_tensor_apply|bfloat16_copy"))
GPUS = (64, 128, 256, 512, 1024)
NODE = 8  # GPUs a node (NVLink inside)
INTER_NODE_GBPS = 50.0  # per GPU across nodes: one 400 Gb/s NIC a GPU (an assumption, not measured)


class Counter:
    """Bytes of every collective, by kind and label, through wrappers around
    torch.distributed's entry points (FSDP2 and the all-to-alls call them) and around
    the fp8 dispatch's functional all-to-all."""

    def __init__(self):
        from moe_fp8_ext import dispatch

        self.bytes, self.label, self.on = {}, None, False
        for name, kind in (("all_to_all_single", "a2a"), ("all_gather_into_tensor", "ag"),
                           ("all_gather_single", "ag"), ("reduce_scatter_tensor", "rs")):
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(fn, kind))
        functional = dispatch._all_to_all

        def counted(t, *args, **kwargs):
            self._count("a2a", t)
            return functional(t, *args, **kwargs)

        dispatch._all_to_all = counted

    def _count(self, kind, t):
        if self.on:
            key = f"{kind} {self.label or ('backward' if kind == 'a2a' else '')}".strip()
            self.bytes[key] = self.bytes.get(key, 0) + t.numel() * t.element_size()

    def _wrap(self, fn, kind):
        def counted(*args, **kwargs):
            out, inp = (args + (None, None))[:2]
            out, inp = kwargs.get("output_tensor", kwargs.get("output", out)), kwargs.get("input_tensor",
                                                                                        kwargs.get("input", inp))
            self._count(kind, out if kind == "ag" else inp)
            return fn(*args, **kwargs)

        return counted


def route(x, gate, topk):
    scores = torch.softmax(x.float() @ gate.float().t(), dim=-1)
    weights, experts = torch.topk(scores, topk, dim=-1)
    order = torch.argsort(experts.flatten(), stable=True)
    # (a scatter, not bincount, whose CUDA kernel syncs with the host: torchtitan's router counts without one)
    counts = torch.zeros(gate.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, experts.flatten(), torch.ones(experts.numel(), dtype=torch.int32, device=x.device))
    return weights, order, counts


class Layer(torch.nn.Module):
    def __init__(self, args, recipe, fp8_comm, layout, device, world):
        super().__init__()
        import moe_fp8_ext

        self.args, self.recipe, self.fp8_comm, self.layout, self.world = args, recipe, fp8_comm, layout, world
        self.gate = torch.nn.Parameter(torch.randn(args.experts, args.dim, device=device) * args.dim ** -0.5)
        local = args.experts // world if layout == "ep" else args.experts
        self.experts = moe_fp8_ext.GroupedExperts(args.dim, args.hidden, local, recipe=recipe, dtype=torch.float32,
                                                  device=device)  # (fp32 master weights, bf16 param_dtype)

    def forward(self, x, counter):
        from moe_fp8_ext.dispatch import combine, fp8_dispatch, gather
        from moe_fp8_ext.ops.token_groups import padded_rows, permute_indices
        from moe_fp8_ext import permute_and_pad, unpermute
        import torch.distributed.nn.functional as dist_fn

        a, k = self.args, self.args.topk
        weights, order, counts = route(x, self.gate, k)
        token, scores = (order // k).to(torch.int32), weights.flatten()[order]  # (each routed row's)
        if self.layout != "ep":
            return combine(self.experts(gather(x, token), counts), scores, token, x.shape[0])
        world, epr = self.world, a.experts // self.world
        recv_counts = torch.empty_like(counts)
        counter.label = "counts"
        dist.all_to_all_single(recv_counts, counts)
        # host-sync-ok: the all-to-all split sizes, in one copy (as torchtitan's dispatcher)
        send, recv = torch.stack([counts, recv_counts]).view(2, world, epr).sum(2).tolist()
        received = sum(recv)
        counter.label = "dispatch"
        if self.fp8_comm:
            idx, _, ends = permute_indices(recv_counts, epr, world, 16, padded_rows(received, epr, 16))
            xp = fp8_dispatch(x, token, self.experts.recipe, None, send, recv, perm=idx)
        else:
            rows = gather(x, token)
            got = dist_fn.all_to_all_single(rows.new_empty((received, a.dim)), rows, recv, send)
            xp, ends, idx = permute_and_pad(got, recv_counts, epr, world, 16)
        counts_p = torch.diff(ends, prepend=ends.new_zeros(1))
        yp = self.experts(xp, counts_p)
        counter.label = "combine"
        y_rows = dist_fn.all_to_all_single(x.new_empty((order.shape[0], a.dim)), unpermute(yp, idx, received),
                                           send, recv)
        counter.label = None
        return combine(y_rows, scores, token, x.shape[0])


def build(args, variant, layout, device, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    from moe_fp8_ext import fsdp

    name, fp8_comm = variant
    recipe = "bf16" if name in ("bf16", "fp32") else args.recipe
    torch.manual_seed(0)
    layer = Layer(args, recipe, fp8_comm, layout, device, world)
    policy = MixedPrecisionPolicy(param_dtype=torch.float32 if name == "fp32" else torch.bfloat16,
                                  reduce_dtype=torch.float32)
    if layout == "ep":  # as torchtitan's EP over every rank: the experts in one-rank FSDP2 groups (fp32 master
        # weights), the rest (the router) data-parallel over all ranks, so that every rank routes alike
        mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("ep", "dp"))
        fully_shard(layer.experts, mesh=mesh["dp"], mp_policy=policy)
        fully_shard(layer, mesh=mesh["ep"], mp_policy=policy)
    else:
        if fp8_comm:
            fsdp.fp8_all_gather(layer.experts)
        mesh = init_device_mesh(device.type, (world,))
        rows = (lambda p: Shard(1)) if layout == "fsdp_rows" else None
        fully_shard(layer.experts, mesh=mesh, mp_policy=policy, shard_placement_fn=rows)
        fully_shard(layer, mesh=mesh, mp_policy=policy)  # (a root above, as in a model)
    # (not fullgraph: FSDP2's hooks of the experts inside the root run eagerly. The fp32 reference stays
    # eager: torch 2.11's fake _grouped_mm takes bf16 only)
    if args.compile and name != "fp32":
        torch._dynamo.reset()  # (each variant compiled alone, as one model: no shapes made dynamic by another's)
        return torch.compile(layer, backend="inductor" if device.type == "cuda" else "aot_eager")
    return layer


def rel_gaps(losses, ref):
    """Each step's |loss - ref| / ref."""
    return [abs(a - b) / b for a, b in zip(losses, ref)]


def free(device):
    """Free a variant's layer before the next one is measured: FSDP2 leaves a sharded module in reference cycles,
    which only the cycle collector frees (else each later variant's peak holds the earlier ones' weights)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def curve(args, variant, layout, device, world, counter):
    """(losses, whether every rank's router is the same after them) of --curve steps of AdamW on a regression
    (fixed random targets of fresh tokens a step, the same on every variant). bf16 variants take bf16 tokens, FP32
    fp32."""
    layer = build(args, variant, layout, device, world)
    opt = torch.optim.AdamW(layer.parameters(), lr=3e-3)
    g = torch.Generator(device=device).manual_seed(7 + dist.get_rank())
    proj = torch.randn(args.dim, args.dim, device=device, generator=g) * args.dim ** -0.5
    losses = []
    for _ in range(args.curve):
        x = torch.randn(args.tokens, args.dim, device=device, generator=g)
        target = torch.tanh(x @ proj)
        loss = (layer(x if variant == FP32 else x.bfloat16(), counter).float() - target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    gate = layer.gate.full_tensor()
    first = gate.clone()
    dist.broadcast(first, 0)
    same = torch.tensor([float(torch.equal(gate, first))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    layer = opt = loss = None  # (the last loss's graph holds FSDP2's hooks, and so the layer)
    free(device)
    return losses, bool(same.item())


def tokens(args, device):
    g = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    return torch.randn(args.tokens, args.dim, device=device, generator=g).bfloat16()


def eager_bytes(args, variant, layout, device, world, counter):
    """The bytes of one step of the variant's layer built eagerly: a compiled graph's collectives run without
    the counting wrappers (the layer timed is built apart, so that it never runs eagerly)."""
    layer = build(argparse.Namespace(**{**vars(args), "compile": False}), variant, layout, device, world)
    counter.bytes.clear()
    counter.on = True
    layer(tokens(args, device).requires_grad_(), counter).float().square().mean().backward()
    counter.on = False
    layer = None
    free(device)
    return dict(counter.bytes)


def run_variant(args, variant, layout, device, world, counter):
    nbytes = eager_bytes(args, variant, layout, device, world, counter) if args.compile else None
    layer = build(args, variant, layout, device, world)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-4)
    x0 = tokens(args, device)
    gpu = device.type == "cuda"

    def step():
        x = x0.clone().requires_grad_()
        out = layer(x, counter)
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    counter.bytes.clear()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.steps):
        counter.on = i == 0 and nbytes is None  # (bytes of one step)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        if gpu:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        counter.on = False
    peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
    stats = torch.tensor([statistics.median(times), peak or 0.0], device=device, dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # (the slowest rank's step, the largest peak)
    nbytes = nbytes or dict(counter.bytes)
    profiled = None
    if args.profile:
        from common import KERNEL_FAMILIES, profile_step

        profiled = profile_step(f"{layout} {variant[0]}", step, families=DIST_FAMILIES + tuple(KERNEL_FAMILIES),
                                top=15, show=dist.get_rank() == 0)  # (rank 0 prints its top kernels)
    layer = opt = None
    free(device)
    return dict(step_ms=stats[0].item(), peak_gib=stats[1].item() if gpu else None, bytes=nbytes, profile=profiled)


def bandwidth_gbps(device, world, nbytes, kind):
    """Bus bandwidth per rank of one all-to-all or all-gather of nbytes per rank (GB/s)."""
    t = torch.empty(nbytes // world * world, dtype=torch.uint8, device=device)
    out = torch.empty_like(t) if kind == "a2a" else torch.empty(t.numel() * world, dtype=torch.uint8, device=device)
    fn = (lambda: dist.all_to_all_single(out, t)) if kind == "a2a" else (lambda: dist.all_gather_into_tensor(out, t))
    for _ in range(3):
        fn()
    times = []
    for _ in range(10):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    moved = nbytes * (world - 1) / world  # (what leaves the rank)
    return moved / statistics.median(times) / 1e9


def paper_model(args, results):
    """One layer's bytes per rank and step at 64-1024 GPUs, in two layouts: EP over
    min(N, E) ranks with FSDP2 over the rest, and EP inside a node of NODE GPUs with
    FSDP2 across nodes. What crosses nodes takes INTER_NODE_GBPS; ``vs_step`` is that
    time over the measured fp8 FSDP2 step of one layer here (above 1, communication
    bounds the step unless overlapped). FSDP2 shards whole experts where E >= EP x FSDP
    (torchtitan's rule), rows elsewhere; the fp8 all-gather does not apply
    (``all_gather_mb`` None) to padded expert shards (E/EP not a multiple of the FSDP2
    group) nor to fp8_blockwise rows off its 128-row tiles."""
    b16, e, d, h = 2, args.experts, args.dim, args.hidden
    blockwise = args.recipe == "fp8_blockwise"
    fp8_weight = 1 + (4 / 128**2 if blockwise else 4 / min(d, h))  # (fp8 + its scales, an element)
    fp8_row = 1 + (4 / 128 if blockwise else 4 / d)
    rows = args.tokens * args.topk
    step_ms = results["fsdp"]["fp8"]["step_ms"]
    out = []
    for n in GPUS:
        for ep in sorted({min(n, e), NODE}):
            edp = n // ep
            if ep * edp > e:  # (rows sharded: each rank's rows of w1/w3 (h) and w2 (d), even)
                applies = h % edp == 0 and d % edp == 0 and (
                    not blockwise or (h // edp) % 128 == 0 and (d // edp) % 128 == 0)
            else:
                applies = (e // ep) % edp == 0
            weights = 3 * d * h * (e // ep)
            cross = (ep - NODE) / ep if ep > NODE else 0.0  # (routed rows that leave the node)
            for name, w_b, row_b in (("bf16 comm", b16, b16), ("fp8 comm", fp8_weight, fp8_row)):
                ag = 2 * weights * (edp - 1) / edp * w_b if applies or w_b == b16 else None  # (forward, backward)
                a2a = rows * d * (ep - 1) / ep * (row_b + 3 * b16)  # dispatch; combine and both backward
                ms = None if ag is None else (ag + a2a * cross / ((ep - 1) / ep)) / (INTER_NODE_GBPS * 1e9) * 1e3
                out.append(dict(gpus=n, ep=ep, fsdp=edp, comm=name, all_gather_mb=None if ag is None else ag / 1e6,
                                all_to_all_mb=a2a / 1e6, inter_node_ms=ms,
                                vs_step=None if ms is None else ms / step_ms))
    return out


def profile_rows(results):
    """--profile's table: a row a layout and variant, its kernel time and a column a family (0 where none ran)."""
    fams = []
    for res in results.values():
        for r in res.values():
            fams += [f for f in r["profile"]["families"] if f not in fams]
    return [dict(layout=layout, variant=name, kernels_ms=r["profile"]["total_ms"],
                 **{f: r["profile"]["families"].get(f, 0.0) for f in fams})
            for layout, res in results.items() for name, r in res.items()]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layouts", default="ep,fsdp", help="of ep, fsdp, fsdp_rows")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1408)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--recipe", choices=["fp8_blockwise", "fp8_rowwise"], default="fp8_blockwise")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--curve", type=int, default=0, help="also train this many steps of each variant: loss curves")
    p.add_argument("--profile", action="store_true", help="also each step's GPU kernel time by family (CUDA)")
    p.add_argument("--compile", action="store_true", help="torch.compile each variant's layer")
    args = p.parse_args()
    if args.profile and args.device != "cuda":
        p.error("--profile needs --device cuda (it sums GPU kernel times)")
    if set(args.layouts.split(",")) - {"ep", "fsdp", "fsdp_rows"}:
        p.error(f"expected --layouts of ep, fsdp, fsdp_rows, got {args.layouts!r}")
    if args.compile:  # (every variant and layout compiles graphs of its own: raise, never run eagerly, at a limit)
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    gpu = args.device == "cuda"
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    if args.experts % world:
        raise SystemExit(f"bench_distributed: --experts {args.experts} must be a multiple of the {world} ranks")
    counter = Counter()
    results, rows = {}, []
    for layout in args.layouts.split(","):
        results[layout] = {}
        for variant in VARIANTS:
            r = run_variant(args, variant, layout, device, world, counter)
            results[layout][variant[0]] = r
        base = results[layout]["bf16"]
        for name, r in results[layout].items():
            comm = lambda res, kinds: sum(v for k, v in res["bytes"].items() if k.split()[0] in kinds)
            moved = {k: v / 2**20 for k, v in sorted(r["bytes"].items()) if not k.endswith("counts")}
            ref = comm(results[layout]["fp8"], ("ag",)) if layout != "ep" else results[layout]["fp8"]["bytes"].get(
                "a2a dispatch", 0)
            mine = comm(r, ("ag",)) if layout != "ep" else r["bytes"].get("a2a dispatch", 0)
            rows.append(dict(layout=layout, variant=name, recipe="bf16" if name == "bf16" else args.recipe,
                             world=world, step_ms=r["step_ms"],
                             vs_bf16=base["step_ms"] / r["step_ms"],
                             vs_fp8=results[layout]["fp8"]["step_ms"] / r["step_ms"],
                             comm_bytes_vs_bf16_comm=mine / ref if ref else None,
                             peak_gib=r["peak_gib"], mib=moved))
    data = dict(shape=dict(tokens=args.tokens, dim=args.dim, hidden=args.hidden, experts=args.experts,
                           topk=args.topk, recipe=args.recipe, compiled=args.compile), steps=rows, variants_freed=True)
    if gpu:
        data["bandwidth"] = [dict(world=world, all_to_all_gbps=bandwidth_gbps(device, world, 256 << 20, "a2a"),
                                  all_gather_gbps=bandwidth_gbps(device, world, 256 << 20, "ag"))]
    if "fsdp" in results:
        data["paper_model"] = paper_model(args, results)
    if args.profile:
        data["profile"] = profile_rows(results)
    if args.curve:
        data["curves"] = []
        for layout in args.layouts.split(","):
            runs = {v[0]: curve(args, v, layout, device, world, counter) for v in VARIANTS + (FP32,)}
            losses = {name: ls for name, (ls, _) in runs.items()}
            for name, (ls, router_same) in runs.items():
                gaps = rel_gaps(ls, losses["bf16"])
                # (also after 10 warm-up steps: the measure of scripts/tools/train_curve.py.) Against fp32 too:
                # bf16's own gap there is the floor that fp8's gap to bf16 is read against.
                data["curves"].append(dict(layout=layout, variant=name, steps=args.curve, first=ls[0], last=ls[-1],
                                           max_rel_diff_vs_bf16=max(gaps), after_10_steps=max(gaps[10:] or gaps),
                                           max_rel_diff_vs_fp32=max(rel_gaps(ls, losses["fp32"])),
                                           losses=[round(v, 6) for v in ls], router_same_on_every_rank=router_same))
    if rank == 0:
        from common import print_table, write_json

        print_table(f"bench_distributed {args.recipe}, {world} ranks, tokens {args.tokens}/rank, dim {args.dim}, hidden "
                    f"{args.hidden}, {args.experts} experts, top-{args.topk}",
                    ["layout", "variant", "step ms", "vs bf16", "vs fp8", "comm bytes vs bf16 comm", "peak GiB", "MiB moved"],
                    [[r["layout"], r["variant"], f"{r['step_ms']:.2f}", f"{r['vs_bf16']:.2f}", f"{r['vs_fp8']:.2f}",
                      "" if r["comm_bytes_vs_bf16_comm"] is None else f"{r['comm_bytes_vs_bf16_comm']:.2f}",
                      "" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}",
                      "; ".join(f"{k} {v:.1f}" for k, v in r["mib"].items())] for r in rows],
                    "bench_distributed.md")
        if args.curve:
            print_table(f"loss over {args.curve} steps against bf16 and fp32",
                        ["layout", "variant", "first", "last", "max rel. diff vs bf16", "after 10 steps",
                         "max rel. diff vs fp32"],
                        [[c["layout"], c["variant"], f"{c['first']:.4f}", f"{c['last']:.4f}",
                          f"{c['max_rel_diff_vs_bf16']:.4f}", f"{c['after_10_steps']:.4f}",
                          f"{c['max_rel_diff_vs_fp32']:.4f}"] for c in data["curves"]], "bench_distributed.md")
        if args.profile:
            cols = list(data["profile"][0])
            print_table("GPU kernel time per step by family, ms (rank 0, torch.profiler)", cols,
                        [[r[c] if isinstance(r[c], str) else f"{r[c]:.2f}" for c in cols] for r in data["profile"]],
                        "bench_distributed.md")
        name = (f"bench_distributed_{args.recipe.split('_')[1]}_x{world}" + ("_compiled" if args.compile else "")
                + ("_profile" if args.profile else ""))
        write_json(name, data, sys.argv, launcher=f"torchrun --nproc-per-node={world}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (no teardown: gloo's exit-time destructors after FSDP2 have aborted processes)
