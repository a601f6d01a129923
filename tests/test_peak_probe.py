"""scripts/tools/peak_probe.py: its GEMMs that return zeros of their output's shape give
the peak of the emulated GEMMs, byte for byte."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def peak(recipe, *flags):
    out = subprocess.run([sys.executable, str(ROOT / "scripts/tools/peak_probe.py"), "--recipe", recipe, "--shape",
                          "700,256,128,4", "--top", "3", *flags], capture_output=True, text=True, check=True).stdout
    return int(out.split("(")[1].split(" bytes")[0]), out


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_rowwise"])
def test_peak_probe_fake_gemms_are_the_gemms(recipe):
    fake, out = peak(recipe)
    real, _ = peak(recipe, "--real-gemms")
    assert fake == real > 0, out
    assert len(out.splitlines()) == 4 and "MiB" in out.splitlines()[1]
