"""Faithful engines against the idealised model: the tables and the plot of docs/results.md,
"Faithful engines", from `histate replay` outputs (one `seed*/summary.json` per seed and model).

    histate replay --trace T --preset paper-native --seed S --out DIR/seedS     # S = 0, 1, 2, per model
    .venv/bin/python benchmark/engine_fidelity.py --faithful DIR_F --idealised DIR_I \
        --plot docs/engine_fidelity.png

Prints, per policy, the median [min, max] over seeds of the token hit rate and the TTFT percentiles
(p99 over all requests and over non-first requests of a session, side by side), the speedups of
histate over each policy, and the memory-pressure counters of the faithful engines (admissions that
waited, preemptions). Reads files only; the replays are the commands above.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

COLUMNS = (("token_hit_rate", "hit rate", "{:.1%}"), ("ttft_p50_s", "p50 s", "{:.3f}"),
           ("ttft_p95_s", "p95 s", "{:.2f}"), ("ttft_p99_s", "p99 s", "{:.2f}"),
           ("ttft_p99_non_first_s", "p99 non-first s", "{:.2f}"), ("ttft_mean_s", "mean s", "{:.3f}"))


def load(directory: Path, seeds=None) -> list:
    paths = sorted(directory.glob("seed*/summary.json")) if seeds is None else \
        [directory / f"seed{seed}" / "summary.json" for seed in seeds]
    if not paths:
        raise SystemExit(f"{directory}: no seed*/summary.json (run `histate replay --out {directory}/seedS` first)")
    return [json.loads(p.read_text()) for p in paths]


def over_seeds(summaries: list, policy: str, key: str) -> tuple:
    values = sorted(s["policies"][policy][key] for s in summaries if key in s["policies"].get(policy, {}))
    return (statistics.median(values), values[0], values[-1]) if values else (float("nan"),) * 3


def cell(summaries: list, policy: str, key: str, fmt: str, ranges: bool) -> str:
    med, lo, hi = over_seeds(summaries, policy, key)
    text = fmt.format(med)
    return f"{text} [{fmt.format(lo)}, {fmt.format(hi)}]" if ranges and len(summaries) > 1 else text


def table(summaries: list, title: str, counters: bool) -> str:
    policies = list(summaries[0]["policies"])
    ratios = all("histate" in s["policies"] for s in summaries)
    head = ["policy"] + [label for _, label, _ in COLUMNS] + (["p95 / histate", "p99 / histate"] if ratios else [])
    if counters:
        head += ["admissions deferred", "preemptions"]
    lines = [f"{title} ({len(summaries)} seeds: median [min, max])", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in policies:
        row = [f"`{name}`"] + [cell(summaries, name, key, fmt, key in ("ttft_p95_s", "ttft_p99_s"))
                               for key, _, fmt in COLUMNS]
        for key in ("ttft_p95_s", "ttft_p99_s") if ratios else ():
            values = sorted(s["policies"][name][key] / s["policies"]["histate"][key] for s in summaries)
            row.append(f"{statistics.median(values):.2f}×")
        if counters:
            row += [f"{over_seeds(summaries, name, k)[0]:,.0f}" for k in ("admissions_deferred", "preemptions")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(faithful: list, idealised: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    policies = list(faithful[0]["policies"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    width = 0.38
    for ax, key, label in ((axes[0], "ttft_p95_s", "TTFT p95"), (axes[1], "ttft_p99_s", "TTFT p99")):
        for offset, runs, name in ((-width / 2, idealised, "idealised (previous model)"),
                                   (width / 2, faithful, "faithful engines")):
            stats = [over_seeds(runs, p, key) for p in policies]
            xs = [i + offset for i in range(len(policies))]
            meds = [m for m, _, _ in stats]
            ax.bar(xs, meds, width, label=name)
            ax.errorbar(xs, meds, yerr=[[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]],
                        fmt="none", ecolor="black", lw=0.8, capsize=2)
        ax.set_yscale("log")
        ax.set_xticks(range(len(policies)))
        ax.set_xticklabels(policies, rotation=45, ha="right", fontsize=8)
        ax.set_title(f"{label} (s), median over seeds, min-max bars")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faithful", type=Path, required=True, help="directory of seed*/summary.json (faithful engines)")
    ap.add_argument("--idealised", type=Path, help="the same for the previous (idealised) model")
    ap.add_argument("--plot", type=Path, help="PNG of p95/p99 per policy, idealised vs faithful")
    args = ap.parse_args()
    faithful = load(args.faithful)
    print(table(faithful, "Faithful engines", counters=True))
    if args.idealised:
        idealised = load(args.idealised)
        print()
        print(table(idealised, "Idealised model", counters=False))
        if args.plot:
            plot(faithful, idealised, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
