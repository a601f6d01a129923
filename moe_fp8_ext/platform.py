"""Build information and platform defaults (DESIGN §9)."""

from typing import Callable, Dict, Optional, TypeVar

import torch

from . import _C

T = TypeVar("T")


def build_info() -> dict:
    """What this build of the extension contains: ``torch_version`` it was built
    against, ``cuda`` / ``cuda_version`` / ``cuda_archs`` (comma-separated, e.g.
    ``"90a,100a"``), ``hip`` / ``hip_version``."""
    return dict(_C.build_info())


def default_fp8_dtype(device: Optional[torch.device] = None) -> torch.dtype:
    """The fp8 dtype the hardware computes in: ``float8_e4m3fnuz`` on gfx942 (MI300),
    ``float8_e4m3fn`` (OCP) on gfx950, NVIDIA GPUs and the CPU."""
    if torch.version.hip and torch.cuda.is_available():
        arch = torch.cuda.get_device_properties(device or torch.cuda.current_device()).gcnArchName
        if arch.startswith("gfx94"):
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def remembered_per_device(memo: Dict[tuple, T], device, decide: Callable[..., T], *key) -> T:
    """``decide(device)``, remembered in ``memo`` under ``(*key, device.type, device.index)``
    for a ``torch.device`` with an index, in eager mode: what a GPU and this build can run
    does not change in a process, and the recipes ask at every call (5-10 µs of host time
    a question: torch.cuda.is_available reads the environment, the capability query runs
    torch.cuda's Python). Any other ``device``, and every call while tracing, is decided
    anew."""
    if not isinstance(device, torch.device) or device.index is None or torch.compiler.is_compiling():
        return decide(device)
    k = (*key, device.type, device.index)
    answer = memo.get(k)
    if answer is None:
        answer = memo[k] = decide(device)
    return answer
