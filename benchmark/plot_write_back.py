"""Plot write_back against write_through per row (docs/results.md, "Checkpoints to the SSD at creation under
write_back"): p95 TTFT of each policy on each robustness row, median over seeds with the seed range, one panel
per run (plain scheduling, `+sched`). Reads the `summary.json` files `benchmark/robustness.py` writes;
replays nothing.

    .venv/bin/python benchmark/plot_write_back.py --runs "plain=out/robustness_wb_reclaim" \\
        "+sched=out/robustness_wb_reclaim_sched" --out docs/write_back_state.png

Policy names a run was written under before a rename are given as `--alias OLD=NEW` (the runs of the section
were written when `histate-writeback-via-host` was `histate-writeback-server`).
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True, metavar="LABEL=DIR")
    ap.add_argument("--alias", nargs="*", default=["histate-writeback-via-host=histate-writeback-server"],
                    metavar="NEW=OLD", help="a policy's name in runs written before a rename")
    ap.add_argument("--metric", default="ttft_p95_s")
    ap.add_argument("--out", type=Path, default=Path("docs/write_back_state.png"))
    args = ap.parse_args()
    aliases = dict(spec.split("=", 1) for spec in args.alias)
    runs = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not Path(path).is_dir():
            raise SystemExit(f"--runs {spec!r}: expected LABEL=DIR (benchmark/robustness.py --out DIR)")
        runs.append((label, Path(path)))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.2 * len(runs)), squeeze=False)
    for ax, (label, run_dir) in zip(axes[:, 0], runs):
        rows = sorted(p.name for p in run_dir.iterdir() if (p / "seed0" / "summary.json").is_file())
        width = 0.8 / len(LABELS)
        for k, policy in enumerate(LABELS):
            xs, ys, lo, hi = [], [], [], []
            for i, row in enumerate(rows):
                values = _seed_values(run_dir, row, policy, aliases, args.metric)
                if not values:
                    continue
                median = statistics.median(values)
                xs.append(i + width * (k - (len(LABELS) - 1) / 2))
                ys.append(median)
                lo.append(median - min(values))
                hi.append(max(values) - median)
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=1.5, label=LABELS[policy])
        ax.set_xticks(range(len(rows)), rows, fontsize=8)
        ax.set_ylabel(f"{args.metric} (s)")
        ax.set_title(f"{label}: median over seeds, bars the seed range (simulated)", fontsize=9)
        ax.set_yscale("log")
    axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
