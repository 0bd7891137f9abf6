"""Reports of a replay: the comparison table, per-request CSV, JSON summary and plots.

The only module of the simulator that writes files; everything it prints is computed in metrics.py.
summary.json is strict JSON: an undefined number (NaN: a percentile of no requests, a ratio to a
policy that was not replayed) is written as null, its key kept. Plots use matplotlib's Agg backend
(headless) and are skipped with a note when it is missing.
"""
from __future__ import annotations

import csv
import inspect
import json
import math
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ..core import MISS_REASONS
from .metrics import (PolicyRun, long_prefill_uids, miss_tokens_by_reason, recovered_fraction, reuse_sensitive_uids,
                      speedups, summarize)

REPORT_FILES = ("summary.json", "requests.csv", "ttft_cdf.png", "per_request.png", "miss_reasons.png")
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan")
LINESTYLES = ("-", "--", ":", "-.")
_COHORT_THRESHOLD = inspect.signature(reuse_sensitive_uids).parameters["threshold"].default


def cohort_definition() -> str:
    """What "reuse-sensitive" means (metrics.reuse_sensitive_uids), in words for a plot."""
    points = f"{_COHORT_THRESHOLD * 100:g} points"
    return (f"reuse-sensitive = vllm-disk hit rate >= {points} below unlimited's, "
            f"or histate and vllm-disk hit rates >= {points} apart")


def build_summary(runs: Mapping[str, PolicyRun], baseline: str = "vllm-marconi") -> dict:
    summaries = {name: summarize(run) for name, run in runs.items()}
    cohort = reuse_sensitive_uids(runs)
    for name, run in runs.items():
        summaries[name]["cohort_recovered_fraction"] = recovered_fraction(runs, name, cohort)
        summaries[name]["replay_wall_s"] = run.wall_s
        if "engine" in run.engine_stats:  # memory pressure: requests that waited or were preempted
            summaries[name]["engine"] = run.engine_stats["scheduler"]
            summaries[name]["admissions_deferred"] = run.engine_stats["engine"].admissions_deferred
            summaries[name]["preemptions"] = run.engine_stats["engine"].preemptions
            gate = run.engine_stats["admission"]
            summaries[name]["admission_overcommits"] = gate.overcommits
            if gate.planned_interior:  # in-pass capture (core/capture.py): what the passes realised
                summaries[name]["captures"] = {"planned_interior": gate.planned_interior,
                                               "captured_interior": gate.captured_interior,
                                               "off_grid": gate.off_grid}
        if cohort:
            on_cohort = summarize(run, cohort)
            summaries[name]["cohort_ttft_mean_s"] = on_cohort["ttft_mean_s"]
            summaries[name]["cohort_ttft_p95_s"] = on_cohort["ttft_p95_s"]
        if "tool_wait" in run.engine_stats:  # --tool-wait-prefetch on: what the holds did (core/tool_wait.py)
            summaries[name]["tool_wait"] = run.engine_stats["tool_wait"]
        misses = miss_tokens_by_reason(run)
        if misses is not None:  # why the uncached tokens missed (core/misses.py); they sum to input - reused
            summaries[name]["miss_tokens_by_reason"] = misses
        long = summarize(run, long_prefill_uids(run))  # what a short-first order costs the long ones
        summaries[name]["long_prefills"] = long["requests"]
        summaries[name]["long_prefill_ttft_mean_s"] = long["ttft_mean_s"]
        summaries[name]["long_prefill_ttft_p95_s"] = long["ttft_p95_s"]
    return {"policies": summaries, "speedup_vs_" + baseline: speedups(summaries, baseline),
            "reuse_sensitive_requests": len(cohort)}


def format_table(summary: dict, baseline: str = "vllm-marconi") -> str:
    """p95 and p99 over all requests next to the same over non-first requests of a session ("nf")."""
    rows = summary["policies"]
    speed = summary.get("speedup_vs_" + baseline, {})
    head = (f"{'policy':<18} {'hit rate':>8} {'TTFT p50':>9} {'p95':>7} {'p95 nf':>7} {'p99':>7} {'p99 nf':>7} "
            f"{'mean':>7} {'p95 x':>6} {'p99 x':>6} {'nf p99 x':>8} {'cohort rec.':>11}")
    lines = [head, "-" * len(head)]
    for name, s in rows.items():
        sp = speed.get(name, {})
        lines.append(
            f"{name:<18} {_pct(s['token_hit_rate'], 8, 2)} {_s(s['ttft_p50_s'], 8, 3)} {_s(s['ttft_p95_s'], 6, 2)} "
            f"{_s(s['ttft_p95_non_first_s'], 6, 2)} {_s(s['ttft_p99_s'], 6, 2)} {_s(s['ttft_p99_non_first_s'], 6, 2)} "
            f"{_s(s['ttft_mean_s'], 6, 3)} {_x(sp.get('ttft_p95_s'), 6)} {_x(sp.get('ttft_p99_s'), 6)} "
            f"{_x(sp.get('ttft_p99_non_first_s'), 8)} {_pct(s['cohort_recovered_fraction'], 11, 1)}")
    lines.append(f"nf = over requests that are not the first of their session; speedups (x) are {baseline} TTFT / "
                 f"policy TTFT; cohort rec. = share of unlimited's reusable tokens recovered on the "
                 f"{summary['reuse_sensitive_requests']} reuse-sensitive requests")
    return "\n".join(lines)


def format_misses(summary: dict) -> str:
    """Why the uncached prompt tokens missed, per policy: each reason's share of its input tokens."""
    rows = {name: s["miss_tokens_by_reason"] for name, s in summary["policies"].items() if "miss_tokens_by_reason" in s}
    if not rows:
        return ""
    head = f"{'policy':<18} {'uncached':>8} " + " ".join(f"{reason:>13}" for reason in MISS_REASONS)
    lines = [head, "-" * len(head)]
    for name, misses in rows.items():
        input_tokens = summary["policies"][name]["input_tokens"] or 1
        lines.append(f"{name:<18} {_pct(sum(misses.values()) / input_tokens, 8, 1)} "
                     + " ".join(_pct(misses[reason] / input_tokens, 13, 1) for reason in MISS_REASONS))
    lines.append("shares of all input tokens; the reasons of a request add up to its uncached tokens "
                 "(docs/misses.md)")
    return "\n".join(lines)


def _defined(v) -> bool:
    return v is not None and math.isfinite(v)


def _s(v, width: int, digits: int) -> str:
    return f"{v:>{width}.{digits}f}s" if _defined(v) else f"{'-':>{width + 1}}"


def _x(v, width: int) -> str:
    return f"{v:>{width}.2f}" if _defined(v) else f"{'-':>{width}}"


def _pct(v, width: int, digits: int) -> str:
    return f"{v:>{width}.{digits}%}" if _defined(v) else f"{'-':>{width}}"


def strict_json(value):
    """`value` with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def check_writable(out_dir: Path) -> None:
    """Raise OSError naming `out_dir` unless the reports can be written there; run it before a replay
    so that an unusable --out fails in seconds, not after the whole replay. Creates the directory."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OSError(f"--out {out_dir}: exists and is not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as err:
        raise OSError(f"--out {out_dir}: cannot write reports there: {err.strerror or err}") from None
    for name in REPORT_FILES:
        path = out_dir / name
        if path.exists() and not path.is_file():
            raise OSError(f"--out {out_dir}: {name} exists and is not a regular file")


def compared_policies(summary: dict) -> list:
    """What a person compares in the TTFT plot: HiState, the ceiling (`unlimited`) and each engine's best
    baseline of this run (lowest p95 among the policies its scheduler serves, ablations of HiState
    excluded), in the run's order. Policies absent from the run are skipped."""
    from histate.core import make_policy

    stats = summary.get("policies", {})
    best: dict = {}
    for name, s in stats.items():
        if name.startswith("histate") or name == "unlimited":
            continue
        p95 = s.get("ttft_p95_s")
        engine = make_policy(name).engine
        if _defined(p95) and (engine not in best or p95 < best[engine][1]):
            best[engine] = (name, p95)
    keep = {"histate", "unlimited"} | {name for name, _ in best.values()}
    return [name for name in stats if name in keep]


def write_outputs(runs: Mapping[str, PolicyRun], summary: dict, out_dir: Path, plots: bool = True,
                  plot_policies: Optional[Sequence[str]] = None) -> list:
    """Write summary.json, requests.csv and (optionally) PNG plots; returns the paths written.
    `plot_policies`: the policies the TTFT CDF draws (None: `compared_policies`, or every policy of
    the run when that leaves fewer than two)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    path = out_dir / "summary.json"
    path.write_text(json.dumps(strict_json(summary), indent=1, default=str, allow_nan=False) + "\n")
    written.append(path)
    path = out_dir / "requests.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", "uid", "session_id", "session_index", "flags", "arrival_s", "input_tokens",
                    "kv_hit_tokens", "reused_tokens", "restore_s", "ttft_s"]
                   + [f"miss_tokens_{reason}" for reason in MISS_REASONS])
        for name, run in runs.items():
            for r in run.records:
                misses = r.miss_tokens
                w.writerow([name, r.uid, r.session_id, r.session_index, r.flags, f"{r.arrival_s:.6f}",
                            r.input_tokens, r.kv_hit_tokens, r.reused_tokens, f"{r.restore_s:.6f}",
                            f"{r.ttft_s:.6f}"]
                           + [("" if misses is None else misses[reason]) for reason in MISS_REASONS])
    written.append(path)
    if plots:
        drawn = list(plot_policies) if plot_policies is not None else compared_policies(summary)
        if len(drawn) < 2:
            drawn = list(runs)
        written += _plots(runs, out_dir, [name for name in drawn if name in runs])
    return written


def _plots(runs: Mapping[str, PolicyRun], out_dir: Path, drawn: Sequence[str]) -> list:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the `sim` extra brings matplotlib; without it the tables still stand
        print("matplotlib not installed: skipping plots")
        return []
    hidden = len(runs) - len(drawn)
    written = [_save(ttft_cdf_figure({name: runs[name] for name in drawn}, plt, hidden), out_dir / "ttft_cdf.png", plt)]
    cohort = reuse_sensitive_uids(runs)
    if cohort:
        written.append(_save(per_request_figure(runs, cohort, plt), out_dir / "per_request.png", plt))
    misses = {name: m for name, run in runs.items() if (m := miss_tokens_by_reason(run)) is not None}
    if misses:
        inputs = {name: sum(r.input_tokens for r in runs[name].records) for name in misses}
        written.append(_save(miss_reasons_figure(misses, inputs, plt), out_dir / "miss_reasons.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def line_styles(names) -> dict:
    """name -> (colour, linestyle), different for every name: ten colours, then the ten again with the
    next line style (the simulator has more policies than a colour cycle has colours)."""
    return {name: (COLOURS[i % len(COLOURS)], LINESTYLES[i // len(COLOURS) % len(LINESTYLES)])
            for i, name in enumerate(names)}


def ttft_cdf_figure(runs: Mapping[str, PolicyRun], plt, num_hidden: int = 0):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = line_styles(runs)
    for name, run in runs.items():
        xs = sorted(r.ttft_s for r in run.records if not math.isnan(r.first_token_s))
        if xs:
            colour, linestyle = styles[name]
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name, lw=1.2, color=colour,
                    linestyle=linestyle)
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0.5, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    title = "TTFT CDF per policy (upper half)"
    if num_hidden:
        title += f"\nHiState, the ceiling, each engine's best baseline (p95); {num_hidden} more: --plot-policies all"
    ax.set_title(title, fontsize=9)
    return fig


def per_request_figure(runs, cohort, plt):
    """Figure-9 style: hit rate, TTFT and TTFT normalised to vllm-disk on the reuse-sensitive cohort,
    ordered by the hit-rate gap between unlimited and vllm-disk; the title says what the cohort is."""
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
    axes[2].set_xlabel(f"the {len(order):,} reuse-sensitive requests, by the hit-rate gap between unlimited and "
                       f"vllm-disk (histate below vllm-disk last)")
    axes[0].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"Per request, reuse-sensitive cohort\n{cohort_definition()}", fontsize=9)
    return fig


def miss_reasons_figure(misses: Mapping[str, dict], input_tokens: Mapping[str, int], plt):
    """One stacked bar per policy: its uncached input tokens split by reason, as shares of its input."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(misses) + 3), 4.5))
    stack_miss_reasons(ax, {n: {r: misses[n][r] / max(input_tokens[n], 1) for r in MISS_REASONS} for n in misses})
    ax.set_ylabel("share of input tokens not served from cache")
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Why input tokens missed, per policy (simulated; docs/misses.md)", fontsize=9)
    return fig


def stack_miss_reasons(ax, shares: Mapping[str, Mapping[str, float]]) -> None:
    """One bar per name, stacked by reason in MISS_REASONS order, one colour per reason (the legend's)."""
    names = list(shares)
    bottoms = [0.0] * len(names)
    for i, reason in enumerate(MISS_REASONS):
        heights = [shares[n][reason] for n in names]
        ax.bar(names, heights, bottom=bottoms, label=reason, color=COLOURS[i % len(COLOURS)])
        bottoms = [b + h for b, h in zip(bottoms, heights)]
