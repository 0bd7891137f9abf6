"""`histate compare DIR DIR ...`: replay and bench runs side by side, per policy.

Each DIR is the output of `histate replay` or `histate bench` (requests.csv). Runs are grouped by
policy name; the first DIR that has a policy is its reference, and every other run of that policy
gets its TTFT percentiles as a ratio to the reference's and its hit rate as a difference in points.
So `histate compare out/live out/sim` prints sim/live ratios. When every DIR holds a single policy
(live runs, one per server or label), they are one group whatever their names: the first DIR is
the reference of all the others. Metrics are recomputed from the per-request rows with
`histate.sim.metrics.summarize`, so both sides use the same definitions.

Ratios only mean something between runs of one workload. Requests are identified by uid, so a run
whose requests are not the reference's (another trace, seed, --max-sessions, --token-scale or
--max-context; an interrupted bench) gets a warning naming how they differ; the table is still
printed. A requests.csv with no rows, or with a TTFT that is not a finite number of seconds >= 0,
is an error naming the file and line.

Outputs (with --out): compare.json (the table's numbers) and ttft_cdf_compare.png (one panel per
group, one line per run).
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Optional, Sequence

from ..core import MISS_REASONS
from ..sim.metrics import PolicyRun, RequestRecord, summarize

REQUIRED = ("policy", "uid", "session_id", "flags", "arrival_s", "input_tokens", "kv_hit_tokens", "reused_tokens",
            "restore_s", "ttft_s")


def load_runs(run_dir: Path) -> dict:
    """policy -> PolicyRun rebuilt from DIR/requests.csv. Errors name the file, line and column."""
    path = Path(run_dir) / "requests.csv"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no requests.csv (not a histate replay/bench output directory)")
    runs: dict = {}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}:1: header lacks column(s) {missing}")
        for line, row in enumerate(reader, start=2):
            record = _record(row, f"{path}:{line}")
            runs.setdefault(row["policy"], PolicyRun(row["policy"], [])).records.append(record)
    if not runs:
        raise ValueError(f"{path}: no requests (a header and no rows)")
    return runs


def _record(row: dict, where: str) -> RequestRecord:
    try:
        arrival, ttft = _seconds(row, "arrival_s"), _seconds(row, "ttft_s")
        misses = [row.get(f"miss_tokens_{reason}") for reason in MISS_REASONS]
        return RequestRecord(int(row["uid"]), row["session_id"], int(row["flags"]), arrival,
                             int(row["input_tokens"]), int(row["kv_hit_tokens"]), int(row["reused_tokens"]),
                             float(row["restore_s"]), arrival + ttft,
                             session_index=int(row.get("session_index") or 0),
                             miss_tokens=(dict(zip(MISS_REASONS, map(int, misses))) if all(misses) else None))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def _seconds(row: dict, column: str) -> float:
    value = float(row[column])
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{column} is {row[column]!r}, expected a finite number of seconds >= 0")
    return value


def load_all(run_dirs: Sequence[Path], labels: Sequence[str] = ()) -> list:
    """[(label, {policy: PolicyRun})] in the order given."""
    labels = list(labels) or _default_labels(run_dirs)
    if len(labels) != len(run_dirs):
        raise ValueError(f"--labels: {len(labels)} labels for {len(run_dirs)} directories")
    return [(label, load_runs(run_dir)) for label, run_dir in zip(labels, run_dirs)]


def group_runs(loaded: list) -> dict:
    """group -> [(label, PolicyRun)], the group's reference first: by policy name, or all together when
    every run holds one policy (module docstring)."""
    one_each = len(loaded) > 1 and all(len(runs) == 1 for _, runs in loaded)
    groups: dict = {}
    for label, runs in loaded:
        for policy, run in runs.items():
            key = next(iter(loaded[0][1])) if one_each else policy
            groups.setdefault(key, []).append((label, run))
    return groups


def workload_warnings(loaded: list) -> list:
    """One line per run whose requests are not the reference run's (first DIR): ratios between them
    compare different workloads."""
    (ref_label, ref_runs), *others = loaded
    ref = _input_tokens_by_uid(ref_runs)
    warnings = []
    for label, runs in others:
        mine = _input_tokens_by_uid(runs)
        common = ref.keys() & mine.keys()
        differ = sum(1 for uid in common if ref[uid] != mine[uid])
        if not common:
            why = "no request in common"
        elif differ:
            why = f"{differ:,} of {len(common):,} common requests differ in input tokens"
        elif len(common) < max(len(ref), len(mine)):
            why = f"{len(mine):,} requests against {len(ref):,} ({len(common):,} in common)"
        else:
            continue
        warnings.append(f"warning: run {label!r} is not the workload of the reference run {ref_label!r}: {why} "
                        f"(another trace, --seed, --max-sessions, --token-scale or --max-context, or an "
                        f"interrupted run?); its ratios compare different requests")
    return warnings


def _input_tokens_by_uid(runs: dict) -> dict:
    return {r.uid: r.input_tokens for run in runs.values() for r in run.records}


def compare(run_dirs: Sequence[Path], labels: Sequence[str] = (), warnings: Optional[list] = None) -> dict:
    """{group: [{run, ...summary, ratios vs the reference}]}, groups in first-seen order. Appends
    workload mismatches to `warnings` when given."""
    loaded = load_all(run_dirs, labels)
    if warnings is not None:
        warnings.extend(workload_warnings(loaded))
    table: dict = {}
    for group, runs in group_runs(loaded).items():
        rows = table[group] = []
        for label, run in runs:
            row = {"run": label, **summarize(run)}
            if rows:
                ref = rows[0]
                for key in ("ttft_p50_s", "ttft_p95_s", "ttft_mean_s"):
                    row[key[:-2] + "_ratio"] = _ratio(row[key], ref[key])
                row["hit_rate_diff"] = row["token_hit_rate"] - ref["token_hit_rate"]
            rows.append(row)
    return table


def format_comparison(table: dict) -> str:
    head = (f"{'policy':<16} {'run':<14} {'reqs':>5} {'hit rate':>8} {'TTFT p50':>9} {'p95':>8} {'mean':>8} "
            f"{'p50 x':>6} {'p95 x':>6} {'hit diff':>8}")
    lines = [head, "-" * len(head)]
    for rows in table.values():
        for row in rows:
            ratios = (f"{_x(row.get('ttft_p50_ratio'))} {_x(row.get('ttft_p95_ratio'))} "
                      f"{_pts(row.get('hit_rate_diff'))}")
            lines.append(f"{row['policy'][:16]:<16} {row['run'][:14]:<14} {row['requests']:>5} "
                         f"{row['token_hit_rate']:>8.2%} "
                         f"{row['ttft_p50_s']:>8.3f}s {row['ttft_p95_s']:>7.3f}s {row['ttft_mean_s']:>7.3f}s {ratios}")
    lines.append("x = TTFT / the reference's (the policy's first run, or the first DIR when each DIR holds one "
                 "policy); hit diff in points vs the reference")
    return "\n".join(lines)


def write_comparison(table: dict, run_dirs: Sequence[Path], labels: Sequence[str], out_dir: Path,
                     plots: bool = True) -> list:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "compare.json"
    path.write_text(json.dumps(table, indent=1) + "\n")
    written = [path]
    if plots:
        written += _plot(run_dirs, list(labels) or _default_labels(run_dirs), out_dir)
    return written


def _plot(run_dirs: Sequence[Path], labels: Sequence[str], out_dir: Path) -> list:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping plots")
        return []
    by_policy = group_runs(load_all(run_dirs, labels))
    cols = min(3, len(by_policy))
    rows = math.ceil(len(by_policy) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False, sharex=True)
    for ax, (policy, runs) in zip(axes.flat, by_policy.items()):
        for label, run in runs:
            xs = sorted(r.ttft_s for r in run.records if not math.isnan(r.first_token_s))
            name = label if run.policy == policy else f"{label} ({run.policy})"
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name, lw=1.2)
        ax.set_xscale("log")
        ax.set_title(policy, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(by_policy):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("TTFT (s)")
    for ax in axes[:, 0]:
        ax.set_ylabel("fraction of requests")
    fig.tight_layout()
    path = out_dir / "ttft_cdf_compare.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def _default_labels(run_dirs: Sequence[Path]) -> list:
    names = [Path(d).name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def _ratio(value: float, ref: float) -> float:
    return value / ref if ref and not math.isnan(ref) and not math.isnan(value) else math.nan


def _x(v) -> str:
    return f"{v:>6.2f}" if v is not None and not math.isnan(v) else f"{'-':>6}"


def _pts(v) -> str:
    return f"{v * 100:>+7.1f}p" if v is not None and not math.isnan(v) else f"{'-':>8}"
