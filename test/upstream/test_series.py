"""`make upstream-check` as part of the suite (CI runs it): the patch series applies to SGLang 0.5.23 and
the patched copy passes the series' tests and the plugin tests each patch names (upstream/check.py)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed (make venv)")
@pytest.mark.skipif(shutil.which("patch") is None, reason="no `patch` program to apply the series with")
def test_the_series_applies_and_the_patched_sglang_passes():
    done = subprocess.run([sys.executable, str(ROOT / "upstream" / "check.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "applied 0001-plugins-hookregistry-strict-mode.patch" in done.stdout


def test_a_patch_that_no_longer_applies_fails_the_check(tmp_path, monkeypatch, capsys):
    """The check's own failure path: a hunk whose context is not in SGLang's file is refused, not fuzzed."""
    sys.path.insert(0, str(ROOT / "upstream"))
    try:
        import check
    finally:
        sys.path.pop(0)
    patch = tmp_path / "0001-stale.patch"
    patch.write_text("--- a/sglang/srt/plugins/hook_registry.py\n+++ b/sglang/srt/plugins/hook_registry.py\n"
                     "@@ -1,3 +1,3 @@\n-this line is not in SGLang\n+nor this\n context\n")
    (tmp_path / "series").write_text("0001-stale.patch\n")
    monkeypatch.setattr(check, "SERIES_DIR", tmp_path)
    monkeypatch.setattr(check, "read_series", lambda: [(patch, [])])
    if importlib.util.find_spec("sglang") is None or shutil.which("patch") is None:
        pytest.skip("needs SGLang and `patch`")
    monkeypatch.setattr(sys, "argv", ["check.py"])
    assert check.main() == 1
    assert "FAIL 0001-stale.patch does not apply to SGLang 0.5.23" in capsys.readouterr().out


def test_a_failure_in_any_of_the_side_by_side_pytest_processes_fails_the_check(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "upstream"))
    try:
        import check
    finally:
        sys.path.pop(0)
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    pass\n")
    (tmp_path / "test_bad.py").write_text("def test_bad():\n    assert False\n")
    tests = [str(tmp_path / "test_ok.py"), str(tmp_path / "test_bad.py")]  # one file per process
    assert check.run_tests(tests, dict(os.environ), jobs=2) != 0
    out = capsys.readouterr().out
    assert "1 passed" in out and "1 failed" in out
    assert check.run_tests(tests[:1], dict(os.environ), jobs=2) == 0
