"""scripts/tools/ab.py: rows matched by their text fields, medians per arm, B/A."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Writes $OUT/fake.json with one row whose time is the number in the arm's tree/speed.txt.
FAKE = ("import json, os, sys; tree = os.environ['PYTHONPATH'].split(os.pathsep)[0]; "
        "ms = float(open(os.path.join(tree, 'speed.txt')).read()); "
        "json.dump({'data': {'t': [{'shape': '(1, 2)', 'check': tree, 'fresh_ms': ms, 'ok': True}]}}, "
        "open(os.path.join(os.environ['OUT'], 'fake.json'), 'w'))")


def test_ab_runner_compares_two_trees(tmp_path):
    for arm, ms in (("old", "4.0"), ("new", "3.0")):
        (tmp_path / arm).mkdir()
        (tmp_path / arm / "speed.txt").write_text(ms)
    out = subprocess.run([sys.executable, str(ROOT / "scripts/tools/ab.py"), "--a", str(tmp_path / "old"), "--b",
                          str(tmp_path / "new"), "--rounds", "3", "--", sys.executable, "-c", FAKE],
                         env={"OUT": str(tmp_path / "out"), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout
    assert "| fake t shape=(1, 2) | fresh_ms | 4 | 3 | 0.750 |" in out, out
    doc = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert [(r["field"], r["a"], r["b"]) for r in doc["table"]] == [("fresh_ms", 4.0, 3.0)]
    assert len(list((tmp_path / "out" / "ab").iterdir())) == 6  # three rounds of two arms
