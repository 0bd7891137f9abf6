"""benchmark/plot_write_back.py reads robustness runs (summary.json per row and seed), takes a policy under the
name it had before a rename, and draws one panel per run."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmark" / "plot_write_back.py"


def _load():
    spec = importlib.util.spec_from_file_location("plot_write_back", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_dir(root: Path, names: dict) -> Path:
    for row in ("base", "cpu48"):
        for seed, scale in ((0, 1.0), (1, 2.0)):
            path = root / row / f"seed{seed}" / "summary.json"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps({"policies": {name: {"ttft_p95_s": value * scale}
                                                     for name, value in names.items()}}))
    return root


def test_a_policy_is_read_under_its_old_name_and_the_plot_is_written(tmp_path):
    plot = _load()
    run = _run_dir(tmp_path / "plain", {"histate": 1.5, "histate-writeback-server": 1.2, "unlimited": 1.0})
    aliases = {"histate-writeback-via-host": "histate-writeback-server"}
    assert plot._seed_values(run, "cpu48", "histate-writeback-via-host", aliases, "ttft_p95_s") == [1.2, 2.4]
    assert plot._seed_values(run, "cpu48", "histate-writeback", aliases, "ttft_p95_s") == []  # not in this run
    out = tmp_path / "plot.png"
    done = subprocess.run([sys.executable, str(SCRIPT), "--runs", f"plain={run}", f"+sched={run}", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.stat().st_size > 10_000


def test_a_run_that_is_not_a_directory_is_refused_with_its_flag(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--runs", f"plain={tmp_path / 'missing'}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--runs" in done.stderr and "missing" in done.stderr


def test_a_host_sweep_plots_one_row_against_the_host_size(tmp_path):
    plot = _load()
    runs = [(str(size), _run_dir(tmp_path / f"cpu{size}", {"histate": 1.0 + 0.01 * size, "histate-writeback": 0.9}))
            for size in (64, 48)]
    assert plot._spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 1.0)
    out = tmp_path / "sweep.png"
    argv = [sys.executable, str(SCRIPT), "--host-sweep", "base", "--metric", "ttft_p95_s", "--out", str(out), "--runs"]
    done = subprocess.run(argv + [f"{label}={path}" for label, path in runs], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.stat().st_size > 10_000
    # a label that is not a size is refused, naming the flag
    done = subprocess.run(argv + [f"big={runs[0][1]}"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--runs" in done.stderr and "host size" in done.stderr
