"""Shared test helpers: devices, realistic random data (values and token-group
`offs`), output poisoning, bit-exact comparison of fp8 codes and scales, SQNR, and
the GPU checks that several families share (GPU output = CPU output; a step captured
in a CUDA graph replays bit-equal to eager, so it never syncs with the host)."""

import os

import pytest
import torch

import moe_fp8_ext  # noqa: F401  (registers the ops)
from moe_fp8_ext import _C, _tuning

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
IN_DTYPES = [torch.bfloat16, torch.float16, torch.float32]

HAS_CUDA = torch.cuda.is_available() and moe_fp8_ext.build_info()["cuda"]
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")
DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.gpu)] * HAS_CUDA


def pytest_collection_modifyitems(config, items):
    """MOE_FP8_SKIP_CPU_CASES=1 (scripts/gpu_ci.sh --gpu-cases) deselects the cases whose
    `device` parameter is "cpu": on a GPU machine whose time is rationed, the CPU cases
    that CI runs on every commit (about half of the cases) need not run again. Cases
    without a `device` parameter, and every CUDA case, still run."""
    if os.environ.get("MOE_FP8_SKIP_CPU_CASES") != "1":
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        (drop if str(params.get("device", "")) == "cpu" else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def randn(shape, dtype, device="cpu", outliers=True, seed=None):
    """N(0, 1) with a few large outliers, in dtype; a fresh draw unless seeded."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if outliers and x.numel() > 0:
        idx = torch.randint(0, x.numel(), (max(1, x.numel() // 500),), generator=g)
        x.view(-1)[idx] *= 50.0
    return x.to(dtype).to(device)


def random_offs(num_tokens, num_groups, *, alignment=1, empty_frac=0.2, skew=1.0, tail=0, generator=None, device="cpu"):
    """Random token-group ends as a router makes them (DESIGN §3 `offs`): int32 of shape
    (num_groups,), cumulative, no leading zero. Group sizes are skewed (log-normal
    weights, `skew` = sigma of their log, 0 = balanced), about `empty_frac` of the
    groups are empty (never all of them while there are rows to place), every size is a
    multiple of `alignment`, and the last end is num_tokens - tail rounded down to
    `alignment`: the rows past it belong to no group. A fresh draw unless a generator
    is given."""
    if num_groups == 0:
        return torch.zeros(0, dtype=torch.int32, device=device)
    units = max(num_tokens - tail, 0) // alignment
    weights = torch.exp(skew * torch.randn(num_groups, generator=generator, dtype=torch.float64))
    empty = torch.rand(num_groups, generator=generator) < empty_frac
    if bool(empty.all()):
        empty[torch.randint(num_groups, (1,), generator=generator)] = False
    weights[empty] = 0
    sizes = torch.zeros(num_groups, dtype=torch.int64)
    if units > 0:
        picks = torch.multinomial(weights, units, replacement=True, generator=generator)
        sizes = torch.bincount(picks, minlength=num_groups)
    return torch.cumsum(sizes * alignment, 0).to(torch.int32).to(device)


# Router-like group sizes, multiples of 16, whose starts cover every multiple of 16 below
# 128, with empty groups, whole and partial last 128-row tiles (the grouped GEMMs' stores
# clip a group's partial last tile to its rows).
ROUTER_SIZES_16 = [144, 272, 0, 48, 400, 16, 128, 656, 32, 240, 256, 384, 0, 528, 112, 96]


def offs_from_sizes(sizes, device="cpu"):
    """The int32 group ends of explicit group sizes."""
    return torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0).to(torch.int32).to(device)


def sqnr(ref, x):
    """Signal-to-quantization-noise ratio in dB, 20 log10(|ref| / |ref - x|), in fp32."""
    ref, x = ref.float(), x.float()
    return (20 * torch.log10(ref.norm() / (ref - x).norm())).item()


def off_bf16_(w, seed=0):
    """fp32 ``w`` (any strides) made, in place, what reading it as bf16 has to round:
    random low 16 bits on its finite values, exact ties (low bits 0x8000) at some, and
    values past bf16's largest that round to Inf. NaN and Inf elements are kept. Returns w."""
    g = torch.Generator().manual_seed(seed)
    bits = w.cpu().view(torch.int32)
    low = torch.randint(0, 1 << 16, bits.shape, generator=g, dtype=torch.int32)
    pick = torch.randint(0, 97, bits.shape, generator=g)
    low = torch.where(pick == 0, torch.full_like(low, 0x8000), low)
    new = (bits & ~0xFFFF) | low
    new = torch.where(pick == 1, (bits & torch.iinfo(torch.int32).min) | 0x7F7FC000, new)  # (3.4e38: bf16's Inf)
    finite = torch.isfinite(w.cpu())
    w.view(torch.int32).copy_(torch.where(finite, new, bits).to(w.device))
    return w


def tiled_data(shape, dtype, device="cpu", seed=0, specials=True, *, tile, zero_frac, special_every):
    """randn with outliers, times a power of two that varies per `tile`-wide tile (so
    blocks along either dim see maxima over the dtype's range), a `zero_frac` of zero
    tiles, and (specials) single NaN / +-Inf / subnormal elements, one of each per
    `special_every` elements. The data of the block-scaled families (MXFP8, blockwise)."""
    import math

    g = torch.Generator().manual_seed(seed)
    x = randn(shape, torch.float32, seed=seed)
    if x.numel() == 0:
        return x.to(dtype).to(device)
    lo, hi = (-20, 12) if dtype == torch.float16 else (-140, 120)
    tiles = [math.ceil(n / tile) for n in shape]
    e = torch.randint(lo, hi, tiles, generator=g).float()
    e[torch.rand(tiles, generator=g) < zero_frac] = -1000  # zero tiles (2^-1000 = 0)
    for d, n in enumerate(shape):
        e = e.repeat_interleave(tile, dim=d).narrow(d, 0, n)
    x = (x.double() * torch.exp2(e.double())).to(dtype)
    if specials:
        flat = x.view(-1)
        tiny = torch.finfo(dtype).tiny
        for v in (float("nan"), float("inf"), -float("inf"), tiny / 4, -tiny / 8):
            flat[torch.randint(flat.numel(), (max(1, flat.numel() // special_every),), generator=g)] = v
    return x.to(device)


def strided_layouts_2d(make, m, k, dtype, device, specials=True):
    """Row-major, column-major and strided views of (m, k) drawn by make(shape, dtype,
    device, seed=, specials=)."""
    yield make((m, k), dtype, device, seed=1, specials=specials)
    yield make((k, m), dtype, device, seed=2, specials=specials).t()
    yield make((m, 2 * k + 1), dtype, device, seed=3, specials=specials)[:, 1 : 2 * k + 1 : 2]


_SMALL_POOL_MAX = 1 << 20  # the caching allocator serves requests up to 1 MiB from 2 MiB small-pool segments


def _free_blocks_of_this_stream():
    """Sizes of the caching allocator's free blocks that a request on the current stream
    can be given, with whether each lies in a small-pool segment (graph pools excluded)."""
    stream = torch.cuda.current_stream().cuda_stream
    return [(b["size"], seg["segment_type"] == "small")
            for seg in torch.cuda.memory_snapshot()
            if seg["stream"] == stream and tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0)
            for b in seg["blocks"] if b["state"] == "inactive"]


def poison(device):
    """Fill the caching allocator's free memory with 0xFF bytes (fp8 e4m3fn NaN, fp32
    NaN), so that any output element a kernel forgets to write shows up: a 512 MiB and a
    16 MiB block, two small-pool segments, then every other free block the current stream
    can be given (each taken by its size, small-pool ones 1 MiB at most, until none is
    left), each whole block filled, then all freed. An output is then poisoned unless the
    allocator needs a new segment for it (an allocation larger than any block held here).
    Assumes the allocator's default rounding (no roundup_power2_divisions)."""
    if device != "cuda":
        return
    torch.cuda.synchronize()
    held = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1 << 29, 1 << 24, 1 << 20, 1 << 20, 1 << 20, 1 << 20)]
    for _ in range(8):  # a taken block may split a larger one; the rest is taken next round
        free = _free_blocks_of_this_stream()
        if not free:
            break
        held += [torch.empty(min(size, _SMALL_POOL_MAX) if small else size, dtype=torch.uint8, device="cuda")
                 for size, small in free]
    # A request served from a free block up to 1 MiB larger than asked (the large pool
    # splits a block only where more than 1 MiB would be left) holds that rest too:
    # ask again for the whole block, which best fit then returns (nothing else is free).
    sizes = {b["address"]: b["size"] for seg in torch.cuda.memory_snapshot()
             for b in seg["blocks"] if b["state"] == "active_allocated"}
    for i in range(len(held)):
        size = sizes.get(held[i].data_ptr(), 0)
        if size > held[i].numel():
            held[i] = None
            held[i] = torch.empty(size, dtype=torch.uint8, device="cuda")
    for t in held:
        t.fill_(0xFF)
    del held


def set_dual_kernel_budget(monkeypatch, budget):
    """The dual_l2_bytes tuning knob for one test: "default" unsets it (the library's
    budget), anything else is its value ("0": the dual kernels never run). The knobs
    come back after the test (restore_tuning); monkeypatch stays for the callers."""
    del monkeypatch
    _C._set_tuning("dual_l2_bytes", None if budget == "default" else budget)


@pytest.fixture(autouse=True)
def restore_tuning():
    """Every tuning knob (moe_fp8_ext._tuning) as it was before the test."""
    before = {name: _tuning.get(name) for name in _tuning.KNOBS}
    yield
    for name, value in before.items():
        _C._set_tuning(name, value)


class _CountingOps:
    """Stands in for a module's ``_ops`` (torch.ops.moe_fp8, through which the library
    calls its ops internally, past the Python wrappers' checks): the ops named in
    ``labels`` append their label to ``calls`` before they run; every other op is the
    real one."""

    def __init__(self, real, labels, calls):
        self._real, self._labels, self._calls = real, labels, calls

    def __getattr__(self, name):
        op = getattr(self._real, name)
        if name not in self._labels:
            return op
        label = self._labels[name]
        return lambda *a, **kw: self._calls.append(label) or op(*a, **kw)


def count_op_calls(monkeypatch, module, labels, calls):
    """Record in ``calls`` each call that ``module`` makes of the ops named in ``labels``
    ({op name: label}) through its ``_ops``."""
    monkeypatch.setattr(module, "_ops", _CountingOps(module._ops, labels, calls))


def count_backward_operand_calls(monkeypatch, recipe_name):
    """A list that records, by name, every call that makes an operand only a backward
    uses with a forward one: the recipe's ``quantize`` returning both orientations
    ("quantize_both"), its ``quantize_weights`` returning both operands ("weights_both"),
    and the blockwise weight duals ("weight_dual", "weight_dual_cat"). Returns (calls,
    the recipe's class)."""
    from moe_fp8_ext import recipes

    recipe = type(recipes.get_recipe(recipe_name))
    calls = []
    for name, label in (("quantize", "quantize_both"), ("quantize_weights", "weights_both")):
        real = getattr(recipe, name)

        def spy(self, *a, real=real, label=label, **k):
            out = real(self, *a, **k)
            if out[0] is not None and out[1] is not None:
                calls.append(label)
            return out

        monkeypatch.setattr(recipe, name, spy)
    count_op_calls(monkeypatch, recipes.blockwise, {op: op[len("quantize_blockwise_"):] for op in (
        "quantize_blockwise_weight_dual", "quantize_blockwise_weight_dual_cat")}, calls)
    return calls, recipe


def holding(recipe_name):
    """The named fp8 recipe with ``hold_weight_operands=True`` (the forward makes and holds
    a weight's input-gradient operand where one read makes both; off by default)."""
    import dataclasses

    from moe_fp8_ext import recipes

    return dataclasses.replace(recipes.get_recipe(recipe_name), hold_weight_operands=True)


def force_weights_read_once(monkeypatch, recipe_name, once):
    """The recipe's rule for making a weight's two operands from one read (bwd=SAME_READ)
    forced to ``once`` (a bool, or a function of the weights), so that the CPU and a
    kernel-off GPU run the held path: fp8_rowwise's ``ops.dual_cat_reads_once``,
    fp8_blockwise's ``blockwise.weight_cat_ok``."""
    import moe_fp8_ext

    rule = once if callable(once) else (lambda b_ts: once)
    module = moe_fp8_ext.ops if recipe_name == "fp8_rowwise" else moe_fp8_ext.blockwise
    monkeypatch.setattr(module, "dual_cat_reads_once" if recipe_name == "fp8_rowwise" else "weight_cat_ok", rule)


def spy_weight_bwd_calls(monkeypatch, recipe_name):
    """A list with one entry per ``quantize_weights`` call that makes the input-gradient
    operand alone (the backward quantizing the weight again): the number of weights joined."""
    from moe_fp8_ext import recipes

    recipe = type(recipes.get_recipe(recipe_name))
    real, calls = recipe.quantize_weights, []

    def spy(self, b_ts, f8, *, fwd=True, bwd=False):
        if bwd is True and not fwd:
            calls.append(len(b_ts))
        return real(self, b_ts, f8, fwd=fwd, bwd=bwd)

    monkeypatch.setattr(recipe, "quantize_weights", spy)
    return calls, real


def count_zero_tail_calls(monkeypatch, zeroes):
    """A list that records each call of the zeroing op from then on (count_zero_rows_calls),
    with fp8_blockwise's 2d3d GEMM replaced by one that writes the rows past offs[-1] with
    zeros itself (``zeroes``, as its CUDA kernel does) or kept (the emulation, which zeroes
    them with the op)."""
    from moe_fp8_ext import recipes

    if zeroes:
        real = recipes.Fp8Blockwise.mm_2d3d

        def gemm(self, lhs, rhs, offs, out_dtype, backend):
            with monkeypatch.context() as m:
                m.setattr(recipes.blockwise, "_zero_tail", lambda out, offs: out)
                out = real(self, lhs, rhs, offs, out_dtype, backend)
            rows = torch.arange(out.shape[0], device=out.device)
            return torch.where((rows < offs[-1])[:, None], out, torch.zeros((), dtype=out.dtype))

        monkeypatch.setattr(recipes.Fp8Blockwise, "mm_2d3d", gemm)
    return count_zero_rows_calls(monkeypatch)


def count_zero_rows_calls(monkeypatch):
    """A list that records each call of the zeroing op (zero_rows_past_groups_) that the
    library makes from then on: through ``recipes.base._zero_tail``, or any other module of
    the grouped GEMM path that calls ops through its own ``_ops``."""
    import importlib

    calls = []
    for name in ("recipes.base", "grouped_mm", "experts"):  # (the package's grouped_mm and experts are the functions)
        count_op_calls(monkeypatch, importlib.import_module(f"moe_fp8_ext.{name}"), {"zero_rows_past_groups_": 1}, calls)
    return calls


def assert_fp8_equal(q, ref):
    """Bit-exact fp8 codes, except that NaN only has to match NaN."""
    assert q.dtype == ref.dtype, (q.dtype, ref.dtype)
    assert q.shape == ref.shape, (q.shape, ref.shape)
    qn, rn = torch.isnan(q.float()), torch.isnan(ref.float())
    assert torch.equal(qn.cpu(), rn.cpu()), f"NaN positions differ: {int((qn != rn).sum())} elements"
    a = q.view(torch.uint8).cpu()
    b = ref.view(torch.uint8).cpu()
    diff = (a != b) & ~rn.cpu()
    if diff.any():
        i = diff.nonzero()[0].tolist()
        raise AssertionError(f"{int(diff.sum())} of {a.numel()} codes differ; first at {i}: {a[tuple(i)]} vs {b[tuple(i)]}")


def assert_scale_equal(s, ref):
    assert s.shape == ref.shape, (s.shape, ref.shape)
    torch.testing.assert_close(s.cpu(), ref.cpu(), rtol=0, atol=0, equal_nan=True)


def same_as_cpu(op, *args):
    """op on the GPU gives the CPU op's strides and bits (fp32 outputs are scales,
    compared exactly; the others are fp8 codes), into poisoned memory."""
    poison("cuda")
    gpu = op(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args])
    cpu = op(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    for g, c in zip(gpu, cpu):
        assert g.stride() == c.stride()
        if g.dtype == torch.float32:
            assert_scale_equal(g, c)
        else:
            assert_fp8_equal(g, c)


def graph_matches_eager(step):
    """Run step() eagerly under torch's sync-debug mode "error" (a torch-level host
    sync raises), then capture it in a CUDA graph (any host sync, ours in C++ included,
    fails the capture), poison the graph's outputs, replay, and compare bit for bit."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(s):
            eager = [t.clone() for t in step()]
            step()  # warm-up before capture, on the side stream as capture requires
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    # the raw bits at the same element size (a view that keeps any strides)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    for t in outs:
        t.view(bits[t.element_size()]).fill_(0xFF if t.element_size() == 1 else -1)
    graph.replay()
    torch.cuda.synchronize()
    for t, ref in zip(outs, eager):
        assert torch.equal(t.view(bits[t.element_size()]), ref.view(bits[ref.element_size()])), (
            "graph replay differs from the eager step")
