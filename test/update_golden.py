"""Regenerate the golden files from the current code: the only writer of them (`make golden`).

    python test/update_golden.py           # rewrite the files whose numbers moved, print what moved
    python test/update_golden.py --check   # print what moved, write nothing; exit 1 if anything did

Why a separate, explicit step: the golden tests (test/core/test_golden.py, test/sim/test_replay.py)
used to rewrite their own file when an environment variable was set, so a regression was one variable
away from becoming the new truth. Now they only compare. A moved number is a behaviour change: run
this, read the printed diff and `git diff test/*/golden_*.json`, and commit the files together with the
change that moved them, saying why. Never run it to make a failing test pass without that review;
it refuses to write when the CI variable is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Run as a script, sys.path[0] is test/: its packages are importable as `core` and `sim`.
from core.test_golden import GOLDEN as CORE_GOLDEN, golden_counts
from sim.test_replay import GOLDEN as REPLAY_GOLDEN, golden_replay


def moved(old: dict, new: dict) -> list[str]:
    """One line per policy and number that differs (added and removed policies too)."""
    lines = []
    for policy in sorted(set(old) | set(new)):
        before, after = old.get(policy, {}), new.get(policy, {})
        for field in sorted(set(before) | set(after)):
            if before.get(field) != after.get(field):
                lines.append(f"  {policy}.{field}: {before.get(field)} -> {after.get(field)}")
    return lines


def update(path: Path, compute, write: bool) -> bool:
    """Recompute one golden file; print what moved; rewrite it when `write`. True if anything moved."""
    old = json.loads(path.read_text()) if path.exists() else {}
    new = compute()
    lines = moved(old, new)
    print(f"{path.relative_to(Path(__file__).parents[1])}: {len(lines)} number(s) moved")
    for line in lines:
        print(line)
    if lines and write:
        path.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
    return bool(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="print what moved, write nothing, exit 1 if anything did")
    args = ap.parse_args(argv)
    if os.environ.get("CI") and not args.check:
        ap.error("refusing to rewrite golden files under CI (CI is set): regenerate locally and review the diff")
    changed = [update(path, compute, write=not args.check)
               for path, compute in ((CORE_GOLDEN, golden_counts), (REPLAY_GOLDEN, golden_replay))]
    if any(changed) and not args.check:
        print("rewritten: review `git diff test/core/golden_core.json test/sim/golden_replay.json` before committing")
    return 1 if args.check and any(changed) else 0


if __name__ == "__main__":
    sys.exit(main())
