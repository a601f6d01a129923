"""Build information and platform defaults (DESIGN §9)."""

from typing import Optional

import torch

from . import _C


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
