"""Reports of a replay: the comparison table, per-request CSV, JSON summary and plots.

The only module of the simulator that writes files; everything it prints is computed in metrics.py.
Plots use matplotlib's Agg backend (headless) and are skipped with a note when it is missing.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Mapping

from .metrics import PolicyRun, recovered_fraction, reuse_sensitive_uids, speedups, summarize


def build_summary(runs: Mapping[str, PolicyRun], baseline: str = "vllm-marconi") -> dict:
    summaries = {name: summarize(run) for name, run in runs.items()}
    cohort = reuse_sensitive_uids(runs)
    for name, run in runs.items():
        summaries[name]["cohort_recovered_fraction"] = recovered_fraction(runs, name, cohort)
        summaries[name]["replay_wall_s"] = run.wall_s
        if "engine" in run.engine_stats:  # memory pressure: requests that waited or were preempted
            summaries[name]["admissions_deferred"] = run.engine_stats["engine"].admissions_deferred
            summaries[name]["preemptions"] = run.engine_stats["engine"].preemptions
            summaries[name]["admission_overcommits"] = run.engine_stats["admission"].overcommits
        if cohort:
            summaries[name]["cohort_ttft_mean_s"] = summarize(run, cohort)["ttft_mean_s"]
    return {"policies": summaries, "speedup_vs_" + baseline: speedups(summaries, baseline),
            "reuse_sensitive_requests": len(cohort)}


def format_table(summary: dict, baseline: str = "vllm-marconi") -> str:
    rows = summary["policies"]
    speed = summary.get("speedup_vs_" + baseline, {})
    head = (f"{'policy':<18} {'hit rate':>8} {'TTFT p50':>9} {'p95':>8} {'p99':>8} {'mean':>8} "
            f"{'p95 x':>6} {'p99 x':>6} {'cohort rec.':>11}")
    lines = [head, "-" * len(head)]
    for name, s in rows.items():
        sp = speed.get(name, {})
        lines.append(
            f"{name:<18} {s['token_hit_rate']:>8.2%} {s['ttft_p50_s']:>8.3f}s {s['ttft_p95_s']:>7.2f}s "
            f"{s['ttft_p99_s']:>7.2f}s {s['ttft_mean_s']:>7.3f}s {_x(sp.get('ttft_p95_s'))} {_x(sp.get('ttft_p99_s'))} "
            f"{_pct(s['cohort_recovered_fraction']):>11}")
    lines.append(f"speedups (x) are {baseline} TTFT / policy TTFT; cohort rec. = share of unlimited's reusable "
                 f"tokens recovered on the {summary['reuse_sensitive_requests']} reuse-sensitive requests")
    return "\n".join(lines)


def _x(v) -> str:
    return f"{v:>6.2f}" if v is not None and not math.isnan(v) else f"{'-':>6}"


def _pct(v) -> str:
    return f"{v:.1%}" if v is not None and not math.isnan(v) else "-"


def write_outputs(runs: Mapping[str, PolicyRun], summary: dict, out_dir: Path, plots: bool = True) -> list:
    """Write summary.json, requests.csv and (optionally) PNG plots; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    path = out_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    written.append(path)
    path = out_dir / "requests.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", "uid", "session_id", "flags", "arrival_s", "input_tokens", "kv_hit_tokens",
                    "reused_tokens", "restore_s", "ttft_s"])
        for name, run in runs.items():
            for r in run.records:
                w.writerow([name, r.uid, r.session_id, r.flags, f"{r.arrival_s:.6f}", r.input_tokens,
                            r.kv_hit_tokens, r.reused_tokens, f"{r.restore_s:.6f}", f"{r.ttft_s:.6f}"])
    written.append(path)
    if plots:
        written += _plots(runs, out_dir)
    return written


def _plots(runs: Mapping[str, PolicyRun], out_dir: Path) -> list:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the `sim` extra brings matplotlib; without it the tables still stand
        print("matplotlib not installed: skipping plots")
        return []
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        xs = sorted(r.ttft_s for r in run.records if not math.isnan(r.first_token_s))
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name, lw=1.2)
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0.5, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("TTFT CDF per policy (upper half)")
    path = out_dir / "ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    cohort = reuse_sensitive_uids(runs)
    if cohort:
        written.append(_per_request_panel(runs, cohort, out_dir, plt))
    return written


def _per_request_panel(runs, cohort, out_dir: Path, plt) -> Path:
    """Figure-9 style: hit rate, TTFT and TTFT normalised to vllm-disk on the reuse-sensitive cohort,
    ordered by the hit-rate gap between unlimited and vllm-disk."""
    base, top, ours = runs["vllm-disk"].by_uid(), runs["unlimited"].by_uid(), runs["histate"].by_uid()
    order = sorted(cohort, key=lambda u: (ours[u].hit_rate < base[u].hit_rate,
                                          -(top[u].hit_rate - base[u].hit_rate)))
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    xs = range(len(order))
    for name, style in (("unlimited", ":"), ("vllm-disk", "-"), ("histate", "-")):
        by = runs[name].by_uid()
        axes[0].plot(xs, [by[u].hit_rate for u in order], style, label=name, lw=1)
        axes[1].plot(xs, [by[u].ttft_s for u in order], style, label=name, lw=1)
        axes[2].plot(xs, [by[u].ttft_s / max(base[u].ttft_s, 1e-9) for u in order], style, label=name, lw=1)
    axes[0].set_ylabel("hit rate")
    axes[1].set_ylabel("TTFT (s)")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("TTFT / vllm-disk")
    axes[2].set_xlabel("reuse-sensitive requests")
    axes[0].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    path = out_dir / "per_request.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
