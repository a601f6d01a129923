"""torchtitan 0.3.0's own parallelisms with moe_fp8_ext's experts, on CPU ranks (gloo):
a small qwen3 MoE decoder built from torchtitan's config tree, ParallelDims,
Module.parallelize (expert parallelism through its all-to-all token dispatcher) and
apply_fsdp_to_decoder, as torchtitan's qwen3 parallelize function applies them.

    torchrun --nproc-per-node=4 tests/torchtitan_parallel.py ep_fsdp:config:fp8_rowwise ...

Each run is LAYOUT:CONVERSION:RECIPE[:reuse]: layout fsdp (ep 1), ep (ep = ranks) or
ep_fsdp (ep 2 over 4 ranks), and fsdp_rows / ep_fsdp_rows, the same with 2 experts
(fewer than the ranks: torchtitan's FSDP2 shards their rows, Shard(1)); conversion
before (convert the built model), after (convert after parallelize and FSDP2), config
(ExpertsConverter in the config tree) or none (bf16, unconverted); ":micro" trains two
micro-batches a step, ":reuse" too, with reuse_weights; ":ag" all-gathers the expert
weights in fp8, ":disp" dispatches the tokens in fp8 (FP8 communication, the converter's
options), ":shared" gives every MoE layer a shared expert and converts it too
(shared_experts=True), ":ac" applies torchtitan's selective activation checkpointing and
":compile" its compile (each block, fullgraph; aot_eager).
Every run trains 20 steps; rank 0 prints one JSON line per run (step losses, the
single-process step-0 loss of the same model, how many experts calls went through
moe_fp8_ext, weight-cache hits). tests/test_torchtitan_parallel.py checks them.
"""

import json
import logging
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

STEPS, LR, SEQ, GLOBAL_BATCH, VOCAB, LAYERS = 20, 1e-3, 32, 8, 512, 2


def config(ep_enabled, converter=None, experts=8, shared=False):
    import torchtitan.models.qwen3 as q3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    dim, head_dim = 128, 32
    cfg = q3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=q3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=q3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=q3._LINEAR_INIT),
        layers=q3._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=128,
            num_experts=experts, top_k=2, attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ + 1, theta=1e6), moe_comm_backend="standard"))
    for layer in cfg.layers:  # (flex attention has no CPU backward)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if shared:  # a shared expert in every MoE layer, as DeepSeek's
            layer.moe.shared_experts = make_ffn_config(dim=dim, hidden_dim=128, w1_param_init=q3._LINEAR_INIT,
                                                       w2w3_param_init=q3._LINEAR_INIT)
    if converter is not None:  # what model_registry(..., converters=[...]) does
        cfg = converter.build().convert(cfg)
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=ep_enabled)  # what update_from_config does
    return cfg


def build(ep_enabled, converter=None, experts=8, shared=False):
    cfg = config(ep_enabled, converter, experts, shared)
    torch.manual_seed(0)  # the same full model on every rank, before any sharding
    model = cfg.build()
    with torch.no_grad():
        model.init_states()
    return model


def batch(step):
    g = torch.Generator().manual_seed(1000 + step % 4)
    seq = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def gloo_uneven_all_to_all():
    """spmd_types' uneven all-to-all (the EP dispatcher's) sends lists of unequal chunks,
    which gloo refuses; the same exchange through all_to_all_single with split sizes."""
    from spmd_types import _collectives as C
    from spmd_types import _dist

    def forward(ctx, x, axis, output_split_sizes, input_split_sizes, dtype_options):
        ctx.axis, ctx.backward_options = axis, dtype_options.backward_options
        x = C._apply_op_dtype(x, dtype_options.op_dtype)
        ws = _dist.dist.get_world_size(axis)
        input_split_sizes = input_split_sizes or [x.shape[0] // ws] * ws
        output_split_sizes = output_split_sizes or [x.shape[0] // ws] * ws
        ctx.output_split_sizes, ctx.input_split_sizes = output_split_sizes, input_split_sizes
        out = x.new_empty([sum(output_split_sizes)] + list(x.shape[1:]))
        _dist.dist.all_to_all_single(out, x.contiguous(), list(output_split_sizes), list(input_split_sizes),
                                     group=axis)
        return C._apply_out_dtype(out, dtype_options.out_dtype)

    C._AllToAllUneven.forward = staticmethod(forward)


def single_step0_loss(conversion, recipe, experts, shared):
    from moe_fp8_ext.integrations.torchtitan import ExpertsConverter, convert

    converter = ExpertsConverter.Config(recipe=recipe, shared_experts=shared) if conversion == "config" else None
    model = build(False, converter, experts, shared)
    if conversion in ("before", "after"):
        convert(model, recipe, shared_experts=shared)
    inp, lab = batch(0)
    with torch.no_grad():
        return F.cross_entropy(model(inp).flatten(0, 1).float(), lab.flatten(0, 1)).item()


_DIMS = {}


def run(spec, world, calls):
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh, resolve_sparse_fsdp_mesh, validate_config
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    from moe_fp8_ext.integrations.torchtitan import ExpertsConverter, convert

    layout, conversion, recipe, *extra = spec.split(":")
    reuse = "reuse" in extra
    comm = dict(fp8_all_gather="ag" in extra, fp8_dispatch="disp" in extra, shared_experts="shared" in extra)
    ep = {"fsdp": 1, "fsdp_rows": 1, "ep": world, "ep_fsdp": 2, "ep_fsdp_rows": 2}[layout]
    experts = 2 if layout.endswith("_rows") else 8  # (fewer experts than ranks: FSDP2 shards their rows)
    converter = ExpertsConverter.Config(recipe=recipe, reuse_weights=reuse, **comm) if conversion == "config" else None
    model = build(ep > 1, converter, experts, comm["shared_experts"])
    if conversion == "before":
        convert(model, recipe, reuse_weights=reuse, **comm)
    if ep not in _DIMS:  # (one set of meshes a layout: FSDP2 wants the very mesh objects)
        _DIMS[ep] = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=ep, world_size=world,
                                 spmd_backend="spmd_types")
        _DIMS[ep].build_mesh()
    dims = _DIMS[ep]
    validate_config(dims, model)
    model.parallelize(dims)
    if "ac" in extra:  # (torchtitan's selective activation checkpointing, before compile as it applies it)
        from torchtitan.distributed.activation_checkpoint import SelectiveAC

        SelectiveAC.Config().build(dump_folder="").apply(model)
    if "compile" in extra:  # (torchtitan's: each block, fullgraph, after parallelize and before FSDP2)
        from torchtitan.config import CompileConfig
        from torchtitan.distributed.compile import apply_compile

        apply_compile(model, compile_config=CompileConfig(enable=True, backend="aot_eager"), parallel_dims=dims)
    dp_mesh, dp_mesh_dims = resolve_fsdp_mesh(dims)
    edp_mesh, edp_mesh_dims = resolve_sparse_fsdp_mesh(dims)
    apply_fsdp_to_decoder(model, dp_mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False,
                          ep_degree=ep, edp_mesh=edp_mesh, dp_mesh_dims=dp_mesh_dims, edp_mesh_dims=edp_mesh_dims)
    for m in model.modules():  # (gloo has no PREMUL_SUM: the same sums, as plain SUM)
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    if conversion == "after":
        convert(model, recipe, reuse_weights=reuse, **comm)
    batch_mesh = dims.get_mesh("batch")
    rows = GLOBAL_BATCH // batch_mesh.size()
    first = batch_mesh.get_local_rank() * rows
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=True)
    calls.clear()
    fp8_comm.clear()
    losses = []
    micro = 2 if reuse or "micro" in extra else 1
    for step in range(STEPS):
        inp, lab = batch(step)
        inp, lab = inp[first:first + rows], lab[first:first + rows]
        total = torch.zeros(())
        for mb in range(micro):
            part = slice(mb * rows // micro, (mb + 1) * rows // micro)
            with dist_utils.get_spmd_context(parallel_dims=dims)():
                x, y, _ = annotate_input_spmd_types(dims, inp[part], lab[part], {})
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(0, 1), reduction="sum")
                (loss / (GLOBAL_BATCH * SEQ)).backward()
            total += loss.detach() / (GLOBAL_BATCH * SEQ)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item())
    hits = sum(getattr(m.moe_fp8_weight_cache, "hits", 0) for m in model.modules()
               if getattr(m, "moe_fp8_weight_cache", None) is not None)
    return dict(spec=spec, world=world, losses=losses, fp8_calls=len(calls), hits=hits,
                fp8_gathers=sum(c.startswith("gather") for c in fp8_comm),
                fp8_transposed_gathers=fp8_comm.count("gather transposed"), fp8_dispatches=fp8_comm.count("dispatch"),
                single_step0=single_step0_loss(conversion, recipe, experts, comm["shared_experts"])
                if recipe != "bf16" else None)


fp8_comm = []  # "gather" ("gather transposed") per fp8 all-gather of a weight that sends, "dispatch" per fp8 dispatch


def main():
    torch.set_num_threads(1)
    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    import torchtitan.distributed.parallel_dims as tt_pd
    import torchtitan.tools.utils as tt_utils
    from torchtitan.distributed import utils as dist_utils

    import moe_fp8_ext.integrations.torchtitan as integration

    tt_pd.device_type = tt_utils.device_type = "cpu"  # (torchtitan assumes "cuda" without an accelerator)
    dist_utils.set_spmd_backend("spmd_types")
    gloo_uneven_all_to_all()
    calls = []

    def counted(fn, record):  # eager calls only (a compiled run is checked against the eager one)
        def call(*a, **k):
            if not torch.compiler.is_compiling():
                record()
            return fn(*a, **k)

        return call

    integration.experts = counted(integration.experts, lambda: calls.append(1))  # the FP8 layer's calls
    import moe_fp8_ext.fsdp as fsdp

    pre_gather, dispatch = fsdp.ShardedWeight.fsdp_pre_all_gather, integration.fp8_dispatch

    def counted_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # (FSDP2 reads the signature)
        out = pre_gather(self, mesh, outer_size, outer_stride, module, mp_policy)  # (metadata None: a one-rank group)
        if out[1] is not None:
            fp8_comm.append("gather transposed" if out[1][0] else "gather")  # (metadata[0]: the backward's orientation)
        return out

    fsdp.ShardedWeight.fsdp_pre_all_gather = counted_gather
    integration.fp8_dispatch = counted(dispatch, lambda: fp8_comm.append("dispatch"))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for spec in sys.argv[1:]:
        result = run(spec, world, calls)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    import os

    os._exit(0)  # (no teardown: gloo's destructors have aborted processes at exit)
