"""Content stamps of the build's inputs, so that a re-copied source tree rebuilds only
what changed.

A machine that receives the working tree anew for every command (the device tool here)
gives every file a new modification time, and ninja then rebuilds every object though
the build folder survived. `save` records each input's SHA-256 and modification time
after a build; `restore` puts the recorded time back on every file whose content is the
recorded content, before the next build, and gives every other input the current time
(so a copy that keeps source times still rebuilds what changed). Ninja then rebuilds
exactly what depends on a changed file (headers through its depfiles).

The recorded times are only safe if the build folder saw no other build since `save`:
the stamps also record each build folder's `.ninja_log`, and `restore` does nothing when
one differs (a build by other means, e.g. a plain `pip install`), leaving the times as
the copy made them. gpu_ci.sh removes the stamp file before its build and saves it after
the build succeeds, so a failed build never leaves stamps behind.

  python scripts/build_stamps.py restore|save STAMP_FILE
"""

import glob
import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_FILES = ("CMakeLists.txt", "setup.py", "pyproject.toml")
NINJA_LOGS = "_ninja_logs"  # a key no input path can take


def inputs():
    for name in TOP_FILES:
        if os.path.isfile(os.path.join(ROOT, name)):
            yield name
    for dirpath, _, files in os.walk(os.path.join(ROOT, "csrc")):
        for f in files:
            yield os.path.relpath(os.path.join(dirpath, f), ROOT)


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def ninja_logs():
    """Size and time of each build folder's .ninja_log (setup.py: build/cmake-<backend>)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "build", "cmake-*", ".ninja_log"))):
        st = os.stat(path)
        out[os.path.relpath(path, ROOT)] = [st.st_size, st.st_mtime_ns]
    return out


def save(stamp_file):
    stamps = {rel: [digest(os.path.join(ROOT, rel)), os.stat(os.path.join(ROOT, rel)).st_mtime_ns] for rel in inputs()}
    stamps[NINJA_LOGS] = ninja_logs()
    os.makedirs(os.path.dirname(os.path.abspath(stamp_file)), exist_ok=True)
    tmp = stamp_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(stamps, f)
    os.replace(tmp, stamp_file)  # a killed save leaves the old file or none, never half a file


def restore(stamp_file):
    try:
        with open(stamp_file) as f:
            stamps = json.load(f)
    except (OSError, ValueError):
        print("build_stamps: no readable stamps (a first build): file times left as they are")
        return
    if stamps.pop(NINJA_LOGS, None) != ninja_logs():
        print("build_stamps: the build folder was built by other means since the stamps: file times left as they are")
        return
    kept = changed = 0
    for rel in inputs():
        path = os.path.join(ROOT, rel)
        old = stamps.get(rel)
        if old is not None and digest(path) == old[0]:
            os.utime(path, ns=(old[1], old[1]))
            kept += 1
        else:
            os.utime(path)  # now: newer than any object built before
            changed += 1
    print(f"build_stamps: {kept} inputs unchanged since the last build, {changed} changed or new")


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("restore", "save"):
        sys.exit(__doc__)
    (save if sys.argv[1] == "save" else restore)(sys.argv[2])


if __name__ == "__main__":
    main()
