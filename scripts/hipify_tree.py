"""Hipify a copy of csrc/ with PyTorch's bundled hipify (hipify-torch).

    python scripts/hipify_tree.py SRC_CSRC DEST_ROOT

copies SRC_CSRC to DEST_ROOT/csrc and hipifies it in place; .cu files become .hip,
changed headers get a _hip suffix (with includes rewritten). Used by setup.py for
the ROCm build and by scripts/check_hip.sh in CI. Prints the hipified files.
"""

import os
import shutil
import sys


def hipify_tree(src_csrc: str, dest_root: str) -> str:
    from torch.utils.hipify import hipify_python

    dest = os.path.join(dest_root, "csrc")
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src_csrc, dest)
    hipify_python.hipify(
        project_directory=dest,
        output_directory=dest,
        includes=["*"],
        is_pytorch_extension=True,
        show_detailed=False,
        show_progress=False,
    )
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out = hipify_tree(os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]))
    for root, _, files in sorted(os.walk(out)):
        for f in sorted(files):
            print(os.path.relpath(os.path.join(root, f), out))
