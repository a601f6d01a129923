"""Look through the built extension's SASS for a ptxas miscompile seen with CUDA 13.0
on sm_90a: a memory instruction whose cache-policy descriptor is an odd uniform register
(``desc[UR1]``: 64-bit descriptors live in even pairs), which the H100 runs as an
"illegal instruction" (seen in the dual kernel's jagged schedule, deleted since: record
029). Exit 1 with the offending kernels, 0 when clean, 0 with a note when no cuobjdump
is found.

    python scripts/check_sass.py [path/to/_C.so]
"""

import glob
import os
import re
import shutil
import subprocess
import sys


def cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        path = os.path.join(root, "bin", "cuobjdump")
        if root and os.path.exists(path):
            return path
    try:  # triton ships one
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        return path if os.path.exists(path) else None
    except ImportError:
        return None


def main():
    if len(sys.argv) > 1:
        lib = sys.argv[1]
    else:
        import moe_fp8_ext

        libs = glob.glob(os.path.join(os.path.dirname(moe_fp8_ext.__file__), "_C*.so"))
        if not libs:
            print("check_sass: no built extension found")
            return 1
        lib = libs[0]
    tool = cuobjdump()
    if tool is None:
        print("check_sass: no cuobjdump (CUDA toolkit or triton): skipped")
        return 0
    sass = subprocess.run([tool, "-sass", lib], capture_output=True, text=True).stdout
    if not sass:
        print(f"check_sass: {tool} printed no SASS for {lib}")
        return 1
    bad, kernel = {}, None
    odd = re.compile(r"desc\[UR(\d+)\]")
    for line in sass.splitlines():
        if "Function :" in line:
            kernel = line.split("Function :")[1].strip()
        for m in odd.finditer(line):
            if int(m.group(1)) % 2:
                bad.setdefault(kernel, line.strip())
    for k, line in bad.items():
        print(f"check_sass: odd descriptor register in {k}:\n    {line}")
    print(f"check_sass: {len(bad)} kernel(s) with an odd descriptor register in {lib}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
