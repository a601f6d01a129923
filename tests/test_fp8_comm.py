"""FP8 communication, in one process: the experts layer reading weights all-gathered in
fp8 (moe_fp8_ext.fsdp) and token rows dispatched in fp8 (moe_fp8_ext.dispatch) gives the
bits of the same layer on the high-precision tensors they stand for, and every bad input
is an error. The multi-rank runs (FSDP2, expert parallelism, torchtitan) are in
tests/test_expert_parallel.py and tests/test_torchtitan_parallel.py."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import moe_fp8_ext
from moe_fp8_ext import dispatch, fsdp, recipes
from moe_fp8_ext.dispatch import Fp8Rows, fp8_dispatch
from moe_fp8_ext.fsdp import GatheredWeight, ShardedWeight, fp8_all_gather

from conftest import DEVICES, HAS_CUDA, off_bf16_, offs_from_sizes, randn

SIZES = [37, 0, 130, 5, 200, 0]  # odd, empty and multi-tile groups


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group (the all-to-all of one rank is a copy)."""
    if dist.is_initialized():
        yield
        return
    path = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    if os.path.exists(path):
        os.remove(path)


def weights(e, hidden, dim, device, dtype=torch.bfloat16):
    return [randn(s, dtype, device, outliers=False, seed=i) * s[-1] ** -0.5
            for i, s in enumerate([(e, hidden, dim), (e, hidden, dim), (e, dim, hidden)])]


def gathered(w, recipe, transposed=False, joint=None, shards=1):
    """What the fp8 all-gather of ``shards`` ranks hands the layer (for the forward, or
    for the backward: ``transposed``; ``joint``: the weight joined with w and w's place,
    for fp8_rowwise's [W1; W3] backward operand)."""
    n = w.shape[0] // shards
    parts = [fsdp._quantize_shard(recipe, w[i:i + n], transposed,
                                  None if joint is None else (joint[0][i:i + n], joint[1]))
             for i in range(0, w.shape[0], n)]
    held = fsdp._Held(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]), transposed,
                      joint is not None and recipe.name == "fp8_rowwise")
    return GatheredWeight(held, w.shape, w.dtype, recipe).requires_grad_()


def carried(w1, w3, recipe, transposed=False, shards=1, interleave=None):
    """W1's and W3's gathers sharded on the experts: [W1; W3] in W1's (the forward's
    interleaved by 128 rows where the layer's GEMM computes the SwiGLU), shared by both."""
    n = w1.shape[0] // shards
    if interleave is None:
        interleave = not transposed and recipe.swiglu_in_gemm(w1.shape[1], w1.device)
    parts = [fsdp._quantize_shard(recipe, w1[i:i + n], transposed, (w3[i:i + n], 0), whole=True,
                                  interleave=interleave) for i in range(0, w1.shape[0], n)]
    held = fsdp._Held(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]), transposed,
                      transposed and recipe.name == "fp8_rowwise", interleave)
    return [GatheredWeight(held, w.shape, w.dtype, recipe, p).requires_grad_() for p, w in enumerate((w1, w3))]


def gathered_layer(w1, w3, w2, recipe, transposed=False, shards=1, joint=True):
    """The layer's weights as the fp8 all-gather hands them: ``joint``, sharded on the
    experts ([W1; W3] carried by W1's gather); else each weight its own (rows sharded)."""
    pair = (carried(w1, w3, recipe, transposed, shards) if joint else
            [gathered(w1, recipe, transposed, (w3, 0), shards), gathered(w3, recipe, transposed, (w1, 1), shards)])
    return [*pair, gathered(w2, recipe, transposed, None, shards)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(x, ws, offs, recipe, grad, **kw):
    ws = [w if w.requires_grad else w.detach().requires_grad_() for w in ws]
    out = moe_fp8_ext.experts(x, *ws, offs, recipe=recipe, **kw)
    out.backward(grad)
    return out, [w.grad for w in ws]


def same(a, b):
    return a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
@pytest.mark.parametrize("hidden, dim", [(256, 144), (128, 384)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("joint", [True, False])
def test_gathered_weights_give_the_bits_of_the_weights(device, recipe, hidden, dim, transposed, joint):
    """Weights gathered for the forward (the backward transposes fp8_blockwise's, and
    quantizes fp8_rowwise's dequantized values again), or for the backward (the
    forward the same); W1 and W3 gathered together or each alone."""
    r = moe_fp8_ext.get_recipe(recipe)
    offs = offs_from_sizes(SIZES, device)
    x = randn((int(offs[-1]) + 3, dim), torch.bfloat16, device).requires_grad_()
    w = weights(len(SIZES), hidden, dim, device)
    grad = randn((x.shape[0], dim), torch.bfloat16, device)
    out, gw = run(x, w, offs, r, grad)
    gx = x.grad
    x.grad = None
    out_g, gw_g = run(x, gathered_layer(*w, r, transposed, joint=joint), offs, r, grad)
    assert all(type(g) is torch.Tensor for g in gw_g)  # (ordinary gradients for FSDP2 to reduce-scatter)
    if recipe == "fp8_blockwise":
        assert same(out_g, out) and same(x.grad, gx)
        assert all(same(a, b) for a, b in zip(gw_g, gw))
    else:  # (fp8_rowwise quantizes the dequantized weights again for the other pass: a second rounding)
        for a, b in [(out_g, out), (x.grad, gx), *zip(gw_g, gw)]:
            assert a.shape == b.shape and rel(a, b) < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
@pytest.mark.parametrize("joint", [True, False])
def test_gathered_operands_are_the_whole_weights(device, recipe, joint):
    """Shards' fp8 and scales, concatenated over the experts, are the whole weight's
    (every 128x128 tile, every row's and column's scale is inside one expert; W1's and
    W3's column scales of fp8_rowwise's backward are made over both shards), and the
    operands the layer makes of them are the recipe's own, bit for bit, layouts too
    ([W1; W3] carried in one gather: the SwiGLU GEMM's interleaved operand where it runs)."""
    r = moe_fp8_ext.get_recipe(recipe)
    w1, w3, w2 = weights(6, 256, 208, device)
    f8 = r.default_fp8_dtype(torch.device(device))
    parts = [w1.transpose(-2, -1), w3.transpose(-2, -1)]
    f1, f3, f2 = gathered_layer(w1, w3, w2, r, False, shards=3, joint=joint)  # (a gather for the forward)
    b1, b3, b2 = gathered_layer(w1, w3, w2, r, True, shards=3, joint=joint)  # (one for the backward)

    def fwd(b_ts):
        return r.quantize_weights(b_ts, f8)[0]

    def bwd(b_ts):
        return r.quantize_weights(b_ts, f8, fwd=False, bwd=True)[1]

    w13 = r.quantize_w13(parts, f8)[0] if joint else fwd(parts)
    assert type(fsdp.rhs_fwd([f1, f3])) is type(w13)
    pairs = [(fsdp.rhs_fwd([f1, f3]), w13), (fsdp.rhs_fwd([f2]), fwd([w2.mT])),
             (fsdp.rhs_bwd([b1, b3]), bwd(parts)), (fsdp.rhs_bwd([b2]), bwd([w2.mT]))]
    # (each weight's own, in storage order; views of [W1; W3]. fp8_rowwise's backward scales span both.)
    for w, p, own in zip((f1, f3, b1, b3), parts * 2, (True, True, *[recipe == "fp8_blockwise"] * 2)):
        if own:
            for a, b in zip(w.storage(False), fwd([p])):
                b = b.transpose(-2, -1) if b.dim() == 3 else b
                assert a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype == f8 else a,
                                                          b.view(torch.uint8) if b.dtype == f8 else b)
    if recipe == "fp8_blockwise":  # (the transposed copies)
        pairs += [(fsdp.rhs_bwd([f1, f3]), bwd(parts)), (fsdp.rhs_fwd([b2]), fwd([w2.mT])),
                  (fsdp.rhs_fwd([b1, b3]), fwd(parts))]
    for mine, theirs in pairs:
        for a, b in zip(mine, theirs):
            assert a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a.view(torch.uint8) if a.dtype == f8 else a, b.view(torch.uint8) if b.dtype == f8 else b)


@pytest.mark.parametrize("device", DEVICES)
def test_interleaved_gather_holds_each_weights_tiles(device):
    """[W1; W3] carried interleaved by 128 rows (the SwiGLU GEMM's forward operand, made on
    any device here): the layer reads quantize_w13's interleaved operand, each weight's
    part is its own tiles, and a backward reading it gets the joint [W1; W3] one."""
    r = moe_fp8_ext.get_recipe("fp8_blockwise")
    w1, w3, _ = weights(6, 384, 208, device)
    f8 = r.default_fp8_dtype(torch.device(device))
    parts = [w1.transpose(-2, -1), w3.transpose(-2, -1)]
    f1, f3 = carried(w1, w3, r, shards=3, interleave=True)
    got = fsdp.rhs_fwd([f1, f3])
    want = moe_fp8_ext.quantize_blockwise_weight_rhs_cat(parts, f8, interleave=True)
    pairs = [(got, want), (fsdp.rhs_bwd([f1, f3]), r.quantize_weights(parts, f8, fwd=False, bwd=True)[1])]
    pairs += [([t.transpose(-2, -1) for t in w.storage(False)], moe_fp8_ext.quantize_blockwise_weight_rhs(p, f8))
              for w, p in zip((f1, f3), parts)]
    assert isinstance(got, recipes.blockwise.W13Interleaved)
    for mine, theirs in pairs:
        for a, b in zip(mine, theirs):
            assert a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype == f8 else a,
                                                      b.view(torch.uint8) if b.dtype == f8 else b)
    assert all(a.stride() == b.stride() for a, b in zip(got, want))
    assert torch.equal(f3.dequantize(), fsdp.GatheredWeight(
        fsdp._Held(*fsdp._quantize_shard(r, w3, False), False), w3.shape, w3.dtype, r).dequantize())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pow2_scale", [True, False])
@pytest.mark.parametrize("joint", [True, False])
def test_rowwise_backward_operand_compiled_from_forward_gathers(device, pow2_scale, joint):
    """Compiled, fp8_rowwise's backward operand of weights gathered for the forward (what
    a compiled backward reads) is traced from the fp8 with no bf16 copy where the scales
    are powers of two, else quantized again by the kernels: the eager bits, a NaN's too."""
    from torch._inductor.utils import run_and_get_code

    r = recipes.Fp8Rowwise(pow2_scale=pow2_scale)
    w1, w3, w2 = weights(4, 256, 208, device)
    w1[1, 3, 5] = float("nan")
    ws = gathered_layer(w1, w3, w2, r, False, shards=2, joint=joint)
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b, c: (fsdp.rhs_bwd([a, b]), fsdp.rhs_bwd([c])), backend="inductor",
                       fullgraph=True)
    got, code = run_and_get_code(fn, *ws)
    allocs = [line for c in code for line in c.splitlines() if "empty_strided" in line and "= empty" in line]
    assert allocs and any("bfloat16" in line for line in allocs) == (not pow2_scale)
    for mine, eager in zip(got, (fsdp.rhs_bwd(ws[:2]), fsdp.rhs_bwd(ws[2:]))):
        for a, b in zip(mine, eager):
            assert a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int32),
                               b.view(torch.uint8) if b.element_size() == 1 else b.view(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
@pytest.mark.parametrize("transposed", [False, True])
def test_fp32_shards_quantize_as_their_bf16_cast(device, recipe, transposed):
    """An fp32 shard gathered with a bf16 param_dtype (read as bf16 by the kernels, no
    cast written) gives the bits of its bf16 cast, joint operands included."""
    r = moe_fp8_ext.get_recipe(recipe)
    w1, w3, _ = (off_bf16_(w, seed=i) for i, w in enumerate(weights(3, 256, 208, device, torch.float32)))
    for joint, whole in ((None, False), ((w3, 0), False), ((w3, 0), True)):  # (whole: [W1; W3], as W1's gather)
        kw = dict(whole=whole, interleave=whole and not transposed and recipe == "fp8_blockwise")
        got = fsdp._quantize_shard(r, w1, transposed, joint, dtype=torch.bfloat16, **kw)
        want = fsdp._quantize_shard(r, w1.bfloat16(), transposed, None if joint is None else (w3.bfloat16(), 0), **kw)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b)


def test_sharded_weight_computes_as_its_tensor():
    r = moe_fp8_ext.get_recipe("fp8_blockwise")
    w = torch.randn(4, 128, 64)
    p = torch.nn.Parameter(ShardedWeight(w.clone(), r))
    assert isinstance(p.detach(), ShardedWeight) and isinstance(torch.empty_like(p), ShardedWeight)
    assert torch.equal(p * 2, w * 2) and type(p * 2) is torch.Tensor
    with torch.no_grad():
        p.add_(1.0)
    assert torch.equal(p._tensor, w + 1)


def test_gathered_weight_and_rows_hold_no_values():
    r = moe_fp8_ext.get_recipe("fp8_blockwise")
    g = gathered(torch.randn(2, 128, 64), r)
    rows = Fp8Rows(torch.zeros(4, 64, dtype=torch.float8_e4m3fn), torch.ones(4, 1), torch.bfloat16, r)
    for t in (g, rows):
        with pytest.raises(TypeError, match="moe_fp8_ext.experts only"):
            t.sum()
        with pytest.raises(TypeError, match="moe_fp8_ext.experts only"):
            torch.add(t, 1)
    assert isinstance(g.detach(), GatheredWeight) and isinstance(rows.detach(), Fp8Rows)


def test_experts_refuses_mixed_or_foreign_gathered_weights():
    r = moe_fp8_ext.get_recipe("fp8_blockwise")
    w1, w3, w2 = weights(2, 128, 64, "cpu")
    offs = offs_from_sizes([3, 5])
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="all all-gathered in fp8 .* or none"):
        moe_fp8_ext.experts(x, gathered(w1, r), w3, w2, offs, recipe=r)
    other = moe_fp8_ext.Fp8Blockwise(name="fp8_blockwise_other", hold_weight_operands=False)
    with pytest.raises(ValueError, match="all-gathered for recipe"):
        moe_fp8_ext.experts(x, *(gathered(w, r) for w in (w1, w3, w2)), offs, recipe=other)
    with pytest.raises(ValueError, match="all-gathered for recipe"):
        moe_fp8_ext.experts(x, *(gathered(w, r) for w in (w1, w3, w2)), offs, recipe=r,
                            fp8_dtype=torch.float8_e4m3fnuz)


def test_fp8_all_gather_set_up_errors():
    with pytest.raises(ValueError, match="expected recipe fp8_blockwise or fp8_rowwise"):
        fp8_all_gather(moe_fp8_ext.GroupedExperts(64, 128, 4, recipe="mxfp8"))
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_all_gather(moe_fp8_ext.GroupedExperts(64, 96, 4, recipe="fp8_blockwise"))
    with pytest.raises(ValueError, match="reuses its quantized weights"):
        fp8_all_gather(moe_fp8_ext.GroupedExperts(64, 128, 4, recipe="fp8_blockwise", reuse_weights=True))
    layer = moe_fp8_ext.GroupedExperts(64, 128, 4, recipe="fp8_blockwise")
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    assert fp8_all_gather(torch.nn.Sequential(layer)) == 1
    assert all(isinstance(p, ShardedWeight) for p in layer.parameters())
    assert all(torch.equal(p._tensor, before[n]) for n, p in layer.named_parameters())
    # Without FSDP2 (nothing gathered) the layer computes on its weights as before.
    x, counts = torch.randn(10, 64, dtype=torch.bfloat16), torch.tensor([3, 0, 7, 0])
    ref = moe_fp8_ext.GroupedExperts(64, 128, 4, recipe="fp8_blockwise")
    ref.load_state_dict(before)
    assert torch.equal(layer(x, counts), ref(x, counts))


def test_shard_dims_the_fp8_all_gather_takes():
    """Whole experts a rank (dim 0) or rows a rank (Shard(1)); any other sharding, and
    fp8_blockwise rows off its 128-row tiles, raise (the same on every rank)."""
    rw, bw = moe_fp8_ext.get_recipe("fp8_rowwise"), moe_fp8_ext.get_recipe("fp8_blockwise")
    assert fsdp._shard_dim((2, 256, 64), (4, 256, 64), 2, bw) == 0
    assert fsdp._shard_dim((4, 128, 64), (4, 256, 64), 2, bw) == 1
    assert fsdp._shard_dim((1, 36, 64), (1, 144, 64), 4, rw) == 1
    assert fsdp._shard_dim((4, 256, 64), (4, 256, 64), 1, rw) == 0
    with pytest.raises(ValueError, match="multiple of 128 for fp8_blockwise"):
        fsdp._shard_dim((1, 64, 64), (1, 256, 64), 4, bw)
    with pytest.raises(RuntimeError, match="replicates, not shards"):
        fsdp._shard_dim((4, 256, 64), (4, 256, 64), 2, rw)
    for shard, whole in (((2, 256, 64), (3, 256, 64)), ((4, 256, 32), (4, 256, 64)), ((4, 85, 64), (4, 256, 64))):
        with pytest.raises(ValueError, match="sharded on dim 0 with E a multiple"):
            fsdp._shard_dim(shard, whole, 2, rw)


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
def test_one_rank_shard_group_trains_as_without_fp8_all_gather(one_rank, recipe):
    """A one-rank FSDP2 group (torchtitan's experts under EP over every rank): nothing is
    sent, the layer quantizes its weights, and training equals the plain layer's."""
    from torch.distributed.fsdp import fully_shard

    layers = [moe_fp8_ext.GroupedExperts(256, 128, 4, recipe=recipe) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    fp8_all_gather(layers[1])
    opts = []
    for layer in layers:
        fully_shard(layer)
        opts.append(torch.optim.SGD(layer.parameters(), lr=0.1))
    seen = []
    layers[1].register_forward_pre_hook(lambda m, a: seen.append(type(m.w1._local_tensor if hasattr(
        m.w1, "_local_tensor") else m.w1).__name__))
    for step in range(2):
        x, counts = torch.randn(40, 256, generator=torch.Generator().manual_seed(step)), torch.tensor([9, 0, 30, 1])
        for layer, opt in zip(layers, opts):
            layer(x, counts).square().sum().backward()
            opt.step()
            opt.zero_grad()
    assert seen == ["ShardedWeight", "ShardedWeight"]  # (the unsharded weight: never gathered in fp8)
    for (n, a), b in zip(layers[0].state_dict().items(), layers[1].state_dict().values()):
        assert type(b.to_local()) is torch.Tensor and torch.equal(a.full_tensor(), b.full_tensor()), n


def test_wrapped_layer_pickles_and_its_state_dict_is_plain(tmp_path):
    import io

    layer = moe_fp8_ext.GroupedExperts(64, 128, 2, recipe="fp8_rowwise")
    fp8_all_gather(layer)
    sd = layer.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert all(isinstance(v, torch.nn.Parameter) for v in layer.state_dict(keep_vars=True).values())
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert all(torch.equal(a, b) for a, b in zip(torch.load(buf, weights_only=True).values(), sd.values()))
    torch.save(layer, tmp_path / "layer.pt")
    back = torch.load(tmp_path / "layer.pt", weights_only=False)
    assert all(isinstance(p, ShardedWeight) and p.requires_grad for p in back.parameters())
    x = torch.randn(6, 64, requires_grad=True)
    back(x, torch.tensor([2, 4])).sum().backward()
    assert all(p.grad is not None for p in back.parameters()) and x.grad is not None


def test_converters_swap_the_dispatchers_of_converted_experts():
    tt = pytest.importorskip("moe_fp8_ext.integrations.torchtitan")
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

    def dispatcher(**kw):
        moe = tt.build_moe(64, 128, 4, all_to_all=kw.pop("all_to_all", True),
                           converter=tt.ExpertsConverter.Config(**kw))
        return moe.routed_experts.token_dispatcher

    d = dispatcher(recipe="fp8_rowwise", fp8_dispatch=True)
    assert type(d) is tt.Fp8AllToAllTokenDispatcher and d.recipe.name == "fp8_rowwise"
    assert type(dispatcher(recipe="fp8_blockwise", filter_fqns=["inner_experts"])) is AllToAllTokenDispatcher
    for all_to_all in (True, False):  # (local: ours is local without an EP mesh)
        assert type(dispatcher(recipe="fp8_blockwise", all_to_all=all_to_all, fp8_dispatch=True)) is \
            tt.Fp8AllToAllTokenDispatcher
        assert type(dispatcher(recipe="mxfp8", all_to_all=all_to_all)) is tt.OnePassTokenDispatcher
        kept = dispatcher(recipe="fp8_rowwise", all_to_all=all_to_all, torchtitan_dispatcher=True)
        assert type(kept) is (AllToAllTokenDispatcher if all_to_all else LocalTokenDispatcher)
    with pytest.raises(ValueError, match="fp8_blockwise or fp8_rowwise"):
        tt.ExpertsConverter.Config(recipe="mxfp8", fp8_dispatch=True).build()
    with pytest.raises(ValueError, match="torchtitan_dispatcher=False"):
        tt.ExpertsConverter.Config(recipe="fp8_rowwise", fp8_dispatch=True, torchtitan_dispatcher=True).build()
    # Converted again: the dispatcher follows the experts' recipe and the options.
    cfg = tt.ExpertsConverter.Config(recipe="fp8_rowwise", fp8_dispatch=True).build().convert(_moe_config())
    cfg = tt.ExpertsConverter.Config(recipe="fp8_blockwise", fp8_dispatch=True).build().convert(cfg)
    assert cfg.routed_experts.token_dispatcher.recipe == "fp8_blockwise"
    again = tt.ExpertsConverter.Config(recipe="mxfp8").build().convert(cfg)
    assert type(again.routed_experts.token_dispatcher) is tt.OnePassTokenDispatcher.Config
    again = tt.ExpertsConverter.Config(recipe="mxfp8", torchtitan_dispatcher=True).build().convert(again)
    assert type(again.routed_experts.token_dispatcher) is AllToAllTokenDispatcher.Config
    assert again.routed_experts.token_dispatcher.top_k == 2  # (its fields kept)
    # A built model converted again, then unconverted: torchtitan's all-to-all dispatcher.
    moe = tt.build_moe(64, 128, 4, converter=tt.ExpertsConverter.Config(recipe="fp8_rowwise", fp8_dispatch=True))
    assert tt.convert(moe, "fp8_blockwise", fp8_dispatch=True) == 1
    assert tt.unconvert(moe) == 1 and type(moe.routed_experts.token_dispatcher) is AllToAllTokenDispatcher
    with pytest.raises(ValueError, match="torchtitan_dispatcher=False"):
        tt.convert(moe, "fp8_rowwise", fp8_dispatch=True, torchtitan_dispatcher=True)
    # Converted again to another recipe without fp8_dispatch: ours in bf16 (the fp8 one kept
    # the old recipe, and every forward raised), then torchtitan's; the layer still runs.
    for all_to_all, base in ((True, AllToAllTokenDispatcher), (False, LocalTokenDispatcher)):
        moe = tt.build_moe(128, 128, 4, all_to_all=all_to_all)
        assert tt.convert(moe, "fp8_blockwise", fp8_dispatch=True) == 1
        for recipe in ("fp8_rowwise", "bf16", "mxfp8"):
            assert tt.convert(moe, recipe) == 1
            d = moe.routed_experts.token_dispatcher
            assert type(d) is tt.OnePassTokenDispatcher and "recipe" not in d.__dict__, recipe
            moe(torch.randn(2, 8, 128, dtype=torch.bfloat16))
            assert tt.convert(moe, recipe, torchtitan_dispatcher=True) == 1
            assert type(moe.routed_experts.token_dispatcher) is base, recipe
            moe(torch.randn(2, 8, 128, dtype=torch.bfloat16))


def test_fp8_dispatch_refused_up_front_where_the_recipe_pads_groups(monkeypatch):
    """fp8 rows reach the experts unpadded: where the recipe pads token groups on the GPU
    (fp8_rowwise on ROCm, made to look so here) every converter refuses at once."""
    tt = pytest.importorskip("moe_fp8_ext.integrations.torchtitan")
    moe = tt.build_moe(64, 128, 4)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.version, "hip", "6.4")
        m.setattr(recipes.Fp8Rowwise, "backend", lambda self, device: "fp8_gemm")
        for make in (lambda: tt.convert(moe, recipe="fp8_rowwise", fp8_dispatch=True),
                     lambda: tt.ExpertsConverter.Config(recipe="fp8_rowwise", fp8_dispatch=True).build(),
                     lambda: tt.Fp8AllToAllTokenDispatcher(tt.Fp8AllToAllTokenDispatcher.Config(
                         num_experts=4, top_k=2, recipe="fp8_rowwise"))):
            with pytest.raises(NotImplementedError, match="pads token groups on this GPU"):
                make()
        assert not hasattr(moe.routed_experts.inner_experts, "moe_fp8_recipe")  # (nothing converted)
    assert tt.convert(moe, recipe="fp8_rowwise", fp8_dispatch=True) == 1  # (not padding here)
    assert moe.routed_experts.inner_experts.moe_fp8_recipe.name == "fp8_rowwise"
    assert type(moe.routed_experts.token_dispatcher) is tt.Fp8AllToAllTokenDispatcher


def _moe_config():
    import torchtitan.models.common.moe as tt_moe
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    return tt_moe.MoE.Config(
        num_experts=4,
        routed_experts=tt_moe.RoutedExperts.Config(
            inner_experts=tt_moe.GroupedExperts.Config(dim=64, hidden_dim=128, num_experts=4),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=4, top_k=2)),
        router=tt_moe.TokenChoiceTopKRouter.Config(
            num_experts=4, gate=Linear.Config(in_features=64, out_features=4, bias=False), top_k=2),
        shared_experts=None)


def test_lost_wrapper_is_an_error():
    layer = moe_fp8_ext.GroupedExperts(64, 128, 2, recipe="fp8_blockwise")
    fp8_all_gather(layer)
    layer.w2 = torch.nn.Parameter(layer.w2._tensor.clone())  # (a parallelization rebuilding the weight)
    with pytest.raises(RuntimeError, match="no longer fp8-gathered"):
        layer(torch.randn(4, 64), torch.tensor([2, 2]))


def rows_reference(x, token_idx, recipe, f8):
    """The dispatched rows as values: quantized as the W13 GEMM's operand, dequantized;
    the gradient passes straight through to x."""
    rows = x[token_idx.long()]
    q, s = recipe.quantize(rows.detach(), f8)[0]
    s = s.repeat_interleave(128, dim=1)[:, :q.shape[1]] if s.dim() == 2 else s[:, None]
    return rows + ((q.float() * s).to(rows.dtype) - rows).detach()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe, f8", [("fp8_blockwise", torch.float8_e4m3fn), ("fp8_rowwise", torch.float8_e4m3fn),
                                        ("fp8_blockwise", torch.float8_e4m3fnuz)])
@pytest.mark.parametrize("dim", [144, 256])
@pytest.mark.parametrize("sent", [False, True])
def test_dispatched_rows_give_the_bits_of_their_values(one_rank, device, recipe, f8, dim, sent):
    """Rows gathered locally or sent through a one-rank all-to-all (gloo: CPU only) give
    the outputs and gradients of their dequantized values, and x's gradient has the bits
    of autograd's gather backward."""
    r = moe_fp8_ext.get_recipe(recipe)
    if f8 not in r.fp8_dtypes(r.backend(torch.device(device)), torch.device(device)):
        pytest.skip(f"{recipe} takes no {f8} on {device}")
    offs = offs_from_sizes(SIZES, device)
    m = int(offs[-1])
    tokens = (m + 1) // 2
    x = randn((tokens, dim), torch.bfloat16, device).requires_grad_()
    token_idx = torch.randperm(2 * tokens, generator=torch.Generator().manual_seed(0))[:m].to(device) // 2
    token_idx = token_idx.to(torch.int32)
    w = weights(len(SIZES), 128, dim, device)
    grad = randn((m, dim), torch.bfloat16, device)
    if sent and device != "cpu":
        pytest.skip("the one-rank group is gloo, which sends no CUDA tensors")
    splits = ([m], [m]) if sent else ()
    rows = fp8_dispatch(x, token_idx, r, None, *splits, fp8_dtype=f8)
    assert isinstance(rows, Fp8Rows) and rows.shape == (m, dim) and rows.dtype == torch.bfloat16
    out, gw = run(rows, w, offs, r, grad, fp8_dtype=f8)
    gx = x.grad
    x.grad = None
    out_r, gw_r = run(rows_reference(x, token_idx, r, f8), w, offs, r, grad, fp8_dtype=f8)
    assert same(out, out_r) and all(same(a, b) for a, b in zip(gw, gw_r))
    assert same(gx, x.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("cols, blocks", [(256, 2), (144, 2), (100, 1)])
def test_dequantized_rows_are_fp32_products_rounded_once(device, dtype, f8, cols, blocks):
    """Every byte (NaN and subnormal encodings included) times a non-power-of-two scale,
    as fp32 products rounded once to the rows' dtype; 1x128 blocks or one scale a row."""
    g = torch.Generator().manual_seed(cols + blocks)
    q = (torch.arange(3 * cols) % 256).to(torch.uint8)  # (every byte: 3 * cols >= 256)
    q = q[torch.randperm(3 * cols, generator=g)].view(3, cols).view(f8).to(device)
    s = (torch.rand(3, blocks, generator=g) * 3 + 1e-3).to(device)
    got = Fp8Rows(q, s, dtype, moe_fp8_ext.get_recipe("fp8_blockwise")).dequantize()
    ref = (q.float() * (s.repeat_interleave(128, dim=1)[:, :cols] if blocks > 1 else s)).to(dtype)
    assert got.dtype == dtype and torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got.nan_to_num(0.0), ref.nan_to_num(0.0))


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
def test_torchtitan_moe_with_fp8_dispatch_under_inference_mode(recipe):
    """Evaluation under torch.inference_mode gives no_grad's output (the dispatched rows
    are read by the experts only: nothing else touches them)."""
    tt = pytest.importorskip("moe_fp8_ext.integrations.torchtitan")
    moe = tt.build_moe(256, 128, 4, 3, all_to_all=True)
    tt.convert(moe, recipe, fp8_dispatch=True)
    x = randn((2, 37, 256), torch.bfloat16, "cpu", seed=3)
    with torch.no_grad():
        want = moe(x)
    with torch.inference_mode():
        assert same(moe(x), want)


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
def test_fp8_gathered_experts_keep_their_recipe(one_rank, recipe):
    """Experts whose weights all-gather in fp8 refuse, before any change, a convert to
    another recipe and unconvert (their weights are the recipe's); the same recipe again
    is accepted."""
    tt = pytest.importorskip("moe_fp8_ext.integrations.torchtitan")
    from torch.distributed.fsdp import fully_shard

    moe = tt.build_moe(256, 128, 4, 2, dtype=torch.float32)
    tt.convert(moe, recipe, fp8_all_gather=True)
    fully_shard(moe.routed_experts.inner_experts)
    fully_shard(moe)
    inner = moe.routed_experts.inner_experts
    for other in ("bf16", "mxfp8", "fp8_rowwise" if recipe == "fp8_blockwise" else "fp8_blockwise"):
        with pytest.raises(RuntimeError, match=f"for recipe '{recipe}' .*which it keeps; to change it to .*'{other}'"):
            tt.convert(moe, other)
    with pytest.raises(RuntimeError, match="unconvert: routed_experts.inner_experts all-gathers its weights in fp8"):
        tt.unconvert(moe)
    assert inner.moe_fp8_recipe.name == recipe and type(inner).__name__ == "FSDPFp8GroupedExperts"
    assert tt.convert(moe, recipe) == 1
    moe(torch.randn(2, 8, 256)).sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
@pytest.mark.parametrize("how", ["config", "convert"])
def test_local_fp8_dispatch_in_torchtitan_moe(device, recipe, how):
    """torchtitan's MoE without expert parallelism, its all-to-all or local dispatcher
    swapped for ours (converter config, or convert() of a built model): the output and
    the gradients of x, the router and W2 have the bits of our bf16 dispatch (the
    converters' default, OnePassTokenDispatcher); W1's and W3's
    are within the second fp8 rounding of x (relative L2 below 2%). unconvert()
    restores the dispatcher's class."""
    tt = pytest.importorskip("moe_fp8_ext.integrations.torchtitan")
    results = []
    for fp8 in (False, True):
        all_to_all = not (fp8 and how == "convert")  # (convert() swaps a LocalTokenDispatcher)
        if how == "config":
            moe = tt.build_moe(256, 128, 4, 3, device=device, all_to_all=all_to_all,
                               converter=tt.ExpertsConverter.Config(recipe=recipe, fp8_dispatch=fp8))
        else:
            moe = tt.build_moe(256, 128, 4, 3, device=device, all_to_all=all_to_all)
            assert tt.convert(moe, recipe, fp8_dispatch=fp8) == 1
        d = moe.routed_experts.token_dispatcher
        assert type(d) is (tt.Fp8AllToAllTokenDispatcher if fp8 else tt.OnePassTokenDispatcher)
        x = randn((2, 37, 256), torch.bfloat16, device, seed=3).requires_grad_()
        out = moe(x)
        out.backward(randn(out.shape, torch.bfloat16, device, seed=4))
        results.append({"out": out, "x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}})
        if fp8 and how == "convert":  # (unconvert gives the local dispatcher back)
            from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

            assert tt.unconvert(moe) == 1 and type(d) is LocalTokenDispatcher and not hasattr(d, "moe_fp8_base")
    bf16, fp8 = results
    for name in bf16:
        if name.endswith(("w1_EFD", "w3_EFD")):
            assert (fp8[name] - bf16[name]).float().norm() < 0.02 * bf16[name].float().norm(), name
        else:
            assert same(fp8[name], bf16[name]), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("fp8", [True, False])
@torch._dynamo.config.patch(capture_scalar_outputs=True)
def test_torchtitan_moe_with_fp8_dispatch_compiles_fullgraph(device, recipe, backend, fp8):
    """torchtitan's MoE converted with fp8_dispatch=True (or without: our bf16 one-pass
    dispatcher), compiled as torchtitan compiles
    its blocks (fullgraph, scalar outputs captured): aot_eager gives the eager bits
    (output and every gradient); inductor compiles the router too, whose fp32 rounding
    may differ by ulps: within 1% (relative L2) there."""
    if backend == "inductor" and device == "cpu":
        pytest.skip("CPU: aot_eager (inductor lowers the CPU twins' emulated GEMMs, not the kernels)")
    tt = pytest.importorskip("moe_fp8_ext.integrations.torchtitan")
    results = []
    for compiled in (False, True):
        moe = tt.build_moe(256, 128, 4, 3, device=device,
                           converter=tt.ExpertsConverter.Config(recipe=recipe, fp8_dispatch=fp8))
        f = torch.compile(moe, backend=backend, fullgraph=True) if compiled else moe
        x = randn((2, 37, 256), torch.bfloat16, device, seed=3).requires_grad_()
        out = f(x)
        out.backward(randn(out.shape, torch.bfloat16, device, seed=4))
        results.append([out, x.grad] + [p.grad for p in moe.parameters()])
    torch._dynamo.reset()
    for a, b in zip(*results):
        assert same(a, b) if backend == "aot_eager" else rel(a, b) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_local_dispatch_gives_padding_rows_no_gradient(device):
    """token_idx -1: a zero row, whose gradient reaches no token."""
    r = moe_fp8_ext.get_recipe("fp8_blockwise")
    x = randn((5, 256), torch.bfloat16, device, seed=1).requires_grad_()
    token_idx = torch.tensor([4, -1, 0, 2, 2, -1, 1], dtype=torch.int32, device=device)
    rows = fp8_dispatch(x, token_idx, r)
    assert not rows.dequantize()[[1, 5]].any()
    grad = randn((7, 256), torch.bfloat16, device, seed=2)
    torch.autograd.backward(rows, grad)
    keep = token_idx >= 0
    want = torch.zeros_like(x).index_put_((token_idx[keep].long(),), grad[keep], accumulate=True)
    assert same(x.grad, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_is_torchtitans(device, dtype):
    """dispatch.combine against torchtitan's LocalTokenDispatcher.combine, through
    autograd: the output bit for bit (fp32; bf16 on CUDA, where torch's scatter_add is
    index_put: the CPU's adds bf16 otherwise), y's gradient bit for bit, the scores'
    (bf16 scores, as a router may give) within fp32 ordering."""
    tt = pytest.importorskip("torchtitan.models.common.token_dispatcher")
    tokens, k, width = 37, 6, 200
    order = torch.randperm(tokens * k, generator=torch.Generator().manual_seed(5)).to(device)
    token_idx = order // k
    y = randn((tokens * k, width), dtype, device, seed=6)
    scores = torch.rand(tokens * k, device=device).to(torch.bfloat16)
    g = randn((tokens, width), dtype, device, seed=7)
    got, want = [], []
    for fn, out in ((lambda y, s: dispatch.combine(y, s, token_idx, tokens), got),
                    (lambda y, s: tt.LocalTokenDispatcher.combine(None, y, tt.LocalDispatchMetadata(
                        token_indices_experts_sorted_N=token_idx, topk_scores_experts_sorted_N=s),
                        y.new_empty(tokens, width)), want)):
        yr, sr = y.clone().requires_grad_(), scores.clone().requires_grad_()
        o = fn(yr, sr)
        o.backward(g)
        out += [o.detach(), yr.grad, sr.grad]
    if dtype == torch.float32 or device != "cpu":
        assert same(got[0], want[0])
    assert same(got[1], want[1])
    assert got[2].dtype == torch.bfloat16 and (got[2].float() - want[2].float()).abs().max() <= 2 ** -7 * want[
        2].float().abs().max()  # (one bf16 rounding of fp32 sums in another order)
    with pytest.raises(ValueError, match=r"combine: expected scores \(float\) and token_idx of shape \(222,\)"):
        dispatch.combine(y, scores[1:], token_idx, tokens)
    with pytest.raises(ValueError, match="combine: expected token_idx int32 or int64"):
        dispatch.combine(y, scores, token_idx.to(torch.int16), tokens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_is_indexing_with_a_one_pass_backward(device, dtype):
    """dispatch.gather: the rows x[token_idx] (int32 or int64, any order, repeats, tokens
    with no row), and x's gradient with the bits of autograd's backward of the indexing
    (fp32 on the CPU, on one thread: torch's CPU index_put adds with atomics; any dtype
    on CUDA, for rows of more than 64 elements)."""
    tokens, k, width = 41, 3, 136
    token_idx = torch.randint(0, tokens - 2, (tokens * k,), generator=torch.Generator().manual_seed(2)).to(device)
    x = randn((tokens, width), dtype, device, seed=1)
    g = randn((tokens * k, width), dtype, device, seed=3)
    want_x = x.clone().requires_grad_()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.autograd.backward(want_x[token_idx], g)
    finally:
        torch.set_num_threads(threads)
    for idx in (token_idx, token_idx.to(torch.int32)):
        xr = x.clone().requires_grad_()
        rows = dispatch.gather(xr, idx)
        assert same(rows, x[token_idx])
        rows.backward(g)
        if dtype == torch.float32 or device != "cpu":
            assert same(xr.grad, want_x.grad)
        assert not xr.grad[tokens - 2:].any()  # (tokens with no row)
    with pytest.raises(ValueError, match="gather: expected x a 2-D .* got a 1-D"):
        dispatch.gather(x[0], token_idx)
    with pytest.raises(ValueError, match="gather: expected x a 2-D .* got a 2-D torch.float64 tensor"):
        dispatch.gather(x.double(), token_idx)
    with pytest.raises(ValueError, match="gather: expected token_idx 1-D int32 or int64"):
        dispatch.gather(x, token_idx.float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("all_to_all", [True, False])
def test_one_pass_dispatcher_is_torchtitans(device, all_to_all):
    """torchtitan's bf16 MoE with only its dispatcher swapped for OnePassTokenDispatcher
    (what convert does besides the experts): the output and the experts' weight
    gradients bit for bit (fp32 on the CPU, whose scatter_add adds bf16 otherwise; bf16
    on CUDA); x's and the router's gradients through the scores' gradient, which sums
    its fp32 dots in another order: within 1e-5 of fp32, 1e-2 of bf16 (relative L2)."""
    tt = pytest.importorskip("moe_fp8_ext.integrations.torchtitan")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    results = []
    for ours in (False, True):
        moe = tt.build_moe(256, 128, 4, 3, device=device, dtype=dtype, all_to_all=all_to_all)
        if ours:
            moe.routed_experts.token_dispatcher.__class__ = tt.OnePassTokenDispatcher
            moe.routed_experts.token_dispatcher.ep_mesh = None
        x = randn((2, 37, 256), dtype, device, seed=3).requires_grad_()
        out = moe(x)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            out.backward(randn(out.shape, dtype, device, seed=4))
        finally:
            torch.set_num_threads(threads)
        results.append({"out": out, "x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}})
    want, got = results
    for name in want:
        if name == "out" or "routed_experts" in name or "shared_experts" in name:
            assert same(got[name], want[name]), name
        else:
            assert rel(got[name], want[name]) < (1e-5 if dtype == torch.float32 else 1e-2), name


def test_dispatch_permutes_rows_and_pads_with_zeros(one_rank):
    r = moe_fp8_ext.get_recipe("fp8_blockwise")
    x = torch.randn(5, 256, dtype=torch.bfloat16, requires_grad=True)
    token_idx = torch.tensor([4, 0, 2, 2], dtype=torch.int32)
    perm = torch.tensor([3, -1, 0, 1, -1, 2], dtype=torch.int32)
    rows = fp8_dispatch(x, token_idx, r, None, [4], [4], perm=perm)
    ref = rows_reference(x.detach(), token_idx, r, rows._q.dtype)
    got = rows.dequantize()
    assert torch.equal(got[[0, 2, 3, 5]], ref[[2, 0, 1, 3]]) and not got[[1, 4]].any()
    q, s = dispatch.fp8_rows_operand(r, rows._q.dtype, rows)
    assert s.stride() == (1, 6)  # (the GEMM's column-major scales)


@pytest.mark.parametrize("recipe, compiled", [("fp8_blockwise", False), ("fp8_blockwise", True),
                                              ("fp8_rowwise", True)])
def test_dispatched_rows_into_fully_sharded_experts(one_rank, recipe, compiled):
    """FSDP2 hooks the inputs of a module it wraps (a whole view of each): fp8 rows go into
    a fully_shard'ed GroupedExperts (fp32 master weights, bf16 param_dtype; a one-rank
    group, as torchtitan's EP over every rank) with the bits of the bf16-weight module.
    ``compiled`` (not fullgraph): FSDP2's hooks break the graph, so the rows are the first
    graph's output, whose gradient the second graph's backward gives as an Fp8Rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    r = moe_fp8_ext.get_recipe(recipe)
    torch.manual_seed(0)
    sharded = moe_fp8_ext.GroupedExperts(256, 128, 2, recipe=r, dtype=torch.float32)
    plain = moe_fp8_ext.GroupedExperts(256, 128, 2, recipe=r, dtype=torch.bfloat16)
    plain.load_state_dict({k: v.bfloat16() for k, v in sharded.state_dict().items()})
    fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x = torch.randn(9, 256, dtype=torch.bfloat16, requires_grad=True)
    token_idx = torch.tensor([4, 0, 2, 2, 8, 7, 1, 3], dtype=torch.int32)
    counts = torch.tensor([3, 5], dtype=torch.int32)
    results = []
    torch._dynamo.reset()
    for layer in (sharded, plain):
        x.grad = None
        step = lambda: layer(fp8_dispatch(x, token_idx, r, None, [8], [8]), counts)  # noqa: E731
        out = (torch.compile(step, backend="aot_eager") if compiled and layer is sharded else step)()
        out.square().sum().backward()
        results.append([out, x.grad] + [getattr(p.grad, "_local_tensor", p.grad) for p in layer.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a.float(), b.float())
    assert torch.ops.aten.view.default(fp8_dispatch(x, token_idx, r, None, [8], [8]), [-1, 256]).shape == (8, 256)
    with pytest.raises(TypeError, match="read by moe_fp8_ext.experts only"):
        fp8_dispatch(x, token_idx, r, None, [8], [8]).view(16, 128)
    rows = fp8_dispatch(x, token_idx, r, None, [8], [8])
    (g,) = torch.autograd.grad(plain(rows, counts).square().sum(), rows)  # (its wrapper computes as its tensor)
    assert isinstance(g, Fp8Rows) and type(g * 1) is torch.Tensor and torch.equal(g * 1, g._q)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
@pytest.mark.parametrize("sent", [False, True])
@torch._dynamo.config.patch(capture_scalar_outputs=True)
def test_fp8_dispatch_under_fullgraph_compile(one_rank, device, recipe, sent):
    """torch.compile(fullgraph=True) around the fp8 dispatch and the experts layer
    (torchtitan compiles its blocks so): one graph with the eager bits, output and
    gradients. ``sent``: through the all-to-all, its split sizes read with .tolist() in
    the graph (unbacked ints, as torchtitan's dispatcher has them; one rank: gloo, CPU)."""
    if sent and device != "cpu":
        pytest.skip("the one-rank group is gloo's (CPU); GPUs: tests/test_expert_parallel.py --compile")
    r = moe_fp8_ext.get_recipe(recipe)
    x = randn((37, 256), torch.bfloat16, device, seed=1)
    token_idx = torch.randint(0, 37, (70,), generator=torch.Generator().manual_seed(2), dtype=torch.int32).to(device)
    ws = weights(3, 128, 256, device)
    counts = torch.tensor([20, 0, 50], dtype=torch.int32, device=device)
    grad = randn((70, 256), torch.bfloat16, device, seed=3)

    def layer(x, w1, w3, w2):
        if sent:
            splits = torch.stack([counts.sum(), counts.sum()]).view(2, 1).tolist()
            rows = fp8_dispatch(x, token_idx, r, dist.group.WORLD, *splits)
        else:
            rows = fp8_dispatch(x, token_idx, r)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return moe_fp8_ext.experts(rows, w1, w3, w2, offs, recipe=r)

    results = []
    for fn in (layer, torch.compile(layer, backend="inductor" if device == "cuda" else "aot_eager", fullgraph=True)):
        inputs = [t.detach().clone().requires_grad_() for t in (x, *ws)]
        out = fn(*inputs)
        out.backward(grad)
        results.append([out] + [t.grad for t in inputs])
    torch._dynamo.reset()
    assert all(g is not None and same(a, g) for a, g in zip(*results))


@pytest.mark.parametrize("kind", ["gathered", "one_rank"])
@pytest.mark.parametrize("in_dtensor", [False, True])
def test_torchtitan_forward_under_compile_with_fp8_comm_weights(one_rank, kind, in_dtensor):
    """torchtitan's converted forward compiled, with weights all-gathered in fp8 or a
    one-rank group's ShardedWeight: traced (fullgraph), or inside DTensors (to_local, as
    expert parallelism with DTensor weights has them) run eagerly; the eager bits and
    gradients either way."""
    tt = pytest.importorskip("moe_fp8_ext.integrations.torchtitan")
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    r = moe_fp8_ext.get_recipe("fp8_blockwise")
    mesh = init_device_mesh("cpu", (1,))
    ws = weights(2, 128, 256, "cpu")
    made = gathered_layer(*ws, r) if kind == "gathered" else [ShardedWeight(w.clone(), r) for w in ws]

    class Experts(torch.nn.Module):
        forward = tt._fp8_forward

        def __init__(self):
            super().__init__()
            self.moe_fp8_recipe, self.moe_fp8_weight_cache = r, None
            for n, w in zip(tt._NAMES, made):
                w = DTensor.from_local(w.detach(), mesh, [Shard(0)], run_check=False) if in_dtensor else w.detach()
                setattr(self, n, torch.nn.Parameter(w))

    x, counts = torch.randn(8, 256, dtype=torch.bfloat16), torch.tensor([3, 5])
    results = []
    for compiled in (False, True):
        m = Experts()
        f = torch.compile(m, backend="aot_eager", fullgraph=not in_dtensor) if compiled else m
        xi = x.clone().requires_grad_()
        loss = f(xi, counts).float().square().sum()
        loss.backward()
        results.append([loss, xi.grad] + [getattr(p.grad, "_local_tensor", p.grad) for p in m.parameters()])
    torch._dynamo.reset()
    assert all(same(a, b) for a, b in zip(*results))


def test_dispatch_errors(one_rank):
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    idx = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="fp8_blockwise or fp8_rowwise"):
        fp8_dispatch(x, idx, moe_fp8_ext.get_recipe("mxfp8"), None, [4], [4])
    with pytest.raises(ValueError, match="token_idx int32"):
        fp8_dispatch(x, idx.long(), moe_fp8_ext.get_recipe("fp8_blockwise"), None, [4], [4])
    with pytest.raises(ValueError, match="summing to 4"):
        fp8_dispatch(x, idx, moe_fp8_ext.get_recipe("fp8_blockwise"), None, [3], [3])
    with pytest.raises(ValueError, match="both input_splits and output_splits, or neither"):
        fp8_dispatch(x, idx, moe_fp8_ext.get_recipe("fp8_blockwise"), None, [4])
    with pytest.raises(ValueError, match="expected input_splits and output_splits with a group"):
        fp8_dispatch(x, idx, moe_fp8_ext.get_recipe("fp8_blockwise"), dist.group.WORLD)
    with pytest.raises(ValueError, match="fp8_dispatch: expected recipe in"):
        fp8_dispatch(x, idx, "fp8_blockwize", None, [4], [4])
    rows = fp8_dispatch(x, idx, moe_fp8_ext.get_recipe("fp8_blockwise"), None, [4], [4])
    by_name = fp8_dispatch(x, idx, "fp8_blockwise", None, [4], [4])  # (a recipe's name, as every call takes)
    assert same(by_name.dequantize(), rows.dequantize())
    w = weights(1, 128, 128, "cpu")
    with pytest.raises(ValueError, match="rows dispatched for recipe"):
        moe_fp8_ext.experts(rows, *w, torch.tensor([4], dtype=torch.int32), recipe="fp8_rowwise")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_gathered_weights_on_the_gpu_run_the_real_gemm(transposed):
    r = moe_fp8_ext.get_recipe("fp8_blockwise")
    assert r.backend(torch.device("cuda")) == "blockwise_gemm"
    for recipe in ("fp8_blockwise", "fp8_rowwise"):  # (W1 and W3 gathered together: the SwiGLU GEMM's operand)
        test_gathered_weights_give_the_bits_of_the_weights("cuda", recipe, 256, 144, transposed, joint=True)


@pytest.mark.parametrize("offset", [0, 1])
def test_row_shards_joined_from_the_gather(offset):
    """A backward operand gathered by rows arrives as each rank's (cols, rows/n) of each
    expert side by side; fsdp._whole joins them into (E, cols, rows), for every width a
    word divides (and none, at an odd storage offset)."""
    e, n, cols = 2, 4, 5
    for part in (3, 6, 12, 16, 88):
        buf = torch.randint(0, 255, (offset + e * n * cols * part,), dtype=torch.uint8)[offset:]
        gathered = buf.view(e, n, cols, part)
        got = fsdp._whole(gathered.view(torch.float8_e4m3fn).permute(0, 2, 1, 3))
        assert got.dtype == torch.float8_e4m3fn and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), gathered.permute(0, 2, 1, 3).reshape(e, cols, n * part))


def test_work_ahead_is_taken_once_and_only_for_unchanged_shards():
    """What one gather leaves for another (fsdp._Ahead: the joint backward operand, the
    started column amaxes) is taken once, and not at all once a shard was written (a step
    or a load in between) or replaced, or a copy of the module is made."""
    w1, w3 = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    ahead = fsdp._Ahead()
    ahead.put("operand", [w1, w3], "made")
    assert ahead.take("operand", [w1, w3]) == "made" and ahead.take("operand", [w1, w3]) is None
    ahead.put("operand", [w1, w3], "made")
    assert ahead.take("operand", [w3, w1]) is None  # (other shards: the entry is dropped)
    assert ahead.take("operand", [w1, w3]) is None
    ahead.put("amax", [w1, w3], "joint")
    ahead.put("amax", [w1], "one")  # (a slot a number of shards)
    ahead.put("amax", [w3], "other")  # (replaces [w1]'s)
    assert ahead.take("amax", [w1]) is None and ahead.take("amax", [w1, w3]) == "joint"
    ahead.put("amax", [w1, w3], "started")
    with torch.no_grad():
        w3.add_(1)
    assert ahead.take("amax", [w1, w3]) is None
    module = torch.nn.Linear(2, 2)
    fsdp._Ahead.of(module).put("amax", [w1], "started")
    assert fsdp._Ahead.of(module) is fsdp._Ahead.of(module)
    import copy

    assert fsdp._Ahead.of(copy.deepcopy(module)).take("amax", [w1]) is None
    assert fsdp._Ahead.of(module).take("amax", [w1]) == "started"


@pytest.mark.parametrize("dim", [1, 2])
def test_fp8_joined_as_torch_cat(dim):
    """fsdp._join, the joined [W1; W3] operand: torch.cat's bytes, for pieces that are
    3-D or (along 2) the ranks' parts of a gather, at widths and offsets that take every
    word size, and strided pieces."""
    e, n = 2, 4
    for widths in ([8, 16], [24, 40], [12, 4], [6, 10], [3, 5], [16]):
        for offset in (0, 1, 8):
            buf = torch.randint(0, 255, (offset + 4 * e * 16 * 64 * n,), dtype=torch.uint8)[offset:]
            pieces, want, at = [], [], 0
            for i, w in enumerate(widths):
                size = e * (9 * w * n if dim == 2 else 16 * w)
                flat = buf[at:at + size]
                at += size + 8
                if dim == 2 and i % 2 == 0:  # (the ranks' parts as gathered: (E, n, 9, w) read (E, 9, n, w))
                    piece = flat.view(e, n, 9, w).permute(0, 2, 1, 3)
                    want.append(piece.reshape(e, 9, n * w))
                else:
                    piece = flat.view(e, 9, w * n) if dim == 2 else flat.view(e, w, 16)
                    want.append(piece)
                pieces.append(piece.view(torch.float8_e4m3fn))
            got = fsdp._join(pieces, dim)
            assert got.dtype == torch.float8_e4m3fn and got.is_contiguous()
            assert torch.equal(got.view(torch.uint8), torch.cat(want, dim)), (widths, offset)
    strided = torch.randint(0, 255, (e, 16, 32), dtype=torch.uint8)[:, :, :16]  # (rows of 16 bytes, stride 32)
    got = fsdp._join([strided.view(torch.float8_e4m3fn)] * 2, dim)
    assert torch.equal(got.view(torch.uint8), torch.cat([strided] * 2, dim))
