"""moe_fp8_ext.integrations.torchtitan.convert on torchtitan 0.3.0's real MoE layer
(router + LocalTokenDispatcher + GroupedExperts + shared experts). Skipped when
torchtitan is not installed (CI installs it, --no-deps, with the few packages its MoE
import chain needs: spmd_types, tyro, docstring_parser, triton)."""

import copy
from dataclasses import replace

import pytest
import torch

tt_moe = pytest.importorskip("torchtitan.models.common.moe")

from moe_fp8_ext.experts import WeightCache  # noqa: E402
from moe_fp8_ext.integrations.torchtitan import build_moe as titan_moe  # noqa: E402
from moe_fp8_ext.integrations.torchtitan import convert, unconvert  # noqa: E402
from moe_fp8_ext.recipes import Fp8Rowwise, get_recipe  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def sqnr(ref, x):
    ref, x = ref.float(), x.float()
    return (20 * torch.log10(ref.norm() / (ref - x).norm())).item()


def build_moe(e=8, dim=128, hidden=64, top_k=2, device="cpu", seed=0):
    return titan_moe(dim, hidden, e, top_k, device=device, seed=seed)


def fwd_bwd(moe, x, grad):
    x = x.clone().requires_grad_()
    out = moe(x)
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in moe.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
def test_convert_keeps_parameters_and_matches(device):
    ref = build_moe(device=device)
    moe = copy.deepcopy(ref)
    params = dict(moe.named_parameters())
    keys = list(moe.state_dict())
    assert convert(moe, "fp8_rowwise", reuse_weights=True) == 1
    inner = moe.routed_experts.inner_experts
    assert type(inner).__name__ == "Fp8GroupedExperts" and isinstance(inner, tt_moe.GroupedExperts)
    assert isinstance(inner.moe_fp8_weight_cache, WeightCache)
    assert list(moe.state_dict()) == keys
    assert all(p is params[n] for n, p in moe.named_parameters())

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 96, 128, generator=g).to(device=device, dtype=torch.bfloat16)
    grad = torch.randn(2, 96, 128, generator=g).to(device=device, dtype=torch.bfloat16)
    out_ref, gx_ref, gp_ref = fwd_bwd(ref, x, grad)
    out, gx, gp = fwd_bwd(moe, x, grad)
    got = {"out": sqnr(out_ref, out), "grad_x": sqnr(gx_ref, gx)}
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        key = "routed_experts.inner_experts." + n
        got[n] = sqnr(gp_ref[key], gp[key])
    print(device, {k: round(v, 1) for k, v in got.items()})
    # fp8 rowwise against torchtitan's bf16 experts (the shared experts and router
    # stay bf16, so the layer output is closer than the experts' own 23 dB).
    assert got["out"] > 25 and got["grad_x"] > 23 and min(got[n] for n in ("w1_EFD", "w2_EDF", "w3_EFD")) > 20, got

    # bf16 through our layer: torchtitan's own math up to summation order
    assert convert(moe, "bf16") == 1
    assert inner.moe_fp8_weight_cache is None  # off by default (FSDP2: see convert's docs)
    out_b, gx_b, _ = fwd_bwd(moe, x, grad)
    assert sqnr(out_ref, out_b) > 35 and sqnr(gx_ref, gx_b) > 35
    assert unconvert(moe) == 1 and type(moe.routed_experts.inner_experts) is tt_moe.GroupedExperts
    out_u, _, _ = fwd_bwd(moe, x, grad)
    assert torch.equal(out_u, out_ref)


def test_convert_trains():
    """A few optimizer steps on the converted layer: the weight cache is emptied by
    each step and the loss goes down like the bf16 layer's."""
    torch.manual_seed(0)
    losses = {}
    for recipe in ("bf16", "fp8_rowwise"):
        moe = build_moe(e=4, dim=64, hidden=64)
        convert(moe, recipe)
        opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(2)
        x = torch.randn(4, 64, 64, generator=g).to(torch.bfloat16)
        target = torch.randn(4, 64, 64, generator=g).to(torch.bfloat16)
        curve = []
        for _ in range(8):
            loss = torch.nn.functional.mse_loss(moe(x).float(), target.float())
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.item())
        losses[recipe] = curve
    assert losses["fp8_rowwise"][-1] < losses["fp8_rowwise"][0]
    assert abs(losses["fp8_rowwise"][-1] - losses["bf16"][-1]) / losses["bf16"][-1] < 0.05, losses


def test_convert_errors():
    with pytest.raises(ValueError, match="recipe"):
        convert(torch.nn.Linear(2, 2), "nope")
    with pytest.raises(TypeError, match="nn.Module"):
        convert("model")
    assert convert(torch.nn.Linear(2, 2)) == 0


def moe_config(e=8, dim=128, hidden=64, top_k=2):
    """The config tree of build_moe's layer (shared experts left out)."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    return tt_moe.MoE.Config(
        num_experts=e,
        routed_experts=tt_moe.RoutedExperts.Config(
            inner_experts=tt_moe.GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=e),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=e, top_k=top_k)),
        router=tt_moe.TokenChoiceTopKRouter.Config(num_experts=e, gate=Linear.Config(in_features=dim, out_features=e,
                                                                                   bias=False), top_k=top_k),
    )


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise", "mxfp8", "bf16",
                                    pytest.param(Fp8Rowwise(gemm_kernel="torch", hold_weight_operands=False),
                                                 id="Fp8Rowwise-fields")])
def test_config_converter_builds_fp8_experts(recipe):
    """ExpertsConverter in torchtitan's converters=[...] path: the GroupedExperts config
    becomes ours, the built module runs moe_fp8_ext.experts with the recipe (the same
    output as converting the built bf16 module) and keeps torchtitan's parameters; the
    token dispatcher becomes our one-pass one (no padding swap)."""
    from moe_fp8_ext.integrations.torchtitan import ExpertsConverter, OnePassTokenDispatcher

    cfg = ExpertsConverter.Config(recipe=recipe).build().convert(moe_config())
    inner_cfg = cfg.routed_experts.inner_experts
    assert isinstance(inner_cfg, tt_moe.GroupedExperts.Config) and inner_cfg.moe_fp8_recipe == recipe
    assert type(cfg.routed_experts.token_dispatcher) is OnePassTokenDispatcher.Config
    torch.manual_seed(0)
    built = cfg.build()
    torch.manual_seed(0)
    plain = moe_config().build()
    for module in (built, plain):
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    convert(plain, recipe)
    inner = built.routed_experts.inner_experts
    assert type(inner).__name__ == "Fp8GroupedExperts" and inner.moe_fp8_recipe == get_recipe(recipe)
    assert [n for n, _ in built.named_parameters()] == [n for n, _ in plain.named_parameters()]
    x = torch.randn(2, 48, 128)
    assert torch.equal(built(x), plain(x))


def test_config_converter_filter_and_errors():
    from moe_fp8_ext.integrations.torchtitan import ExpertsConverter

    cfg = ExpertsConverter.Config(filter_fqns=["routed_experts"]).build().convert(moe_config())
    assert type(cfg.routed_experts.inner_experts) is tt_moe.GroupedExperts.Config
    with pytest.raises(ValueError, match="recipe"):
        ExpertsConverter.Config(recipe="fp9").build()


def test_convert_refuses_what_it_cannot_run():
    class Biased(tt_moe.GroupedExperts):
        def forward(self, x, counts):
            return super().forward(x, counts) + 1

    module = Biased(tt_moe.GroupedExperts.Config(dim=64, hidden_dim=64, num_experts=2))
    with pytest.raises(TypeError, match="overrides forward"):
        convert(module)
    assert type(module) is Biased
    class Scaled(tt_moe.GroupedExperts):  # torchtitan's seam for its own fp8 classes
        def _grouped_mm(self, x, w, offs):
            return 2 * super()._grouped_mm(x, w, offs)

    from moe_fp8_ext.integrations.torchtitan import ExpertsConverter
    module = Scaled(tt_moe.GroupedExperts.Config(dim=64, hidden_dim=64, num_experts=2))
    with pytest.raises(TypeError, match="overrides _grouped_mm"):
        convert(module)
    assert type(module) is Scaled
    from torchtitan.components.quantization.mx import _get_mxfp8_grouped_experts_cls

    cfg = moe_config()  # (torchtitan's own MXFP8 experts: a _grouped_mm override with a Config of its own)
    cfg.routed_experts.inner_experts = _get_mxfp8_grouped_experts_cls(tt_moe.GroupedExperts).Config(
        dim=128, hidden_dim=64, num_experts=8)
    with pytest.raises(TypeError, match="overrides _grouped_mm"):
        ExpertsConverter.Config().build().convert(cfg)
    from moe_fp8_ext.integrations.torchtitan import converted_class

    after_ours = _get_mxfp8_grouped_experts_cls(converted_class(tt_moe.GroupedExperts))  # (listed after ours)
    with pytest.raises(TypeError, match="overrides _grouped_mm"):
        after_ours(after_ours.Config(dim=128, hidden_dim=128, num_experts=2))
    odd = tt_moe.GroupedExperts(tt_moe.GroupedExperts.Config(dim=48, hidden_dim=40, num_experts=2))
    with pytest.raises(ValueError, match="cannot run recipe 'mxfp8'"):
        convert(odd, "mxfp8")
    assert type(odd) is tt_moe.GroupedExperts
    cfg = ExpertsConverter.Config(recipe="mxfp8").build().convert(moe_config())  # (built later: checked then)
    cfg.routed_experts.inner_experts = replace(cfg.routed_experts.inner_experts, dim=48, hidden_dim=40)
    with pytest.raises(ValueError, match="ExpertsConverter: GroupedExperts cannot run recipe 'mxfp8'"):
        cfg.routed_experts.inner_experts.build()


def test_converted_model_pickles_and_copies():
    import io

    moe = build_moe()
    convert(moe, "fp8_blockwise", reuse_weights=True)
    x = torch.randn(2, 40, 128, dtype=torch.bfloat16)
    want = moe(x)
    buf = io.BytesIO()
    torch.save(moe, buf)
    buf.seek(0)
    for back in (torch.load(buf, weights_only=False), copy.deepcopy(moe)):
        inner = back.routed_experts.inner_experts
        assert type(inner) is type(moe.routed_experts.inner_experts)
        assert inner.moe_fp8_recipe.name == "fp8_blockwise" and isinstance(inner.moe_fp8_weight_cache, WeightCache)
        assert torch.equal(back(x), want)


def test_convert_refuses_an_instance_forward_it_does_not_know():
    """A forward stored on the instance by anything but torchtitan's parallelize would keep
    the bf16 forward running after a class swap: convert raises and changes nothing."""
    moe = build_moe()
    inner = moe.routed_experts.inner_experts
    inner.forward = lambda x, counts: tt_moe.GroupedExperts.forward(inner, x, counts)
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        convert(moe, "fp8_rowwise")
    assert type(inner) is tt_moe.GroupedExperts and not hasattr(inner, "moe_fp8_recipe")


# ---- shared experts (shared_experts=True): torchtitan's FeedForward as one expert that every token goes to


def shared_weights(ffn):
    return [getattr(ffn, n).weight for n in ("w1", "w3", "w2")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise", "mxfp8", "bf16"])
def test_convert_shared_experts(device, recipe):
    """The shared experts run moe_fp8_ext.experts with one group of all tokens (bit for bit), keep their parameters,
    and train like torchtitan's bf16 FeedForward; bf16 is its math; unconvert restores it."""
    from moe_fp8_ext import experts

    ref = build_moe(device=device)
    moe = copy.deepcopy(ref)
    keys = list(moe.state_dict())
    params = dict(moe.named_parameters())
    assert convert(moe, recipe, shared_experts=True) == 2
    ffn = moe.shared_experts
    assert type(ffn).__name__ == "Fp8FeedForward" and ffn.moe_fp8_recipe == get_recipe(recipe)
    assert list(moe.state_dict()) == keys and all(p is params[n] for n, p in moe.named_parameters())

    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 77, 128, generator=g).to(device=device, dtype=torch.bfloat16)  # (154 rows: odd, not 128's)
    offs = torch.tensor([154], dtype=torch.int32, device=device)
    want = experts(x.view(-1, 128), *(w.unsqueeze(0) for w in shared_weights(ffn)), offs, recipe=recipe)
    assert torch.equal(ffn(x), want.view(2, 77, 128))
    grad = torch.randn(2, 77, 128, generator=g).to(device=device, dtype=torch.bfloat16)
    _, gx_ref, gp_ref = fwd_bwd(ref.shared_experts, x, grad)
    out, gx, gp = fwd_bwd(ffn, x, grad)
    floor = 60 if recipe == "bf16" else 20  # (bf16: torchtitan's own matmuls up to summation order)
    assert sqnr(ref.shared_experts(x), out) > floor and sqnr(gx_ref, gx) > floor
    assert all(sqnr(gp_ref[n], gp[n]) > floor for n in gp_ref), {n: sqnr(gp_ref[n], gp[n]) for n in gp_ref}

    assert convert(moe, "fp8_rowwise") == 1 and ffn.moe_fp8_recipe.name == "fp8_rowwise"  # (converted again)
    assert unconvert(moe) == 2 and type(ffn) is type(ref.shared_experts) and not hasattr(ffn, "moe_fp8_recipe")
    assert torch.equal(ffn(x), ref.shared_experts(x))


def test_config_converter_shared_experts():
    """ExpertsConverter(shared_experts=True) builds the shared experts converted: the model convert() makes."""
    from moe_fp8_ext.integrations.torchtitan import ExpertsConverter

    config = ExpertsConverter.Config(recipe="fp8_blockwise", shared_experts=True)
    built = titan_moe(128, 64, 8, 2, converter=config)
    plain = build_moe()
    assert convert(plain, "fp8_blockwise", shared_experts=True) == 2
    assert type(built.shared_experts) is type(plain.shared_experts)
    assert built.shared_experts.moe_fp8_recipe.name == "fp8_blockwise"
    x = torch.randn(2, 40, 128, dtype=torch.bfloat16)
    assert torch.equal(built(x), plain(x))
    kept = titan_moe(128, 64, 8, 2, converter=ExpertsConverter.Config(shared_experts=True,
                                                                      filter_fqns=["shared_experts"]))
    assert not hasattr(kept.shared_experts, "moe_fp8_recipe")
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear

    cfg = moe_config()
    cfg.shared_experts = FeedForward.Config(w1=Linear.Config(in_features=128, out_features=64),
                                            w2=Linear.Config(in_features=64, out_features=128),
                                            w3=Linear.Config(in_features=128, out_features=64))
    for recipe, shared in (("fp8_rowwise", True), ("fp8_blockwise", False)):  # (converted again: the new recipe)
        cfg = ExpertsConverter.Config(recipe=recipe, shared_experts=shared).build().convert(cfg)
        assert cfg.shared_experts.moe_fp8_recipe == recipe == cfg.routed_experts.inner_experts.moe_fp8_recipe
    assert ExpertsConverter.Config(shared_experts=True).build().convert(moe_config()).shared_experts is None


def test_shared_experts_reuse_weights_and_compile():
    """reuse_weights: the second micro-batch reads the cached operands; torch.compile (fullgraph) gives the eager
    bits."""
    moe = build_moe()
    convert(moe, "fp8_blockwise", reuse_weights=True, shared_experts=True)
    ffn = moe.shared_experts
    x = torch.randn(3, 50, 128, dtype=torch.bfloat16)
    for _ in range(2):
        ffn(x).sum().backward()
    assert ffn.moe_fp8_weight_cache.hits > 0
    plain = build_moe()
    convert(plain, "fp8_rowwise", shared_experts=True)
    assert torch.equal(torch.compile(plain.shared_experts, fullgraph=True)(x), plain.shared_experts(x))
    # compiled inside activation checkpointing (which refuses side effects): the cache is not touched
    experts = moe.routed_experts.inner_experts
    cache = experts.moe_fp8_weight_cache
    seen = (cache.hits, cache.misses)
    xe, counts = torch.randn(40, 128, dtype=torch.bfloat16), torch.tensor([5, 0, 9, 3, 7, 1, 10, 5])
    checkpointed = torch.compile(lambda x, c: torch.utils.checkpoint.checkpoint(experts, x, c, use_reentrant=False),
                                 fullgraph=True, backend="aot_eager")
    out = checkpointed(xe, counts)
    assert (cache.hits, cache.misses) == seen and torch.equal(out, experts(xe, counts))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe,fp8_dispatch", [("fp8_blockwise", False), ("fp8_blockwise", True),
                                                 ("fp8_rowwise", False), ("fp8_rowwise", True),
                                                 ("mxfp8", False), ("bf16", False)])
@torch._dynamo.config.patch(capture_scalar_outputs=True)
def test_converted_moe_compiles_across_graph_breaks(device, recipe, fp8_dispatch):
    """torch.compile without fullgraph, graph breaks just before and after the experts
    layer (as a user's code or FSDP2's hooks put them): the eager bits, the output and
    every gradient, over two steps."""
    from moe_fp8_ext.integrations.torchtitan import ExpertsConverter

    def graph_break(*args):
        torch._dynamo.graph_break()

    results = []
    for compiled in (False, True):
        moe = titan_moe(256, 128, 4, 3, device=device, shared_experts=False,
                        converter=ExpertsConverter.Config(recipe=recipe, fp8_dispatch=fp8_dispatch))
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        if compiled:
            moe.routed_experts.inner_experts.register_forward_pre_hook(graph_break)
            moe.routed_experts.inner_experts.register_forward_hook(graph_break)
        f = torch.compile(moe, backend="aot_eager") if compiled else moe
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            x = torch.randn(2, 37, 256, generator=g).to(device, torch.bfloat16).requires_grad_()
            out = f(x)
            out.backward(torch.randn(out.shape, generator=g).to(device, torch.bfloat16))
        results.append([out, x.grad] + [p.grad for p in moe.parameters()])
        if compiled:  # (the breaks took effect: router, experts and combine apart)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 3
    torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_shared_experts_refusals():
    """What shared_experts=True cannot run raises before anything changes (convert and the config converter): a
    forward of its own, shared experts that are not a FeedForward, a biased Linear or one with its own forward, forward
    hooks or an unknown instance forward on a Linear; a config changed after conversion raises at build; DTensor
    weights (tensor parallelism) at forward. The fp8 all-gather leaves shared experts to FSDP2 (bf16)."""
    from torchtitan.models.common.feed_forward import FeedForward, SigmoidGatedFeedForward
    from torchtitan.models.common.linear import Linear, ScaledBiasRowwiseLinear

    from moe_fp8_ext.integrations.torchtitan import ExpertsConverter

    def refused(moe, err, match):
        with pytest.raises(err, match=match):
            convert(moe, "fp8_rowwise", shared_experts=True)
        assert not hasattr(moe.routed_experts.inner_experts, "moe_fp8_recipe")  # (nothing changed)
        assert not hasattr(moe.shared_experts, "moe_fp8_recipe")

    gated = build_moe()
    base = gated.shared_experts
    gated.shared_experts = SigmoidGatedFeedForward.__new__(SigmoidGatedFeedForward)
    gated.shared_experts.__dict__.update(base.__dict__)
    refused(gated, TypeError, "overrides forward")
    other = build_moe()
    other.shared_experts = torch.nn.Sequential(torch.nn.Linear(128, 128))
    refused(other, TypeError, "to be a FeedForward")
    for attr, value, err, match in (("bias", torch.nn.Parameter(torch.zeros(64)), TypeError, "without bias"),
                                    ("forward", lambda x: x, RuntimeError, "would not call")):
        moe = build_moe()
        setattr(moe.shared_experts.w1, attr, value)
        refused(moe, err, match)
    hooked = build_moe()
    hooked.shared_experts.w3.register_forward_pre_hook(lambda m, a: None)
    refused(hooked, TypeError, "forward hooks")

    def shared_config(w1):
        cfg = moe_config()
        cfg.shared_experts = FeedForward.Config(w1=w1, w2=Linear.Config(in_features=64, out_features=128),
                                                w3=Linear.Config(in_features=128, out_features=64))
        return cfg

    for w1, match in ((Linear.Config(in_features=128, out_features=64, bias=True), "without bias"),
                      (ScaledBiasRowwiseLinear.Config(in_features=128, out_features=64), "nn.Linear's forward")):
        cfg = shared_config(w1)
        with pytest.raises(TypeError, match=match):
            ExpertsConverter.Config(shared_experts=True).build().convert(cfg)
        assert type(cfg.routed_experts.inner_experts) is tt_moe.GroupedExperts.Config  # (nothing changed)
    cfg = ExpertsConverter.Config(shared_experts=True).build().convert(shared_config(
        Linear.Config(in_features=128, out_features=64)))
    cfg.shared_experts.w1.bias = True  # (changed after our converter, e.g. by a later one)
    with pytest.raises(TypeError, match="without bias"):
        cfg.build()

    moe = build_moe()
    convert(moe, "fp8_rowwise", shared_experts=True)

    class Sharded(torch.Tensor):  # (stands in for a tensor-parallel DTensor weight)
        def to_local(self):
            return self

    w1 = moe.shared_experts.w1
    w1.weight = torch.nn.Parameter(w1.weight.detach().as_subclass(Sharded))
    with pytest.raises(RuntimeError, match="tensor parallelism"):
        moe.shared_experts(torch.randn(1, 8, 128, dtype=torch.bfloat16))
    import types

    moe = build_moe()  # (parallelized after conversion: under spmd_types the weights stay plain tensors)
    convert(moe, "fp8_rowwise", shared_experts=True)
    with pytest.raises(RuntimeError, match="does not run tensor parallelism"):
        moe.shared_experts.parallelize(types.SimpleNamespace(tp_enabled=True))

    from moe_fp8_ext import fsdp

    moe = build_moe()
    convert(moe, "fp8_rowwise", shared_experts=True)
    assert fsdp.fp8_all_gather(moe) == 1 and not hasattr(moe.shared_experts, "moe_fp8_all_gather")


def test_shared_experts_odd_inputs_and_copies():
    """No tokens, a non-contiguous input, fp32 weights (fp8 recipes quantize them directly); the converted module
    deep-copies and pickles."""
    import io

    moe = build_moe()
    convert(moe, "fp8_blockwise", shared_experts=True)
    ffn = moe.shared_experts
    assert ffn(torch.randn(0, 7, 128, dtype=torch.bfloat16)).shape == (0, 7, 128)
    x = torch.randn(3, 128, 40, dtype=torch.bfloat16).transpose(1, 2)
    assert torch.equal(ffn(x), ffn(x.contiguous()))
    fp32 = build_moe()
    fp32.float()
    convert(fp32, "fp8_blockwise", shared_experts=True)
    assert torch.equal(fp32.shared_experts(x.float()), ffn(x).float())  # (the same fp8 operands: bf16 weights exactly)
    buf = io.BytesIO()
    torch.save(moe, buf)
    buf.seek(0)
    for back in (torch.load(buf, weights_only=False), copy.deepcopy(moe)):
        assert type(back.shared_experts) is type(ffn) and torch.equal(back.shared_experts(x), ffn(x))
