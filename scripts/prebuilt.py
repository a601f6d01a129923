"""The stamp of a module built on another machine (scripts/prebuild.sh), and the check
that scripts/gpu_ci.sh makes before it uses that module instead of building.

A module matches this tree when it was built from the same build inputs (every file
under csrc/ and CMakeLists.txt, setup.py, pyproject.toml: the inputs of
build_stamps.py, by content), against the same torch release (torch.__version__,
e.g. "2.11.0+cu130": the module links to that torch's C++ libraries), and for the
GPU architecture asked for. Anything else, and gpu_ci.sh builds as it always did.

  python scripts/prebuilt.py digest                       the inputs' digest
  python scripts/prebuilt.py save DIR DIGEST ARCHS        write DIR/stamp.json (this
                                                          Python's torch)
  python scripts/prebuilt.py check DIR ARCH               exit 0 if DIR/_C.abi3.so
                                                          matches, else say why, exit 1
"""

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_stamps import ROOT, digest, inputs  # noqa: E402

MODULE = "_C.abi3.so"


def tree_digest() -> str:
    h = hashlib.sha256()
    for rel in sorted(inputs()):
        h.update(f"{rel}\0{digest(os.path.join(ROOT, rel))}\n".encode())
    return h.hexdigest()


def save(folder: str, tree: str, archs: str) -> None:
    import torch

    stamp = {"inputs": tree, "torch": torch.__version__, "archs": archs.replace(";", ",").split(",")}
    with open(os.path.join(folder, "stamp.json"), "w") as f:
        json.dump(stamp, f, indent=1)
    print(f"prebuilt: {folder}/{MODULE} stamped: torch {stamp['torch']}, archs {','.join(stamp['archs'])}, "
          f"inputs {tree[:12]}")


def check(folder: str, arch: str) -> bool:
    try:
        with open(os.path.join(folder, "stamp.json")) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        print(f"prebuilt: no readable {folder}/stamp.json")
        return False
    if not os.path.isfile(os.path.join(folder, MODULE)):
        print(f"prebuilt: no {folder}/{MODULE}")
        return False
    import torch

    why = []
    if stamp.get("inputs") != tree_digest():
        why.append("the build inputs changed since it was built")
    if stamp.get("torch") != torch.__version__:
        why.append(f"built for torch {stamp.get('torch')}, this is {torch.__version__}")
    if arch not in stamp.get("archs", []):
        why.append(f"built for {','.join(stamp.get('archs', []))}, not {arch}")
    if why:
        print(f"prebuilt: {folder}/{MODULE} does not match: " + "; ".join(why))
        return False
    print(f"prebuilt: {folder}/{MODULE} matches this tree (torch {stamp['torch']}, arch {arch})")
    return True


def main() -> None:
    args = sys.argv[1:]
    if args == ["digest"]:
        print(tree_digest())
    elif len(args) == 4 and args[0] == "save":
        save(*args[1:])
    elif len(args) == 3 and args[0] == "check":
        sys.exit(0 if check(*args[1:]) else 1)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
