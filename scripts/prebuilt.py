"""The stamp of a module built on another machine (scripts/prebuild.sh), and the check
that scripts/gpu_ci.sh makes before it uses that module instead of building.

A module matches this tree when it was built from the same build inputs (every file
under csrc/ and CMakeLists.txt, setup.py, pyproject.toml: the inputs of
build_stamps.py, by content), against the same torch release (torch.__version__,
e.g. "2.11.0+cu130": the module links to that torch's C++ libraries), for the GPU
architectures asked for, and is the very file stamped (SHA-256). Anything else, and
gpu_ci.sh builds as it always did. The stamp also records what else went into the
module (nvcc, CUTLASS, the host compiler); prebuild.sh has checked those against the
torch and the pin in pyproject.toml.

  python scripts/prebuilt.py digest                  the build inputs' digest
  python scripts/prebuilt.py save OUT PKG DIGEST ARCHS
        import the package built in PKG (PKG/moe_fp8_ext, from the wheel) with this
        Python, check that it is a CUDA build for ARCHS against this torch, and put
        its module and stamp.json into OUT
  python scripts/prebuilt.py check DIR ARCHS         exit 0 if DIR/_C.abi3.so matches
                                                     (ARCHS: comma/semicolon list), else
                                                     say why and exit 1
  python scripts/prebuilt.py imports ARCHS           exit 0 if moe_fp8_ext, imported from
                                                     here, is a CUDA build for ARCHS
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_stamps import ROOT, digest, inputs  # noqa: E402

MODULE = "_C.abi3.so"


def tree_digest() -> str:
    h = hashlib.sha256()
    for rel in sorted(inputs()):
        h.update(f"{rel}\0{digest(os.path.join(ROOT, rel))}\n".encode())
    return h.hexdigest()


def split_archs(archs: str):
    return [a for a in archs.replace(";", ",").split(",") if a]


def version_line(cmd) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()
        return out[0] if out else ""
    except (OSError, subprocess.CalledProcessError):
        return ""


def cuda_build_info(where: str, archs: str):
    """(build_info(), None) of the package moe_fp8_ext as this Python imports it from the
    folder `where` (in a fresh process), if it is a CUDA build for every arch of ARCHS;
    else (None, why)."""
    probe = "import json, moe_fp8_ext; print(json.dumps(moe_fp8_ext.build_info()))"
    run = subprocess.run([sys.executable, "-c", probe], cwd=where, capture_output=True, text=True)
    if run.returncode != 0:
        return None, f"prebuilt: the package does not import:\n{run.stderr[-2000:]}"
    info = json.loads(run.stdout.strip().splitlines()[-1])
    built = split_archs(info["cuda_archs"])
    if not info["cuda"] or any(a not in built for a in split_archs(archs)):
        return None, f"prebuilt: not a CUDA build for {archs}: {info}"
    return info, None


def save(out: str, pkg: str, tree: str, archs: str) -> None:
    import importlib.metadata

    import torch

    info, why = cuda_build_info(pkg, archs)
    if why:
        sys.exit(why)
    wanted = split_archs(archs)
    if not torch.__version__.startswith(info["torch_version"]):
        sys.exit(f"prebuilt: built against torch {info['torch_version']}, this Python has {torch.__version__}")
    os.makedirs(out, exist_ok=True)
    module = os.path.join(out, MODULE)
    shutil.copy2(os.path.join(pkg, "moe_fp8_ext", MODULE), module)
    stamp = {
        "inputs": tree,
        "torch": torch.__version__,
        "archs": wanted,
        "sha256": digest(module),
        "nvcc": info["cuda_version"],
        "cutlass": importlib.metadata.version("nvidia-cutlass"),
        "cxx": version_line([os.environ.get("MOE_FP8_CXX") or "g++", "--version"]),  # setup.py's default
    }
    with open(os.path.join(out, "stamp.json"), "w") as f:
        json.dump(stamp, f, indent=1)
    print(f"prebuilt: {module} stamped: torch {stamp['torch']}, archs {','.join(wanted)}, nvcc {stamp['nvcc']}, "
          f"cutlass {stamp['cutlass']}, inputs {tree[:12]}")


def check(folder: str, archs: str) -> bool:
    try:
        with open(os.path.join(folder, "stamp.json")) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        print(f"prebuilt: no readable {folder}/stamp.json")
        return False
    module = os.path.join(folder, MODULE)
    if not os.path.isfile(module):
        print(f"prebuilt: no {module}")
        return False
    import torch

    why = []
    if stamp.get("sha256") != digest(module):
        why.append("the module is not the file stamped")
    if stamp.get("inputs") != tree_digest():
        why.append("the build inputs changed since it was built")
    if stamp.get("torch") != torch.__version__:
        why.append(f"built for torch {stamp.get('torch')}, this is {torch.__version__}")
    missing = [a for a in split_archs(archs) if a not in stamp.get("archs", [])]
    if missing:
        why.append(f"built for {','.join(stamp.get('archs', []))}, not {','.join(missing)}")
    if why:
        print(f"prebuilt: {module} does not match: " + "; ".join(why))
        return False
    print(f"prebuilt: {module} matches this tree (torch {stamp['torch']}, archs {archs}, nvcc {stamp.get('nvcc')}, "
          f"cutlass {stamp.get('cutlass')})")
    return True


def main() -> None:
    args = sys.argv[1:]
    if args == ["digest"]:
        print(tree_digest())
    elif len(args) == 5 and args[0] == "save":
        save(*args[1:])
    elif len(args) == 3 and args[0] == "check":
        sys.exit(0 if check(*args[1:]) else 1)
    elif len(args) == 2 and args[0] == "imports":
        why = cuda_build_info(".", args[1])[1]
        sys.exit(why)  # None: exit 0
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
