"""The test helpers that other tests' strength rests on. GPU only: poison() leaves no
free byte of the caching allocator unpoisoned, so that an output element a kernel
forgets to write reads as 0xFF (NaN) whatever block the allocator gives the output."""

import pytest
import torch

from conftest import _free_blocks_of_this_stream, poison, requires_cuda


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", [512, 3000, 65536, 700_000, 1 << 20, (1 << 20) + 512, 3_000_000, 40 << 20])
def test_poison_reaches_every_free_block(nbytes):
    # Fragment both pools: live tensors beside freed ones, written with zeros (what an
    # unwritten output would otherwise read), in small-pool and large-pool segments.
    sizes = [512, 4096, 65536, 300_000, 1 << 20, 1_500_000, 5 << 20, 24 << 20]
    blocks = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes for _ in range(3)]
    keep = blocks[1::2]
    del blocks
    poison("cuda")
    # The next blocks of this size the allocator hands out, fewer bytes than poison()
    # itself allocates (four 1 MiB small-pool blocks, a 512 MiB block), so that none
    # needs a new segment whatever the cache held before.
    budget = 2 << 20 if nbytes <= 1 << 20 else 256 << 20
    outs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(max(1, min(16, budget // nbytes)))]
    for i, out in enumerate(outs):
        bad = int((out != 0xFF).sum())
        assert bad == 0, f"allocation {i} of {nbytes} bytes: {bad} bytes not poisoned"
    del keep


@requires_cuda
@pytest.mark.gpu
def test_poison_fills_whole_blocks():
    # A free 16.5 MiB block between its segment's start and a live tensor: poison()'s 16 MiB request gets it whole (the
    # large pool leaves a rest of <= 1 MiB unsplit), so its last half MiB must be poisoned too. Free large blocks are
    # held meanwhile so that a and b split one new segment.
    hold = [torch.empty(size, dtype=torch.uint8, device="cuda") for size, small in _free_blocks_of_this_stream() if not small]
    seg = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del seg  # the one free large block: 64 MiB
    a = torch.zeros((33 << 20) // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty((64 << 20) - a.numel(), dtype=torch.uint8, device="cuda")
    assert b.data_ptr() == a.data_ptr() + a.numel(), "set-up: a and b do not share one segment"
    del a, hold
    poison("cuda")
    out = torch.empty((33 << 20) // 2, dtype=torch.uint8, device="cuda")
    bad = int((out != 0xFF).sum())
    assert bad == 0, f"{bad} bytes of a 16.5 MiB block not poisoned"
    del b
