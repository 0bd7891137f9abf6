"""Users' clients against SGLang's own server with `--enable-histate`, and HiState on SGLang's /metrics.

  * `python -m sglang.bench_serving` (SGLang's benchmark client; it imports sglang, so it runs with the
    project's CPU import stubs, sglang_cpu/stubs.py): every request answered, TTFT > 0;
  * `histate bench` (the project's closed-loop agent replay) over two synthetic sessions;
  * `/metrics` with `--enable-metrics` and an SSD tier (the combination that crashed the scheduler at
    start-up, R1): HiState's series under SGLang's `sglang:` prefix with SGLang's labels, counting what
    the requests above did; SGLang's own storage histograms fed by HiState's backend (`get_stats`).
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys

from histate.core import MISS_REASONS

from .client import ROOT, metric_series, run_sglang_module


def test_sglang_bench_serving_against_histate(servers, tmp_path):
    out = tmp_path / "bench_serving.jsonl"
    argv = ["--backend", "sglang", "--base-url", servers.histate.url, "--dataset-name", "random-ids",
            "--num-prompts", "8", "--random-input-len", "300", "--random-output-len", "8",
            "--random-range-ratio", "1", "--output-file", str(out), "--disable-tqdm"]
    done = run_sglang_module("sglang.bench_serving", argv)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == 8, result.get("errors")
    assert 0 < result["mean_ttft_ms"] < result["mean_e2e_latency_ms"]


def test_histate_bench_against_sglang_with_histate(servers, tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "histate.cli", "bench", "--base-url", servers.histate.url, "--synthetic", "agent",
         "--max-sessions", "2", "--token-scale", "0.03125", "--time-scale", "0.0001", "--vocab-size", "512",
         "--out", str(out), "--no-progress", "--no-plots"],
        capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    (stats,) = summary["policies"].values()
    assert summary["bench"]["completed_requests"] == stats["requests"] > 0
    assert 0 < stats["ttft_p50_s"] <= stats["ttft_p99_s"] < 60
    # the server runs with --histate-miss-reasons: the client files its reasons, one column each, adding up
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    unbalanced = [{k: v for k, v in row.items() if k.startswith(("uid", "input", "reused", "kv_hit", "miss_tokens"))}
                  for row in rows if sum(int(row[f"miss_tokens_{r}"]) for r in MISS_REASONS)
                  != int(row["input_tokens"]) - int(row["reused_tokens"])]
    assert rows and not unbalanced, unbalanced
    assert sum(stats["miss_tokens_by_reason"].values()) == stats["input_tokens"] - stats["reused_tokens"]


def test_histate_counters_on_sglangs_metrics(servers):
    url = servers.histate.url
    hits = metric_series(url, "histate_prefix_hits_total")
    assert hits and sum(hits.values()) > 0, "no HiState hit counted"
    assert all('tp_rank="0"' in labels for labels in hits)
    captures = metric_series(url, "histate_captures_total")
    assert sum(v for k, v in captures.items() if 'result="tracked"' in k) > 0
    assert sum(v for k, v in captures.items() if 'result="unfilled"' in k) == 0
    assert sum(metric_series(url, "histate_ssd_written_bytes_total").values()) > 0
    assert sum(metric_series(url, "histate_input_tokens_total").values()) > 0
    # SGLang's own series next to them: its cache hit accounting and storage histograms fed by get_stats
    assert metric_series(url, "num_requests_total") or metric_series(url, "prompt_tokens_total")
    backups = metric_series(url, "backup_pgs_count")
    assert backups and sum(backups.values()) > 0, "SGLang's storage metrics saw no HiState backup"
