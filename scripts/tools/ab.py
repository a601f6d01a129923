"""Same-run A/B of any benchmark between two source trees (each with its built module).

    python scripts/tools/ab.py --a OLD_TREE --b NEW_TREE [--rounds 3] -- python bench/X.py ARGS

Runs the command from this directory in alternating rounds (A, B, B, A, ...), with
PYTHONPATH set to the arm's tree, so both arms run the same benchmark script against
their own package (``--own-scripts``: each arm runs the command from its own tree,
for a benchmark whose imports changed between the two). Each run writes its JSON
($OUT/<bench>.json, bench/common.py) into a folder of its own. Rows are matched by
their text fields (shape, variant, mode, ...); for each numeric field the table shows
both arms' medians and B/A.
Writes $OUT/ab.json (default OUT: .out).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def rows(doc, ignore=("check",)):
    """(key, {field: number}) for every dict row in a benchmark JSON's data; the key is
    the row's text fields but ``ignore`` (a check's text may differ between the arms)."""
    def walk(node, where):
        numeric = isinstance(node, dict) and any(_number(v) for v in node.values())
        if numeric:
            key = where + tuple(f"{k}={v}" for k, v in sorted(node.items())
                                if isinstance(v, str) and k not in ignore)
            yield key, {k: v for k, v in node.items() if _number(v)}
        elif isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, where + (k,))
        elif isinstance(node, list):
            for v in node:
                yield from walk(v, where)
    yield from walk(doc.get("data", doc), ())


def run_arm(tree: Path, cmd, out: Path, own_scripts: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OUT=str(out), PYTHONPATH=os.pathsep.join(
        [str(tree)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    with open(out / "stdout.txt", "w") as log:
        subprocess.run(cmd, env=env, check=True, stdout=log, stderr=subprocess.STDOUT,
                       cwd=tree if own_scripts else None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, type=Path, help="baseline tree")
    p.add_argument("--b", required=True, type=Path, help="tree under test")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--own-scripts", action="store_true", help="run the command from each arm's tree")
    p.add_argument("--collect", action="store_true", help="only tabulate the runs already in $OUT/ab")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd and not args.collect:
        p.error("expected a command after --")
    out = Path(os.environ.get("OUT", ".out")).resolve() / "ab"
    if not args.collect:
        shutil.rmtree(out, ignore_errors=True)  # (a table of this run's folders only)
        for r in range(args.rounds):
            for arm in ("ab" if r % 2 == 0 else "ba"):
                run_arm(getattr(args, arm).resolve(), cmd, out / f"{arm}{r}", args.own_scripts)
    values = {"a": {}, "b": {}}
    for folder in sorted(out.glob("[ab][0-9]*")):
        for f in folder.glob("*.json"):
            for key, nums in rows(json.loads(f.read_text())):
                for field, v in nums.items():
                    values[folder.name[0]].setdefault((f.stem,) + key + (field,), []).append(v)
    table = []
    print("| row | field | A | B | B/A |\n|---|---|---|---|---|")
    for key in sorted(set(values["a"]) & set(values["b"])):
        a, b = statistics.median(values["a"][key]), statistics.median(values["b"][key])
        ratio = b / a if a else float("nan")
        table.append({"row": list(key[:-1]), "field": key[-1], "a": a, "b": b, "b_over_a": ratio})
        print(f"| {' '.join(key[:-1])} | {key[-1]} | {a:.4g} | {b:.4g} | {ratio:.3f} |")
    doc = {"a": str(args.a), "b": str(args.b), "rounds": args.rounds, "command": cmd, "table": table}
    (out.parent / "ab.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
