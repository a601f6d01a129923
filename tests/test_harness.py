"""The test helpers that other tests' strength rests on. GPU only: poison() leaves no
free byte of the caching allocator unpoisoned, so that an output element a kernel
forgets to write reads as 0xFF (NaN) whatever block the allocator gives the output."""

import pytest
import torch

from conftest import poison, requires_cuda


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
    # The next blocks of this size the allocator hands out, as many as the memory that
    # poison() itself allocates holds (2 MiB of small-pool segments, 512 MiB of large
    # blocks), so that none needs a new segment whatever the cache held before.
    budget = 2 << 20 if nbytes <= 1 << 20 else 256 << 20
    outs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(max(1, min(16, budget // nbytes)))]
    for i, out in enumerate(outs):
        bad = int((out != 0xFF).sum())
        assert bad == 0, f"allocation {i} of {nbytes} bytes: {bad} bytes not poisoned"
    del keep
