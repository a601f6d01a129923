"""Inputs that hold every edge class of the quantizers (issue 66) for a given block
geometry: the tensor is cut into regions (each region one reduction block or set of
the op under test: a row, 1x32, 128x1, a 128x128 tile, a token group's column), and
region k gets class CLASSES[k % n] with its special element at the region's first,
middle or last element (by k // n), so with at least 3n regions every class sits at
every position, in first, middle, last and partial blocks alike.

Classes: a +NaN, a -NaN with payload, a signalling NaN (bits set in the input dtype),
+-Inf, a maximum of exactly 448 * 2^k or 240 * 2^k (the e4m3fn / e4m3fnuz max times a
power of two), a subnormal maximum (1e-39 in fp32 and bf16), a maximum near the
dtype's limit (3e38; 6e4 in fp16), an all -0.0 and an all +0.0 region, and plain
data with -0.0 elements."""

import torch

CLASSES = ("nan", "-nan", "snan", "inf", "-inf", "exact448", "exact240", "subnormal", "huge", "-zero", "zero",
           "normal")

# NaN bit patterns of each input dtype: (+qNaN, -NaN with every payload bit, +sNaN).
_NAN_BITS = {
    torch.float32: (0x7FC00000, -1, 0x7F800001),
    torch.bfloat16: (0x7FC0, -1, 0x7F81),
    torch.float16: (0x7E00, -1, 0x7C01),
}
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def steps(n, block):
    """Band starts 0, block, 2 block, ... below n (one band for block >= n)."""
    return list(range(0, max(n, 1), block))


def group_steps(offs, rows, block):
    """Band starts of blocks of `block` rows restarting at each token group's first row
    (offs: cumulative ends) and at the rows past the last group."""
    ends = [min(max(int(o), 0), rows) for o in offs]
    out, start = [], 0
    for end in ends + [rows]:
        out += list(range(start, end, block))
        start = max(start, end)
    return sorted(set(out)) or [0]


def edge_matrix(rows, cols, dtype, row_starts, col_starts, seed=0, classes=CLASSES):
    """(rows, cols) in dtype; regions are the bands row_starts x col_starts, their
    classes taken in turn from `classes` (a subset of CLASSES)."""
    g = torch.Generator().manual_seed(seed)
    rs = torch.tensor(row_starts, dtype=torch.int64)
    cs = torch.tensor(col_starts, dtype=torch.int64)
    ncb = len(col_starts)
    rid = torch.bucketize(torch.arange(rows), rs, right=True) - 1  # band of each row
    cid = torch.bucketize(torch.arange(cols), cs, right=True) - 1
    region = (rid[:, None] * ncb + cid[None, :]).flatten()
    nreg = len(row_starts) * ncb
    k = torch.arange(nreg)
    cls = torch.tensor([CLASSES.index(c) for c in classes])[(k + seed) % len(classes)]
    pos = (k // len(classes)) % 3
    r0, r1 = rs[k // ncb], torch.cat([rs[1:], torch.tensor([rows])])[k // ncb]
    c0, c1 = cs[k % ncb], torch.cat([cs[1:], torch.tensor([cols])])[k % ncb]
    # the flat index of each region's special element (first, middle or last) and of a
    # second one (its last element, or its first)
    mid = lambda a, b: (a + b) // 2  # noqa: E731
    sp = torch.where(pos == 0, r0, torch.where(pos == 1, mid(r0, r1), r1 - 1)) * cols + torch.where(
        pos == 0, c0, torch.where(pos == 1, mid(c0, c1), c1 - 1))
    second = torch.where(pos == 2, r0 * cols + c0, (r1 - 1) * cols + c1 - 1)
    is_ = {n: cls == i for i, n in enumerate(CLASSES)}

    base = torch.randn(rows * cols, generator=g)
    amax = torch.zeros(nreg).scatter_reduce(0, region, base.abs(), "amax").clamp(min=1e-30)
    # each region's max magnitude, and the special element's value where it has one
    top = amax * torch.exp2(torch.randint(-6, 7, (nreg,), generator=g).float())
    special = torch.full((nreg,), float("nan"))
    sign = torch.where(pos == 1, -1.0, 1.0)
    kexp = torch.exp2(((k % 7) - 3).float())  # 2^-3 .. 2^3
    tiny, big = (3e-5, 6e4) if dtype == torch.float16 else (1e-39, 3e38)
    for n, m in (("exact448", 448 * kexp), ("exact240", 240 * kexp), ("subnormal", torch.full((nreg,), tiny)),
                 ("huge", torch.full((nreg,), big))):
        top = torch.where(is_[n], m * (0.99 if n.startswith("exact") else 0.5 if n == "subnormal" else 1 / 3), top)
        special = torch.where(is_[n], sign * m, special)
    special = torch.where(is_["inf"], float("inf"), torch.where(is_["-inf"], -float("inf"), special))
    x = (base / amax[region] * top[region]).double()
    x = torch.where((is_["zero"] | is_["-zero"])[region], 0.0, x)
    x[sp[~torch.isnan(special)]] = special[~torch.isnan(special)].double()
    x[second[is_["normal"] & (second != sp)]] = -0.0
    x = torch.where(is_["-zero"][region], -0.0, x)
    out = x.to(torch.float32).to(dtype)  # finite and infinite values only: exact conversions of those
    bits = out.view(_INT_VIEW[dtype])
    for n, b in zip(("nan", "-nan", "snan"), _NAN_BITS[dtype]):
        bits[sp[is_[n]]] = b
    return out.view(rows, cols)


def edge_3d(e, r, c, dtype, per_matrix_row_starts, col_starts, seed=0, classes=CLASSES):
    """(e, r, c): e matrices (r, c) stacked, each cut into the same bands."""
    starts = [i * r + s for i in range(e) for s in per_matrix_row_starts]
    return edge_matrix(e * r, c, dtype, starts, col_starts, seed, classes).view(e, r, c)
