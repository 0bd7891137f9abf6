"""benchmark/gpu_check/ (the script for a lent GPU machine), exercised on CPU.

The GPU path cannot run here; what can: capture_check.py's dry path (the same harness over the torch
stand-in of SGLang's Triton GDN extend kernel), the harness failing on a wrong row, the direct load of
SGLang's fla chunk kernel without SGLang's package `__init__`s, the report table, and the shell scripts'
syntax and prepare.sh's carry-size check.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "benchmark" / "gpu_check"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_gpu_check_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while executing it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """`capture_check.py --dry-run --json ...`, in this process (a subprocess would import torch again)."""
    out = tmp_path_factory.mktemp("gpu_check") / "capture.json"
    threads = torch.get_num_threads()
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
            code = _load("capture_check").main(["--dry-run", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    return code, stdout.getvalue(), out


def test_dry_run_every_row_passes(dry_run):
    code, stdout, out = dry_run
    assert code == 0, stdout
    data = json.loads(out.read_text())
    check = _load("capture_check")
    assert data["dry_run"] and "STAND-IN" in data["label"] and "STAND-IN" in stdout
    rows = data["rows"]
    assert len(rows) == len(check.PAGE_SIZES) * len(check.DTYPE_CASES)
    assert all(r["result"] == "pass" for r in rows), rows
    assert {r["page_size"].split()[0] for r in rows} == {"64", "256"}
    assert {r["dtype"] for r in rows} == {"bf16 (state fp32)", "bf16 (state bf16)", "fp32 (state fp32)"}
    for r in rows:  # every case compared some positions and their neighbours
        assert " 0 positions" not in r["case"] and "neighbour rows differ" in r["detail"]
        assert float(r["max_error"]) < (1e-2 if r["dtype"].startswith("bf16") else 1e-5)
    assert "| case | dtype | page size | max error | result | detail |" in stdout


def test_the_harness_fails_a_kernel_whose_rows_are_off_by_one():
    check = _load("capture_check")
    extend, _ = check.load_standin_extend()
    lengths = (200, 130)

    def shifted(*args):  # the row after the right one: an off-by-one in h_index would read this
        h = extend(*args)
        return torch.cat([h[:, 1:], h[:, -1:]], dim=1)

    def short(*args):  # FlashInfer's floor(len / 64) rows where the Triton layout promises ceil
        return extend(*args)[:, :-1]

    shape = check.SHAPES["dry"]
    good = check.check_case(extend, lengths, "float32", "float32", 64, shape, "cpu", seed=0)
    assert good.result == "pass", good
    bad = check.check_case(shifted, lengths, "float32", "float32", 64, shape, "cpu", seed=0)
    assert bad.result == "FAIL" and "max err" in bad.detail, bad
    wrong_layout = check.check_case(short, lengths, "bfloat16", "float32", 64, shape, "cpu", seed=0)
    assert wrong_layout.result == "FAIL" and "layout promises" in wrong_layout.detail, wrong_layout


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang not installed")
def test_sglangs_fla_chunk_kernel_loads_without_its_package_init():
    """What the GPU path falls back to when SGLang's package import needs modules the box lacks: the fla
    chunk module and its siblings only (triton is SGLang's CPU stub here, as in test/sglang)."""
    code = (
        "import sys; sys.path[:0] = ['.', 'benchmark/gpu_check']\n"
        "from sglang_cpu import stubs; stubs.install()\n"
        "import capture_check\n"
        "chunk = capture_check._fla_direct()\n"
        "assert callable(chunk.chunk_gated_delta_rule)\n"
        "real = sorted(m for m, mod in sys.modules.items() if m.startswith('sglang.') and getattr(mod, '__file__', None))\n"
        "print('\\n'.join(real))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = proc.stdout.split()
    assert "sglang.kernels.ops.attention.fla.chunk" in loaded
    assert all(m.startswith("sglang.kernels.ops.attention.fla.") for m in loaded), loaded


def test_report_is_one_table_and_fails_on_a_failed_row(dry_run, tmp_path):
    capture = dry_run[2]
    steps = tmp_path / "steps.tsv"
    steps.write_text("machine\tinfo\t\tH100\nsetup: venv\tok\t3\tfresh\n"
                     "pytest -m gpu\tpass\t40\t9 passed\ncapture_check\tpass\t60\t6 passed\n")
    out = tmp_path / "gpu_check.md"
    cmd = [sys.executable, str(HERE / "report.py"), "--steps", str(steps), "--capture", str(capture), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text == proc.stdout
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert sum(line.startswith("| check |") for line in table) == 1  # one table
    assert sum(line.startswith("| capture: ") for line in table) == 6
    assert text.rstrip().endswith("Overall: pass")
    with steps.open("a") as fh:
        fh.write("pytest -m gpu\tFAIL\t41\t1 failed\n")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Overall: FAIL (pytest -m gpu)" in proc.stdout


@pytest.mark.parametrize("script", ["run.sh", "prepare.sh"])
def test_shell_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(HERE / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_prepare_refuses_a_carry_over_the_limit():
    env = dict(os.environ, GPU_CHECK_CARRY_LIMIT_MIB="0")
    proc = subprocess.run(["bash", str(HERE / "prepare.sh"), "--check-only"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 1 and "over its 0 MiB limit" in proc.stderr, proc.stdout + proc.stderr
    env["GPU_CHECK_CARRY_LIMIT_MIB"] = "100000"
    proc = subprocess.run(["bash", str(HERE / "prepare.sh"), "--check-only"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0 and "work tree" in proc.stdout, proc.stdout + proc.stderr
