"""Content stamps of the build's inputs, so that a re-copied source tree rebuilds only
what changed.

A machine that receives the working tree anew for every command (the device tool here)
gives every file a new modification time, and ninja then rebuilds every object though
the build folder survived. `save` records each input's SHA-256 and modification time
after a build; `restore` puts the recorded time back on every file whose content is the
recorded content, before the next build. Changed and new files keep their new times, so
ninja rebuilds exactly what depends on them (headers through its depfiles).

  python scripts/build_stamps.py restore|save STAMP_FILE
"""

import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_FILES = ("CMakeLists.txt", "setup.py", "pyproject.toml")


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


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("restore", "save"):
        sys.exit(__doc__)
    mode, stamp_file = sys.argv[1], sys.argv[2]
    if mode == "save":
        stamps = {}
        for rel in inputs():
            path = os.path.join(ROOT, rel)
            stamps[rel] = [digest(path), os.stat(path).st_mtime_ns]
        os.makedirs(os.path.dirname(os.path.abspath(stamp_file)), exist_ok=True)
        with open(stamp_file, "w") as f:
            json.dump(stamps, f)
        return
    if not os.path.isfile(stamp_file):
        print("build_stamps: no stamps yet (a first build)")
        return
    with open(stamp_file) as f:
        stamps = json.load(f)
    kept = changed = 0
    for rel in inputs():
        path = os.path.join(ROOT, rel)
        old = stamps.get(rel)
        if old is not None and digest(path) == old[0]:
            os.utime(path, ns=(old[1], old[1]))
            kept += 1
        else:
            changed += 1
    print(f"build_stamps: {kept} inputs unchanged since the last build, {changed} changed or new")


if __name__ == "__main__":
    main()
