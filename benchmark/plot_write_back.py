"""Plot write_back against write_through (docs/results.md): p95 TTFT (or another metric) of each policy, median
over seeds with the seed range. Reads the `summary.json` files `benchmark/robustness.py` writes; replays nothing.

Per row, one panel per run (plain scheduling, `+sched`; section "Checkpoints to the SSD at creation under
write_back"):

    .venv/bin/python benchmark/plot_write_back.py --runs "plain=out/robustness_wb_reclaim" \\
        "+sched=out/robustness_wb_reclaim_sched" --out docs/write_back_state.png

Against the host's size, one row, one run per size (`robustness.py --rows base --replay-args "--cpu-gib G"`;
section "write_back against write_through as the host grows"), one panel per metric:

    .venv/bin/python benchmark/plot_write_back.py --host-sweep base --runs 48=out/wb_sweep/cpu48 \\
        64=out/wb_sweep/cpu64 80=out/wb_sweep/cpu80 96=out/wb_sweep/cpu96 --metric ttft_p95_s ttft_p99_s \\
        --out docs/write_back_host_sweep.png

Policy names a run was written under before a rename are given as `--alias OLD=NEW` (the runs of the first
section were written when `histate-writeback-via-host` was `histate-writeback-server`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

LABELS = {  # policy -> what the plot calls it
    "histate": "histate, write_through (default)",
    "histate-writeback": "histate, write_back + state writes (the server)",
    "histate-writeback-via-host": "histate, write_back via host (before)",
    "vllm-disk": "vllm-disk",
    "unlimited": "unlimited (ceiling)",
}


def _seed_values(run_dir: Path, row: str, policy: str, aliases: dict, metric: str) -> list:
    values = []
    for summary in sorted((run_dir / row).glob("seed*/summary.json")):
        policies = json.loads(summary.read_text())["policies"]
        name = policy if policy in policies else aliases.get(policy)
        if name in policies:
            values.append(policies[name][metric])
    return values


def _spread(values: list) -> tuple:
    """(median, below it, above it): a point and its seed-range error bar."""
    median = statistics.median(values)
    return median, median - min(values), max(values) - median


def _per_row(axes, runs: list, aliases: dict, metric: str) -> None:
    for ax, (label, run_dir) in zip(axes[:, 0], runs):
        rows = sorted(p.name for p in run_dir.iterdir() if (p / "seed0" / "summary.json").is_file())
        width = 0.8 / len(LABELS)
        for k, policy in enumerate(LABELS):
            xs, points = [], []
            for i, row in enumerate(rows):
                values = _seed_values(run_dir, row, policy, aliases, metric)
                if values:
                    xs.append(i + width * (k - (len(LABELS) - 1) / 2))
                    points.append(_spread(values))
            if xs:
                ys, lo, hi = zip(*points)
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=1.5, label=LABELS[policy])
        ax.set_xticks(range(len(rows)), rows, fontsize=8)
        ax.set_ylabel(f"{metric} (s)")
        ax.set_title(f"{label}: median over seeds, bars the seed range (simulated)", fontsize=9)
        ax.set_yscale("log")


def _host_sweep(axes, row: str, runs: list, aliases: dict, metrics: list) -> None:
    sized = sorted((float(label), run_dir) for label, run_dir in runs)
    for ax, metric in zip(axes[0], metrics):
        for policy, label in LABELS.items():
            xs, points = [], []
            for size, run_dir in sized:
                values = _seed_values(run_dir, row, policy, aliases, metric)
                if values:
                    xs.append(size)
                    points.append(_spread(values))
            if xs:
                ys, lo, hi = zip(*points)
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=label)
        ax.set_xlabel("host DRAM for the cache (GiB)")
        ax.set_ylabel(f"{metric} (s)")
        ax.set_title(f"{row}: median over seeds, bars the seed range (simulated)", fontsize=9)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True, metavar="LABEL=DIR")
    ap.add_argument("--host-sweep", metavar="ROW", help="plot ROW against the host size each run's LABEL gives (GiB)")
    ap.add_argument("--alias", nargs="*", default=["histate-writeback-via-host=histate-writeback-server"],
                    metavar="NEW=OLD", help="a policy's name in runs written before a rename")
    ap.add_argument("--metric", nargs="+", default=["ttft_p95_s"])
    ap.add_argument("--out", type=Path, default=Path("docs/write_back_state.png"))
    args = ap.parse_args()
    aliases = dict(spec.split("=", 1) for spec in args.alias)
    runs = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not Path(path).is_dir():
            raise SystemExit(f"--runs {spec!r}: expected LABEL=DIR (benchmark/robustness.py --out DIR)")
        if args.host_sweep is not None:
            try:
                float(label)
            except ValueError:
                raise SystemExit(f"--runs {spec!r}: with --host-sweep, LABEL is the host size in GiB") from None
        runs.append((label, Path(path)))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if args.host_sweep is not None:
        fig, axes = plt.subplots(1, len(args.metric), figsize=(5.2 * len(args.metric), 3.6), squeeze=False)
        _host_sweep(axes, args.host_sweep, runs, aliases, args.metric)
        axes[0, 0].legend(fontsize=7)
    else:
        fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.2 * len(runs)), squeeze=False)
        _per_row(axes, runs, aliases, args.metric[0])
        axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
