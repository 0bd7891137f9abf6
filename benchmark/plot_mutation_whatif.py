"""Plot the mutation microbenchmark's what-ifs side by side (docs/results.md, "What the mutation gap is made
of"): HiState's median change of mutation-request TTFT against vllm-disk per what-if and rate, with its
seed range, the ceiling's (`unlimited`) change on the same run, and the issue's −21% target. Reads the
`summary.json` that `benchmark/mutation.py` writes; replays nothing.

    .venv/bin/python benchmark/plot_mutation_whatif.py --runs "none=out/mutation_whatif/passes" \\
        "price x1/4=out/mutation_whatif/k0.25" ... --out docs/mutation_whatif.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGET_CHANGE = -0.21


def _load(spec: str) -> tuple:
    label, sep, path = spec.partition("=")
    summary = Path(path) / "summary.json"
    if not sep or not summary.is_file():
        raise SystemExit(f"--runs {spec!r}: expected LABEL=DIR with DIR/summary.json (benchmark/mutation.py --out DIR)")
    return label, json.loads(summary.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True, metavar="LABEL=DIR")
    ap.add_argument("--policy", default="histate")
    ap.add_argument("--out", type=Path, default=Path("docs/mutation_whatif.png"))
    args = ap.parse_args()
    runs = [_load(spec) for spec in args.runs]
    rates = sorted({rate for _, s in runs for rate in s["rates"]}, key=float)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(runs) + 2), 3.8))
    width = 0.8 / len(rates)
    for k, rate in enumerate(rates):
        xs, ys, lo, hi, ceiling = [], [], [], [], []
        for i, (_, summary) in enumerate(runs):
            row = summary["rates"].get(rate, {})
            mine = row.get(args.policy)
            if mine is None or mine["change_median"] is None:
                continue
            xs.append(i + width * (k - (len(rates) - 1) / 2))
            ys.append(100 * mine["change_median"])
            lo.append(100 * (mine["change_median"] - mine["change_min"]))
            hi.append(100 * (mine["change_max"] - mine["change_median"]))
            ceiling.append(100 * row["unlimited"]["change_median"] if "unlimited" in row else float("nan"))
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=f"{args.policy}, {float(rate):.0%} mutations")
        ax.scatter(xs, ceiling, marker="_", s=200, color="black", zorder=3,
                   label="unlimited (ceiling), same run" if k == 0 else None)
    ax.axhline(100 * TARGET_CHANGE, color="red", linestyle="--", linewidth=1, label="target −21%")
    ax.set_xticks(range(len(runs)), [label for label, _ in runs], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("mutation-request mean TTFT\nchange vs vllm-disk (%)")
    ax.set_title("Mutation microbenchmark what-ifs (simulated; median over seeds, bars: seed range)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
