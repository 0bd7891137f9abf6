"""`make upstream-check`: apply the patch series to a copy of the installed SGLang, test the copy.

    .venv/bin/python upstream/check.py [--keep DIR]

1. Copies the installed `sglang` package (SGLang v0.5.23's `python/sglang` tree, as the wheel installs it)
   into a temporary directory: hard links where the filesystem allows (fast), a real copy of every file a
   patch touches (so the installed SGLang is never written).
2. Applies each patch of upstream/series/series in order with `patch -p1 --fuzz=0`: a patch that does not
   apply exactly, offsets aside, fails the check (a series that needs fuzz no longer applies "cleanly").
3. Runs, with the patched copy first on sys.path (two pytest processes side by side, `--jobs`): the series' own tests (upstream/tests: what each patch
   ships to SGLang's tree, and that the plugin takes the patched paths), then the plugin tests each patch
   names in the series file (the plugin, unchanged, on the patched SGLang: the same decisions).
Exit status 0 only if every patch applied and every test passed.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERIES_DIR = ROOT / "upstream" / "series"


def read_series(path: Path = SERIES_DIR / "series") -> list:
    """[(patch file, [plugin test paths])] in order; '#' starts a comment."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, *tests = line.split()
        if not (SERIES_DIR / name).is_file():
            raise SystemExit(f"{path}:{number}: no patch file {name}")
        entries.append((SERIES_DIR / name, tests))
    return entries


def touched_files(patch: Path) -> list:
    """Paths (relative to the site-packages root) a unified diff writes."""
    return [m.group(1) for m in re.finditer(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)]


def installed_sglang() -> Path:
    spec = importlib.util.find_spec("sglang")  # finds without importing (sglang's __init__ needs CUDA's triton)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SGLang is not installed (make venv installs 0.5.23)")
    return Path(list(spec.submodule_search_locations)[0])


def copy_tree(source: Path, dest: Path, real_copies: set) -> None:
    def link_or_copy(src: str, dst: str) -> None:
        if Path(dst).relative_to(dest.parent).as_posix() in real_copies:
            shutil.copy2(src, dst)
            return
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, dest, copy_function=link_or_copy, ignore=shutil.ignore_patterns("__pycache__"))


def run_tests(tests: list, env: dict, jobs: int) -> int:
    """pytest over `tests` in `jobs` processes side by side (the patched copy is only read), each given every
    jobs-th file; the outputs are printed one after the other. 0 only if every process passed."""
    groups = [tests[i::jobs] for i in range(max(1, jobs)) if tests[i::jobs]]
    procs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *group], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for group in groups]
    status = 0
    for group, proc in zip(groups, procs):
        output, _ = proc.communicate()
        print(f"--- pytest {' '.join(group)}\n{output}", end="")
        status = status or proc.returncode
    return status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="build the patched copy here and keep it (default: a temporary directory)")
    ap.add_argument("--jobs", type=int, default=2, help="pytest processes run side by side (tests split by file)")
    args = ap.parse_args()
    series = read_series()
    work = args.keep or Path(tempfile.mkdtemp(prefix="histate-upstream-"))
    try:
        target = work / "sglang"
        if target.exists():
            shutil.rmtree(target)
        touched = {path for patch, _ in series for path in touched_files(patch)}
        copy_tree(installed_sglang(), target, touched)
        for patch, _ in series:
            done = subprocess.run(["patch", "-p1", "--fuzz=0", "--batch", "--forward", "-d", str(work), "-i", str(patch)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(f"FAIL {patch.name} does not apply to SGLang 0.5.23:\n{done.stdout}{done.stderr}")
                return 1
            print(f"applied {patch.name}")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work), str(ROOT / "python"), str(ROOT)])}
        tests = list(dict.fromkeys(["upstream/tests"] + [t for _, names in series for t in names]))
        print(f"testing the patched SGLang: {' '.join(tests)}")
        return run_tests(tests, env, args.jobs)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
