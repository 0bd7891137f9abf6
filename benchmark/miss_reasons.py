"""Why input tokens missed, per policy, on the robustness table's Weka rows (simulated; docs/misses.md).

For each (row, seed), one `histate replay` (benchmark/robustness.py's rows: the paper-native base and the
rows where memory is short) over the policies below; the table gives, per row and policy, the median over
seeds of each reason's share of all input tokens (`miss_tokens_by_reason` in summary.json), and the plot
stacks them. Every number is simulated (the simulator's H100 model of Qwen3.5-9B; no GPU ran).

    .venv/bin/python benchmark/miss_reasons.py [--rows base gpu30 cpu48 ssd75] [--seeds 0 1 2] [--jobs 2]
        [--out out/miss_reasons]   # writes table.md, results.json and miss_reasons.png there
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import robustness  # noqa: E402  (the rows, the trace path and the resumable runner)

from histate.core import MISS_REASONS  # noqa: E402

POLICIES = ("histate", "vllm-disk", "sglang-hicache", "sglang-tuned", "unlimited")


def shares(summary: dict, policy: str) -> dict:
    s = summary["policies"][policy]
    return {reason: s["miss_tokens_by_reason"][reason] / s["input_tokens"] for reason in MISS_REASONS}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=["base", "gpu30", "cpu48", "ssd75"], choices=list(robustness.ROWS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("out/miss_reasons"))
    args = parser.parse_args(argv)
    if not robustness.TRACE.exists():
        print(f"miss_reasons: {robustness.TRACE} not found (the Weka rows need ../shared)", file=sys.stderr)
        return 2
    jobs = [(row, seed) for row in args.rows for seed in args.seeds]
    done = 0

    def run(job):
        nonlocal done
        summary = robustness.run_one(*job, list(POLICIES), args.out, [])
        done += 1
        print(f"  [{done}/{len(jobs)}] {job[0]} seed {job[1]}", flush=True)
        return job, summary

    with ThreadPoolExecutor(args.jobs) as pool:
        summaries = dict(pool.map(run, jobs))
    table = {row: {p: {r: statistics.median(shares(summaries[(row, s)], p)[r] for s in args.seeds)
                       for r in MISS_REASONS} for p in POLICIES} for row in args.rows}
    lines = [f"Median over seeds {args.seeds} of each reason's share of all input tokens (simulated).", "",
             "| row | policy | uncached | " + " | ".join(MISS_REASONS) + " |",
             "|---|---|---:|" + "---:|" * len(MISS_REASONS)]
    for row, per_policy in table.items():
        for policy, by_reason in per_policy.items():
            lines.append(f"| {row} | {policy} | {100 * sum(by_reason.values()):.2f}% | "
                         + " | ".join(f"{100 * by_reason[r]:.2f}%" for r in MISS_REASONS) + " |")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps({"seeds": args.seeds, "table": table}, indent=1) + "\n")
    _plot(table, args.out / "miss_reasons.png")
    print(f"wrote {args.out}/table.md, results.json, miss_reasons.png")
    return 0


def _plot(table: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from histate.sim.report import stack_miss_reasons

    rows = list(table)
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 4.2), sharey=True)
    for ax, row in zip(axes if len(rows) > 1 else [axes], rows):
        stack_miss_reasons(ax, {p: {r: 100 * table[row][p][r] for r in MISS_REASONS} for p in POLICIES})
        ax.set_title(row, fontsize=9)
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    (axes[0] if len(rows) > 1 else axes).set_ylabel("% of input tokens not served from cache")
    (axes[-1] if len(rows) > 1 else axes).legend(fontsize=6)
    fig.suptitle("Why input tokens missed (Weka sessions, paper-native preset; simulated, median over seeds)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
