"""`make mutants`: do the tests fail when the code they guard is wrong?

Each mutant in mutants.toml is a one-line change (an exact snippet and its replacement) to a module
whose bug would be a wrong result: the eq. 3-7 scores, the capture grid, the FlashInfer row of `h`,
checksums, the SSD accounting, the SSD acknowledgement bits. For each one the runner

  1. copies the repository's code and tests (python/, sglang_cpu/, test/, pytest.ini) to a temporary
     directory, once; the checkout itself is never written (other work happens in it);
  2. applies the mutant to the copy (the snippet must occur exactly once, else the mutant is stale
     and the run fails: a mutant that no longer applies tests nothing);
  3. runs the mutant's targeted tests there, with PYTHONPATH and the working directory on the copy,
     and a pytest plugin (`_guard.py`) that refuses to run unless the mutated module is imported from
     the copy (the checkout's editable install would otherwise shadow it silently);
  4. reverts the copy.

A mutant is *killed* when its tests fail and *survives* when they pass; the exit status is non-zero
if any survives (or is stale, or the unmutated baseline fails: a red baseline would "kill" every
mutant). The baseline runs every targeted test once on the unmutated copy first (`--no-baseline`
skips it).

    .venv/bin/python benchmark/mutants/run.py [--only NAME ...] [--list] [--no-baseline]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
COPIED = ("python", "sglang_cpu", "test", "pytest.ini")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache", "*.egg-info")
TIMEOUT_S = 300  # per mutant; a hang counts as killed only if it is a failure, so it is reported as such


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    original: str
    replacement: str
    tests: tuple
    why: str

    @property
    def module(self) -> str:
        """The dotted module the file is (what the guard checks is imported from the copy)."""
        path = Path(self.file).with_suffix("")
        parts = path.parts[1:] if path.parts[0] == "python" else path.parts
        return ".".join(parts)


def load(path: Path) -> list:
    with path.open("rb") as f:
        data = tomllib.load(f)
    mutants = [Mutant(m["name"], m["file"], m["original"], m["replacement"], tuple(m["tests"]), m["why"].strip())
               for m in data["mutant"]]
    names = [m.name for m in mutants]
    assert len(set(names)) == len(names), "duplicate mutant names"
    return mutants


def copy_repo(dest: Path) -> None:
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=IGNORED)
        else:
            shutil.copy2(src, dest / name)


def pytest_env(copy: Path, module: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy / "python"), str(copy), str(HERE)])
    env["HISTATE_MUTANT_ROOT"] = str(copy)
    env["HISTATE_MUTANT_MODULE"] = module
    env.setdefault("HYPOTHESIS_PROFILE", "dev")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def run_tests(copy: Path, tests: list, module: str) -> tuple:
    """(returncode, seconds, tail of the output) of pytest over `tests` in the copy."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "_guard", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=pytest_env(copy, module), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, out = -1, f"timed out after {TIMEOUT_S} s\n{e.stdout or ''}"
    return code, time.monotonic() - start, out.strip().splitlines()[-12:]


def apply(copy: Path, mutant: Mutant) -> str:
    """Mutate the copy; returns the original text to restore. Raises on a stale mutant."""
    path = copy / mutant.file
    text = path.read_text()
    count = text.count(mutant.original)
    if count != 1:
        raise LookupError(f"{mutant.name}: the snippet occurs {count} times in {mutant.file} (stale mutant)")
    path.write_text(text.replace(mutant.original, mutant.replacement))
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", type=Path, default=HERE / "mutants.toml")
    ap.add_argument("--only", nargs="+", help="run these mutants only")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the targeted tests")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy (its path is printed)")
    args = ap.parse_args()
    mutants = load(args.mutants)
    if args.only:
        unknown = set(args.only) - {m.name for m in mutants}
        if unknown:
            ap.error(f"unknown mutants: {sorted(unknown)}")
        mutants = [m for m in mutants if m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:32s} {m.file}\n    {m.why}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="histate-mutants-"))
    copy = tmp / "repo"
    copy.mkdir()
    started = time.monotonic()
    try:
        copy_repo(copy)
        print(f"copy of {REPO} at {copy}", flush=True)
        if not args.no_baseline:
            tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
            code, seconds, tail = run_tests(copy, tests, mutants[0].module)
            print(f"baseline (unmutated, {len(tests)} targets): {'pass' if code == 0 else 'FAIL'} in {seconds:.0f} s",
                  flush=True)
            if code != 0:
                print("\n".join(tail))
                return 2
        results = []
        for i, mutant in enumerate(mutants, 1):
            try:
                original = apply(copy, mutant)
            except LookupError as e:
                print(f"[{i}/{len(mutants)}] STALE    {mutant.name}: {e}", flush=True)
                results.append((mutant, "stale"))
                continue
            try:
                code, seconds, tail = run_tests(copy, list(mutant.tests), mutant.module)
            finally:
                (copy / mutant.file).write_text(original)
            if code == 4 or any("HISTATE_MUTANT_GUARD" in line for line in tail):
                verdict = "error"  # usage error / guard refusal: not a kill
            else:
                verdict = "killed" if code != 0 else "SURVIVED"
            first = next((line for line in tail if line.startswith(("FAILED", "ERROR"))), "")
            print(f"[{i}/{len(mutants)}] {verdict:8s} {mutant.name} ({seconds:.0f} s) {first[:150]}", flush=True)
            if verdict != "killed":
                print("    " + "\n    ".join(tail))
            results.append((mutant, verdict))
        bad = [(m.name, v) for m, v in results if v != "killed"]
        killed = sum(v == "killed" for _, v in results)
        print(f"\n{killed}/{len(results)} mutants killed in {time.monotonic() - started:.0f} s"
              + (f"; not killed: {bad}" if bad else ""))
        return 1 if bad else 0
    finally:
        if args.keep:
            print(f"kept {copy}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
