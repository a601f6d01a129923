"""Every quantization op on data holding every edge class (issue 66; tests/edge_data.py:
NaN of any sign and payload, +-Inf, maxima of exactly 448 * 2^k and 240 * 2^k,
subnormal maxima, maxima near the dtype's limit, -0.0 and zero blocks) in every block
position, for bf16, fp16 and fp32 inputs, e4m3fn and e4m3fnuz (MXFP8: both roundings,
plain and blocked scales):
- on the CPU, bit for bit (q and scale bytes) equal to moe_fp8_ext.reference, which
  casts with torch (DESIGN §4's NaN rule applied), and to torchao where torchao is the
  reference (to_mx, the blockwise torch references; NaN bytes normalized, see there);
- on a GPU, bit for bit equal to the CPU op, strides included, into poisoned memory,
  on the same data and on larger shapes that take the kernels' other paths."""

import pytest
import torch

import moe_fp8_ext as M
from moe_fp8_ext import _tuning
from moe_fp8_ext import reference as ref

from conftest import poison, requires_cuda
from edge_data import edge_3d, edge_matrix, group_steps, steps

F8S = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
IN_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
E4 = torch.float8_e4m3fn


def _cm(t):
    """The same values with the last two dims column-major."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _offs(sizes):
    return torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0).to(torch.int32)


def _starts(offs, alignment):
    return ref.padded_group_offsets(offs, alignment)[0]


def _sizes(small, large, size):
    return small if size == "small" else large


# ---- the cases: each yields (label, fn, args, reference thunk, tuning) ----------------
# args are CPU tensors; the GPU test moves them. The tuning knobs (moe_fp8_ext._tuning)
# switch on GPU kernel paths that are not the default for the case's shape.


def rowwise_cases(dt, size):
    m, k = _sizes((40, 200), (300, 7000), size)
    x = edge_matrix(m, k, dt, steps(m, 1), [0])
    for layout, xx in (("row-major", x), ("column-major", _cm(x))):
        for f8 in F8S:
            for pow2 in (True, False):
                yield (f"quantize_rowwise {layout} {f8} pow2={pow2}", M.quantize_rowwise, (xx, f8, pow2),
                       lambda a=(x, f8, pow2): ref.quantize_rowwise(*a), {})


def experts_cases(dt, size):
    for which in ("fwd", "bwd"):
        if which == "fwd":  # sets: the K values of one (e, n)
            e, k, n = _sizes((3, 40, 14), (8, 512, 384), size)
            b = edge_3d(e, k, n, dt, [0], steps(n, 1))
        else:  # sets: the N values of one (e, k)
            e, k, n = _sizes((3, 14, 40), (8, 384, 512), size)
            b = edge_3d(e, k, n, dt, steps(k, 1), [0])
        fn = M.quantize_experts_fwd if which == "fwd" else M.quantize_experts_bwd
        rf = ref.quantize_experts_fwd if which == "fwd" else ref.quantize_experts_bwd
        for layout, bb in (("N contiguous", b), ("K contiguous", _cm(b))):
            for f8 in F8S:
                for pow2 in (True, False):
                    yield (f"quantize_experts_{which} {layout} {f8} pow2={pow2}", fn, (bb, f8, pow2),
                           lambda a=(b, f8, pow2), rf=rf: rf(*a), {})


def experts_cat_cases(dt, size):
    e, k, n1, n2 = _sizes((3, 40, 16, 18), (4, 512, 256, 208), size)
    for which in ("fwd", "bwd", "dual"):
        if which == "bwd":
            b = edge_3d(e, k, n1 + n2, dt, steps(k, 1), [0])
        else:
            b = edge_3d(e, k, n1 + n2, dt, [0], steps(n1 + n2, 1))
        # W^T of row-major W (K contiguous: the dual kernel's layout), the second part N-strided
        parts = [_cm(b[..., :n1]), b[..., n1:].contiguous()]
        fn = {"fwd": M.quantize_experts_fwd_cat, "bwd": M.quantize_experts_bwd_cat,
              "dual": M.quantize_experts_dual_cat}[which]

        def want(b=b, which=which, f8=None, pow2=True):
            out = ()
            if which != "bwd":
                out += ref.quantize_experts_fwd(b, f8, pow2)
            if which != "fwd":
                out += ref.quantize_experts_bwd(b, f8, pow2)
            return out

        for f8 in F8S:
            yield (f"quantize_experts_{which}_cat {f8}", fn, (parts, f8, True), lambda w=want, f8=f8: w(f8=f8), {})
        if which == "dual":  # both parts K contiguous: the dual kernel on a GPU
            titan = [_cm(b[..., :n1]), _cm(b[..., n1:])]
            yield (f"quantize_experts_dual_cat K contiguous {E4}", fn, (titan, E4, True),
                   lambda w=want: w(f8=E4), {})


def jagged_cases(dt, size):
    sizes, tail, d = _sizes(([40, 0, 64, 50, 30], 16, 12), ([700, 0, 1201, 96, 1500, 33], 566, 256), size)
    offs = _offs(sizes)
    m = int(offs[-1]) + tail
    x = edge_matrix(m, d, dt, group_steps(offs.tolist(), m, m), steps(d, 1))
    x2 = edge_matrix(m, 8, dt, group_steps(offs.tolist(), m, m), steps(8, 1), seed=5)
    for padded in (False, True):
        ps, al = (_starts(offs, 16), 16) if padded else (None, 16)

        def one(t, f8, ps=ps, al=al):
            if ps is None:
                return ref.quantize_jagged_colwise(t, offs, f8, True)
            return ref.quantize_jagged_colwise_padded(t, offs, al, f8, True)

        for f8 in F8S:
            yield (f"quantize_jagged_colwise padded={padded} {f8}", M.quantize_jagged_colwise,
                   (x, offs, f8, True, ps, al), lambda f8=f8, one=one: one(x, f8), {})
            yield (f"quantize_jagged_colwise_dual padded={padded} {f8}", M.quantize_jagged_colwise_dual,
                   (x, x2, offs, f8, True, ps, al), lambda f8=f8, one=one: (*one(x, f8), *one(x2, f8)), {})
        for pow2 in (True, False):
            yield (f"quantize_rowwise_jagged_dual padded={padded} pow2={pow2}", M.quantize_rowwise_jagged_dual,
                   (x, offs, E4, pow2, ps, al),
                   lambda pow2=pow2, ps=ps, al=al: (*ref.quantize_rowwise(x, E4, pow2), *(
                       ref.quantize_jagged_colwise(x, offs, E4, pow2) if ps is None
                       else ref.quantize_jagged_colwise_padded(x, offs, al, E4, pow2))),
                   {})


def _row_groups(mode, size, plain_rows, grouped, block):
    """Token groups along the rows of a colwise op with blocks of `block` rows: mode
    plain (no groups), grouped (the small and large sizes and tails of `grouped`) or
    padded (any sizes, padded_starts of alignment `block`). Returns (M, K, offs,
    padded_starts, alignment, the band starts of the blocks)."""
    k = _sizes(12, 256, size)
    if mode == "plain":
        m = _sizes(*plain_rows, size)
        return m, k, None, None, None, steps(m, block)
    if mode == "grouped":
        sizes, tail = _sizes(grouped[:2], grouped[2:], size)
        ps = al = None
    else:
        sizes, tail = _sizes(([10, 0, 27, 23], 40), ([700, 0, 1001, 1632], 67), size)
        al = block
    offs = _offs(sizes)
    m = int(offs[-1]) + tail
    ps = _starts(offs, al) if al else None
    return m, k, offs, ps, al, group_steps(offs.tolist(), m, block)


def blockwise_act_cases(dt, size):
    m, k = _sizes((40, 300), (520, 2048), size)  # large: the ring, gather and runs kernels
    x = edge_matrix(m, k, dt, steps(m, 1), steps(k, 128))
    for f8 in F8S:
        yield (f"quantize_blockwise_act_lhs {f8}", M.quantize_blockwise_act_lhs, (x, f8),
               lambda f8=f8, x=x: ref.quantize_blockwise_act_lhs(x, f8), {})
        yield (f"quantize_blockwise_act_lhs column-major {f8}", M.quantize_blockwise_act_lhs, (_cm(x), f8),
               lambda f8=f8, x=x: ref.quantize_blockwise_act_lhs(x, f8), {})
        for switch in ("rows_gather", "rows_runs"):  # the GPU's scale-gathering kernels, forced
            yield (f"quantize_blockwise_act_lhs {switch}=1 {f8}", M.quantize_blockwise_act_lhs, (x, f8),
                   lambda f8=f8, x=x: ref.quantize_blockwise_act_lhs(x, f8), {switch: "1"})
    for mode in ("plain", "grouped", "padded"):
        # grouped: non-empty groups start at multiples of 128; a tail
        m, k, offs, ps, al, rows = _row_groups(mode, size, (300, 4100), ([128, 0, 150], 52, [1024, 0, 896, 2000], 280),
                                               128)
        x = edge_matrix(m, k, dt, rows, steps(k, 1), seed=1)
        xt = edge_matrix(m, 264, dt, rows, steps(264, 128), seed=2)  # 128 x 128 tiles: both block shapes
        for f8 in F8S:
            for name in ("act_rhs", "act_transposed_lhs"):
                fn, rf = getattr(M, f"quantize_blockwise_{name}"), getattr(ref, f"quantize_blockwise_{name}")
                yield (f"quantize_blockwise_{name} {mode} {f8}", fn, (x, f8, offs, ps, al),
                       lambda f8=f8, rf=rf, offs=offs, al=al, x=x: rf(x, f8, offs, al), {})
            if offs is not None:
                yield (f"quantize_blockwise_act_dual {mode} {f8}", M.quantize_blockwise_act_dual,
                       (xt, f8, offs, ps, al),
                       lambda f8=f8, offs=offs, al=al, xt=xt: (*ref.quantize_blockwise_act_lhs(xt, f8),
                                                               *ref.quantize_blockwise_act_rhs(xt, f8, offs, al)), {})


def _memo(fn):
    """fn(t, f8) computed once for each (tensor, fp8 dtype): several ops share a reference."""
    seen = {}

    def call(t, f8):
        key = (id(t), f8)
        if key not in seen:
            seen[key] = fn(t, f8)
        return seen[key]

    return call


def blockwise_weight_cases(dt, size):
    # 128 x 128 tiles, partial ones at the end of both dims (36 tiles: every class at
    # every position)
    e, m, n = _sizes((9, 130, 140), (4, 1024, 768), size)
    w = edge_3d(e, m, n, dt, steps(m, 128), steps(n, 128))
    m2, n2 = _sizes((260, 140), (1000, 900), size)
    w2 = edge_matrix(m2, n2, dt, steps(m2, 128), steps(n2, 128), seed=3)
    e, m, p1 = _sizes((3, 130, 128), (4, 1024, 512), size)
    wc = edge_3d(e, m, p1 + 133, dt, steps(m, 128), steps(p1 + 133, 128), seed=4)
    parts = [_cm(wc[..., :p1]), wc[..., p1:].contiguous()]  # W1^T, W3^T as the experts layer passes them
    rhs_ref, trhs_ref = _memo(ref.quantize_blockwise_weight_rhs), _memo(ref.quantize_blockwise_weight_transposed_rhs)
    for f8 in F8S:
        rhs = lambda t, f8=f8: rhs_ref(t, f8)  # noqa: E731
        trhs = lambda t, f8=f8: trhs_ref(t, f8)  # noqa: E731
        for label, t in (("3-D", w), ("3-D column-major", _cm(w)), ("2-D", w2)):
            src = w2 if label == "2-D" else w
            yield (f"quantize_blockwise_weight_rhs {label} {f8}", M.quantize_blockwise_weight_rhs, (t, f8),
                   lambda src=src, rhs=rhs: rhs(src), {})
            yield (f"quantize_blockwise_weight_transposed_rhs {label} {f8}", M.quantize_blockwise_weight_transposed_rhs,
                   (t, f8), lambda src=src, trhs=trhs: trhs(src), {})
            yield (f"quantize_blockwise_weight_dual {label} {f8}", M.quantize_blockwise_weight_dual, (t, f8),
                   lambda src=src, rhs=rhs, trhs=trhs: (*rhs(src), *trhs(src)), {})
        yield (f"quantize_blockwise_weight_rhs_cat {f8}", M.quantize_blockwise_weight_rhs_cat, (parts, f8),
               lambda rhs=rhs: rhs(wc), {})
        yield (f"quantize_blockwise_weight_transposed_rhs_cat {f8}", M.quantize_blockwise_weight_transposed_rhs_cat,
               (parts, f8), lambda trhs=trhs: trhs(wc), {})
        yield (f"quantize_blockwise_weight_dual_cat {f8}", M.quantize_blockwise_weight_dual_cat, (parts, f8),
               lambda rhs=rhs, trhs=trhs: (*rhs(wc), *trhs(wc)), {})


def mx_cases(dt, size):
    m, k = _sizes((40, 96), (512, 4096), size)
    x = edge_matrix(m, k, dt, steps(m, 1), steps(k, 32))
    goffs = _offs(_sizes([12, 0, 18], [100, 0, 301, 90], size))
    for rounding in ("floor", "rceil"):
        for layout, xx in (("row-major", x), ("column-major", _cm(x))):
            for blocked, offs in ((False, None), (True, None), (True, goffs)):
                yield (f"quantize_mxfp8_rowwise {layout} {rounding} blocked={blocked} offs={offs is not None}",
                       M.quantize_mxfp8_rowwise, (xx, rounding, blocked, offs),
                       lambda a=(x, rounding, blocked, offs): ref.quantize_mxfp8_rowwise(*a), {})
    for mode in ("plain", "grouped", "padded"):
        # grouped: sizes multiples of 32, a tail
        m, k, offs, ps, al, rows = _row_groups(mode, size, (96, 4096), ([32, 0, 64], 32, [1024, 0, 992, 1920], 160), 32)
        xc = edge_matrix(m, k, dt, rows, steps(k, 1), seed=1)
        for rounding in ("floor", "rceil"):
            for blocked in (False, True):
                def want(xc=xc, rounding=rounding, blocked=blocked, offs=offs, al=al):
                    if al is None:
                        return ref.quantize_mxfp8_colwise(xc, rounding, blocked, offs)
                    return ref.quantize_mxfp8_colwise_padded(xc, offs, al, rounding, blocked)

                yield (f"quantize_mxfp8_colwise {mode} {rounding} blocked={blocked}", M.quantize_mxfp8_colwise,
                       (xc, rounding, blocked, offs, ps, al), want, {})
    e, k, n = _sizes((3, 64, 14), (8, 512, 256), size)
    b = edge_3d(e, k, n, dt, steps(k, 32), steps(n, 1), seed=2)
    for rounding in ("floor", "rceil"):
        for blocked in (False, True):
            for layout, bb in (("N contiguous", b), ("K contiguous", _cm(b))):
                yield (f"quantize_mxfp8_experts {layout} {rounding} blocked={blocked}", M.quantize_mxfp8_experts,
                       (bb, rounding, blocked), lambda a=(b, rounding, blocked): ref.quantize_mxfp8_experts(*a), {})


FAMILIES = [rowwise_cases, experts_cases, experts_cat_cases, jagged_cases, blockwise_act_cases,
            blockwise_weight_cases, mx_cases]


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def _bytes(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu()


def assert_same_bytes(label, got, want, strides=False):
    got, want = _flat(got), _flat(want)
    assert len(got) == len(want), f"{label}: expected {len(want)} outputs, got {len(got)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{label}: output {i}: expected {tuple(w.shape)} {w.dtype}, got {tuple(g.shape)} {g.dtype}")
        if strides:
            assert g.stride() == w.stride(), f"{label}: output {i}: expected strides {w.stride()}, got {g.stride()}"
        a, b = _bytes(g), _bytes(w)
        bad = (a != b).nonzero()
        if bad.numel():
            j = int(bad[0])
            raise AssertionError(f"{label}: output {i} ({g.dtype}): expected the reference's bytes, got "
                                 f"{bad.numel()} of {a.numel()} differing; first at byte {j}: expected "
                                 f"{int(b[j]):#04x}, got {int(a[j]):#04x}")


def _to(v, device):
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, list):
        return [_to(t, device) for t in v]
    return v


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__)
def test_cpu_matches_reference_on_edges(family, in_dtype):
    n = 0
    for label, fn, args, want, _env in family(in_dtype, "small"):
        assert_same_bytes(f"{label} ({in_dtype})", fn(*args), want())
        n += 1
    assert n > 0


def test_edge_data_holds_every_class_at_every_position():
    # The generator's contract: with 3 * len(CLASSES) regions each class sits at the
    # first, middle and last element of some region.
    from edge_data import CLASSES

    x = edge_matrix(3 * len(CLASSES), 7, torch.float32, steps(3 * len(CLASSES), 1), [0])
    v = x.float()
    for r in range(x.shape[0]):
        cls, pos = CLASSES[r % len(CLASSES)], (r // len(CLASSES)) % 3
        col = (0, 3, 6)[pos]
        if cls in ("nan", "-nan", "snan"):
            assert torch.isnan(v[r, col]) and int(torch.isnan(v[r]).sum()) == 1, (r, cls)
        elif cls in ("inf", "-inf"):
            assert v[r, col] == (float("inf") if cls == "inf" else -float("inf")), (r, cls)
        elif cls in ("exact448", "exact240"):
            top = v[r].abs().max()
            assert v[r, col].abs() == top and (top / (448 if cls == "exact448" else 240)).log2().frac() == 0, (r, cls)
        elif cls == "subnormal":
            assert 0 < v[r].abs().max() < torch.finfo(torch.float32).tiny, (r, cls)
        elif cls == "huge":
            assert v[r].abs().max() == torch.tensor(3e38), (r, cls)
        elif cls in ("zero", "-zero"):
            assert (x[r].view(torch.int32) == (0 if cls == "zero" else -(2**31))).all(), (r, cls)


# ---- torchao as the reference ----------------------------------------------------------


def _nan_to(q_bytes, q_float, byte):
    """torchao's q bytes with every NaN as the byte of DESIGN §4: on a CPU its arithmetic
    keeps a -NaN's sign (FLOOR's x / Inf) or makes x86's default -NaN (Inf / Inf)."""
    return torch.where(torch.isnan(q_float), torch.full_like(q_bytes, byte), q_bytes)


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mxfp8_matches_torchao_to_mx_on_edges(in_dtype, rounding):
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    mode = ScaleCalculationMode.FLOOR if rounding == "floor" else ScaleCalculationMode.RCEIL
    x = edge_matrix(72, 128, in_dtype, steps(72, 1), steps(128, 32))
    for blocked in (False, True):
        s_ao, q_ao = mx.to_mx(x, E4, 32, mode, is_swizzled_scales=blocked)
        q, s = M.quantize_mxfp8_rowwise(x, rounding, blocked)
        want_q = _nan_to(q_ao.view(torch.uint8), q_ao.float(), 0x7F)
        assert_same_bytes(f"quantize_mxfp8_rowwise {rounding} blocked={blocked} vs to_mx", (q, s.flatten()),
                          (want_q.view(E4), s_ao.flatten()))
    xt = edge_matrix(128, 72, in_dtype, steps(128, 32), steps(72, 1), seed=1)  # colwise: to_mx of x^T
    s_ao, q_ao = mx.to_mx(xt.t().contiguous(), E4, 32, mode)
    q, s = M.quantize_mxfp8_colwise(xt, rounding)
    want_q = _nan_to(q_ao.view(torch.uint8), q_ao.float(), 0x7F)
    assert_same_bytes(f"quantize_mxfp8_colwise {rounding} vs to_mx", (q.t(), s), (want_q.view(E4), s_ao))


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", F8S, ids=str)
def test_blockwise_matches_torchao_reference_on_edges(in_dtype, fp8_dtype):
    # torchao's pure-torch blockwise references (fp64 division, then fp32 s; 1 / s):
    # the same q and decode scales at every edge; NaN scales are 0x7FFFFFFF here.
    k = pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")
    nan_byte = int(torch.tensor(float("nan")).to(fp8_dtype).view(torch.uint8))

    def check(label, got, q_ao, s_ao):
        q_ao = _nan_to(q_ao.contiguous().view(torch.uint8), q_ao.float(), nan_byte).view(fp8_dtype)
        s_ao = ref.positive_nan(s_ao.float())
        assert_same_bytes(f"{label} vs torchao", got, (q_ao, s_ao))

    x = edge_matrix(40, 384, in_dtype, steps(40, 1), steps(384, 128))
    q_ao, s_ao = k.torch_blockwise_scale_act_quant_lhs(x, 128, fp8_dtype)
    check("quantize_blockwise_act_lhs", M.quantize_blockwise_act_lhs(x, fp8_dtype), q_ao, s_ao)
    x = edge_matrix(384, 128, in_dtype, steps(384, 128), steps(128, 1), seed=1)
    # (act_quant_rhs clamps amax at 1e-12 in x's dtype: 0 in fp16, so a zero block is
    # NaN there; the fp32 copy of x has the same amax and takes the fp32 formula)
    q_ao, s_ao = k.torch_blockwise_scale_act_quant_rhs(x.float(), 128, fp8_dtype)
    check("quantize_blockwise_act_rhs", M.quantize_blockwise_act_rhs(x, fp8_dtype), q_ao, s_ao)
    w = edge_matrix(768, 768, in_dtype, steps(768, 128), steps(768, 128), seed=2)
    q_ao, s_ao = k.torch_blockwise_scale_weight_quant(w, 128, fp8_dtype)
    q, s = M.quantize_blockwise_weight_rhs(w, fp8_dtype)
    check("quantize_blockwise_weight_rhs", (q.contiguous(), s.contiguous()), q_ao, s_ao)


# ---- GPU = CPU, bit for bit -------------------------------------------------------------


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__)
def test_gpu_matches_cpu_on_edges(family, in_dtype, size):
    n = 0
    for label, fn, args, _want, knobs in family(in_dtype, size):
        cpu = fn(*args)
        poison("cuda")
        with _tuning.override(**knobs):
            gpu = fn(*_to(args, "cuda"))
            torch.cuda.synchronize()
        assert_same_bytes(f"{label} ({in_dtype}, {size}) GPU vs CPU", gpu, cpu, strides=True)
        n += 1
    assert n > 0


def _nan_data(rows, cols, dtype, seed):
    """Random values with NaNs of both signs and several payloads, and +-Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    bits = x.view(torch.int32)
    pick = torch.randint(0, 16, (rows, cols), generator=g)
    for k, b in enumerate((0x7FC00000, 0xFFC00000 - 2**32, 0x7F800001, 0xFFFFFFFF - 2**32, 0x7FFFFFFF)):
        bits[pick == k] = b
    x[pick == 5], x[pick == 6] = float("inf"), -float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_float_outputs_write_the_spec_nan_bits(device):
    """The non-fp8 outputs (DESIGN §3, §8): a bf16 NaN is 0x7FC0 whatever the arithmetic
    made, dequantize_rows writes the type's +NaN; the reference's bytes, on every device."""
    if device == "cuda":
        poison("cuda")
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4).repeat(3, 1)  # every code, NaNs included
    s = torch.tensor([[1.0, float("nan")], [2.0**-10, float("inf")], [0.0, 3.0]])
    for dt in IN_DTYPES:
        assert_same_bytes(f"dequantize_rows {dt}", M.dequantize_rows(q.to(device), s.to(device), 128, dt),
                          ref.dequantize_rows(q, s, 128, dt))
    bf = torch.bfloat16
    x, h13, g = _nan_data(9, 136, bf, 1), _nan_data(7, 272, bf, 2), _nan_data(7, 136, bf, 3)
    idx = torch.tensor([3, 0, 8, -1, 1, 1, 5, 2, 7, 6, 4], dtype=torch.int32)
    offs, scores = torch.tensor([2, 2, 6, 11], dtype=torch.int32), torch.rand(9)
    token = torch.tensor([0, 1, -1, 2, 3, 1, 0, 2, 3], dtype=torch.int32)
    cases = [("sum_rows", M.sum_rows, ref.sum_rows, (x, idx, offs)),
             ("combine_rows", M.combine_rows, ref.combine_rows, (x, scores, idx, offs)),
             ("swiglu", M.swiglu, ref.swiglu, (h13,)),
             ("swiglu_backward", M.swiglu_backward, ref.swiglu_backward, (g, h13))]
    for label, op, spec, args in cases:
        assert_same_bytes(label, op(*_to(list(args), device)), spec(*args))
    got = M.ops.token_groups.combine_rows_backward(*_to([x[:4], x, scores, token], device))[0]
    assert_same_bytes("combine_rows_backward", got, ref.combine_rows_backward(x[:4], x, scores, token)[0])
