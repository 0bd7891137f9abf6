"""Issue 31, item 3 (simulated): what a checkpoint at the end of the stable prefix gives new sessions.

Two ways to get one (docs/hints.md): the application names it (`--checkpoint-hints system-prompt`: each
request of the synthetic agent workload names its shared system prompt's end, as a client using the
server's `custom_params.histate_checkpoints` would), or HiState finds it (the stable-prefix detector:
the observed branch point where a request leaves the cached path, and the depth prior that learns where
far interior hits land; `histate-no-detector` is HiState without both). The measure is the share of a
new session's first-turn input served from cache (`requests.csv` `reused_tokens` over `input_tokens` for
`session_index` 0), with the overall hit rate and p95/p99 beside it, on the robustness table's
`synthetic` row (a 4,096-token system prompt shared by every session; `synthetic-4992` the same workload with
a 4,992-token one) and on the Weka `base` row
(conversations as they are: their page ids are scoped per conversation, so first turns share nothing).
Seeds paired; medians over seeds. Writes table.md, results.json and stable_prefix.png under --out.

    .venv/bin/python benchmark/stable_prefix.py [--seeds 0 1 2] [--rows synthetic synthetic-4992 base] [--out out/stable_prefix]
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

from robustness import TRACE, replay_argv

POLICIES = ("histate", "histate-no-detector", "unlimited", "vllm-disk")
HINTS = {"synthetic": ("off", "system-prompt"), "synthetic-4992": ("off", "system-prompt"),
         "base": ("off",)}  # traces carry no application positions
# A 4,096-token system prompt ends on eq. 5's power-of-two grid, so it gets a state with or without a
# detector; 4,992 tokens (SGLang #37198's shared length) does not.
ROW_ARGS = {"synthetic-4992": ("synthetic", ["--system-prompt-tokens", "4992"])}


def run(row: str, seed: int, hints: str, out: Path) -> Path:
    """One replay of every policy (resumable: a finished run is read back, not replayed)."""
    if not (out / "requests.csv").exists():
        base_row, extra = ROW_ARGS.get(row, (row, []))
        extra = extra + ([] if hints == "off" else ["--checkpoint-hints", hints])
        argv = [sys.executable, "-m", "histate.cli", *replay_argv(base_row, seed, extra),
                "--policies", ",".join(POLICIES), "--out", str(out)]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{row} seed {seed} hints {hints}: {done.stderr[-2000:]}")
    return out


def measure(out: Path) -> dict:
    """policy -> {first_turn_reuse, hit_rate, p95, p99} of one replay."""
    totals: dict = {}
    with open(out / "requests.csv") as f:
        for r in csv.DictReader(f):
            t = totals.setdefault(r["policy"], [0, 0, 0, 0])
            t[0] += int(r["input_tokens"])
            t[1] += int(r["reused_tokens"])
            if r["session_index"] == "0":
                t[2] += int(r["input_tokens"])
                t[3] += int(r["reused_tokens"])
    summary = json.loads((out / "summary.json").read_text())["policies"]
    return {p: {"first_turn_reuse": t[3] / t[2], "hit_rate": t[1] / t[0], "p95": summary[p]["ttft_p95_s"],
                "p99": summary[p]["ttft_p99_s"]} for p, t in totals.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=list(HINTS), choices=list(HINTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path("out/stable_prefix"))
    a = ap.parse_args()
    if "base" in a.rows and not TRACE.exists():
        print(f"skipping base: {TRACE} not found", file=sys.stderr)
        a.rows = [r for r in a.rows if r != "base"]
    results: dict = {}
    cells = [(row, hints, seed) for row in a.rows for hints in HINTS[row] for seed in a.seeds]
    for k, (row, hints, seed) in enumerate(cells, 1):
        print(f"[{k}/{len(cells)}] {row} hints={hints} seed {seed}", file=sys.stderr, flush=True)
        measured = measure(run(row, seed, hints, a.out / row / f"hints-{hints}" / f"seed{seed}"))
        for policy, metrics in measured.items():
            results.setdefault(f"{row}|{hints}|{policy}", []).append(metrics)
    lines = ["Simulated. Medians over seeds " + " ".join(map(str, a.seeds)) + " [min, max]; first-turn reuse = "
             "share of new sessions' first-turn input served from cache.", "",
             "| row | hints | policy | first-turn reuse | hit rate | p95 s | p99 s |", "|---|---|---|---:|---:|---:|---:|"]
    table: dict = {}
    for key, runs in results.items():
        row, hints, policy = key.split("|")
        cell = {m: (statistics.median(r[m] for r in runs), min(r[m] for r in runs), max(r[m] for r in runs))
                for m in runs[0]}
        table[key] = cell
        f = cell["first_turn_reuse"]
        lines.append(f"| {row} | {hints} | {policy} | {100 * f[0]:.2f}% [{100 * f[1]:.2f}, {100 * f[2]:.2f}] | "
                     f"{100 * cell['hit_rate'][0]:.2f}% | {cell['p95'][0]:.2f} | {cell['p99'][0]:.2f} |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    (a.out / "results.json").write_text(json.dumps({"seeds": a.seeds, "runs": results, "medians": table}, indent=1))
    print("\n".join(lines))
    _plot(table, a.out / "stable_prefix.png")
    return 0


def _plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({tuple(k.split("|")[:2]) for k in table})
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        xs, ys, lo, hi = [], [], [], []
        for g, (row, hints) in enumerate(groups):
            cell = table.get(f"{row}|{hints}|{policy}")
            if cell is None:
                continue
            med, mn, mx = (100 * v for v in cell["first_turn_reuse"])
            xs.append(g + (i - (len(POLICIES) - 1) / 2) * width)
            ys.append(med)
            lo.append(med - mn)
            hi.append(mx - med)
        ax.bar(xs, ys, width, yerr=[lo, hi], label=policy, capsize=2)
    ax.set_xticks(range(len(groups)), [f"{row}\nhints {hints}" for row, hints in groups])
    ax.set_ylabel("first-turn input served from cache (%)")
    ax.set_title("First turns of new sessions (simulated; median, min-max over seeds)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
