"""Issue 17's capacity column (simulated): concurrent agent sessions one GPU sustains at p95 TTFT <= 2 s
and p99 <= 5 s, per policy, on the rows of the robustness table.

For each (row, seed) the workload is loaded once and every policy's live-session limit is searched
(`histate.sim.capacity.find_capacity`: geometric growth from --start, then bisection). A policy name
with the suffix `+sched` runs with --sched-args: by default each engine's own way of sharing a step
with a long prefill, SGLang's short-prefill-first cap with aging (`--short-prefill-first`, the
plugin's `--histate-short-prefill-first`) and vLLM's `--long-prefill-token-threshold`; each reaches
only the policies its engine serves (sim/admission.py). Every probe is appended to probes.jsonl, so an
interrupted run resumes where it stopped. Writes table.md, results.json and capacity.png (p95 TTFT
against live sessions, one panel per row, seed 0) under --out. All numbers are simulated.

    .venv/bin/python benchmark/capacity.py [--rows base gpu30 ...] [--seeds 0 1] [--policies ...] [--jobs 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from robustness import ROWS, TRACE, replay_argv

from histate.sim.capacity import DEFAULT_TARGETS, find_capacity

P95_ONLY = {"ttft_p95_s": DEFAULT_TARGETS["ttft_p95_s"]}
POLICIES = ("histate", "histate+sched", "unlimited", "unlimited+sched", "vllm-disk", "vllm-disk+sched",
            "sglang-hicache")
SCHED = "+sched"
SCHED_ARGS = "--short-prefill-first 4 --long-prefill-token-threshold 4096"


def load_probes(path: Path) -> dict:
    """(row, seed, policy) -> {limit: metrics} from earlier runs."""
    known: dict = {}
    if path.exists():
        for line in path.read_text().splitlines():
            p = json.loads(line)
            known.setdefault((p["row"], p["seed"], p["policy"]), {})[p["limit"]] = p["metrics"]
    return known


def search_row(row: str, seed: int, policies: list, known: dict, probes_path: str, start: int, sched_args: str) -> dict:
    """Every policy's capacity on one (row, seed); runs in a worker process."""
    from histate.cli.parser import build_parser
    from histate.cli.plan import build_config, plan_replay, resolve_workload_settings
    from histate.sim.metrics import summarize
    from histate.sim.replay import replay_policies

    args = build_parser().parse_args(replay_argv(row, seed))
    _, workload, config, admitted, _ = plan_replay(args)
    ceiling = len(admitted)  # beyond every session at once a higher limit changes nothing
    sched = build_parser().parse_args(replay_argv(row, seed) + sched_args.split())
    sched_config = build_config(sched, resolve_workload_settings(sched, sched.model), workload.page_num_tokens)
    out = {}
    for spec in policies:
        name = spec.removesuffix(SCHED)
        base = sched_config if spec.endswith(SCHED) else config

        def measure(limit: int) -> dict:
            run = replay_policies(workload, [name], replace(base, max_live_sessions=limit), progress=False)[name]
            s = summarize(run)
            metrics = {k: s[k] for k in ("ttft_p95_s", "ttft_p99_s", "ttft_mean_s", "token_hit_rate")}
            with open(probes_path, "a") as f:
                f.write(json.dumps({"row": row, "seed": seed, "policy": spec, "limit": limit, "metrics": metrics}) + "\n")
            return metrics

        both = find_capacity(measure, DEFAULT_TARGETS, start=min(start, ceiling), max_sessions=ceiling,
                             known=known.get((row, seed, spec)))
        p95 = find_capacity(measure, P95_ONLY, start=min(start, ceiling), max_sessions=ceiling, known=both.probes)
        out[spec] = {"capacity": both.capacity, "capped": both.capped, "non_monotone": both.non_monotone(DEFAULT_TARGETS),
                     "capacity_p95": p95.capacity, "capped_p95": p95.capped,
                     "non_monotone_p95": p95.non_monotone(P95_ONLY),
                     "probes": {str(k): v for k, v in sorted(p95.probes.items())}}
        print(f"{row} seed {seed} {spec}: {both.capacity} sessions (p95 alone: {p95.capacity})", flush=True)
    return out


def markdown(results: dict, seeds: list, policies: list, sched_args: str) -> str:
    lines = [f"Simulated. Live sessions one GPU sustains; median over seeds {seeds} [min, max]; `+sched`: "
             f"with each engine's step-sharing option (`{sched_args}`); `*`: a probe below the capacity failed "
             "(latency not monotone in load); `+`: every session of the workload at once passes (the capacity is at "
             "least that)."]
    for key, what in (("capacity", f"p95 TTFT <= {DEFAULT_TARGETS['ttft_p95_s']:g} s and p99 <= "
                                   f"{DEFAULT_TARGETS['ttft_p99_s']:g} s"),
                      ("capacity_p95", f"p95 TTFT <= {DEFAULT_TARGETS['ttft_p95_s']:g} s alone")):
        suffix = key.removeprefix("capacity")
        lines += ["", f"**{what}**", "", "| row | " + " | ".join(policies) + " |", "|---|" + "---:|" * len(policies)]
        for row, per_seed in results.items():
            cells = []
            for p in policies:
                caps = sorted(per_seed[s][p][key] for s in per_seed)
                flag = "*" if any(per_seed[s][p]["non_monotone" + suffix] for s in per_seed) else ""
                flag += "+" if any(per_seed[s][p]["capped" + suffix] for s in per_seed) else ""
                cells.append(f"{statistics.median(caps):g} [{caps[0]}, {caps[-1]}]{flag}")
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, policies: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from histate.sim.report import line_styles

    rows = list(results)
    cols = min(3, len(rows))
    fig, axes = plt.subplots((len(rows) + cols - 1) // cols, cols, figsize=(5 * cols, 3.6 * ((len(rows) + cols - 1) // cols)),
                             squeeze=False)
    styles = line_styles(policies)
    for ax, row in zip(axes.flat, rows):
        seed = min(results[row])
        for p in policies:
            probes = results[row][seed][p]["probes"]
            xs = sorted(int(k) for k in probes)
            colour, linestyle = styles[p]
            ax.plot(xs, [probes[str(x)]["ttft_p95_s"] for x in xs], label=p, marker=".", color=colour, ls=linestyle)
        ax.axhline(DEFAULT_TARGETS["ttft_p95_s"], color="grey", lw=0.8, ls=":")
        ax.set_title(f"{row} (seed {seed})", fontsize=9)
        ax.set_xlabel("live sessions")
        ax.set_ylabel("p95 TTFT (s)")
        ax.set_ylim(0, 3 * DEFAULT_TARGETS["ttft_p95_s"])
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Simulated p95 TTFT against live sessions (dotted: the 2 s target)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--start", type=int, default=20, help="first live-session limit probed (20)")
    ap.add_argument("--sched-args", default=SCHED_ARGS, help=f"replay flags of the +sched policies ({SCHED_ARGS!r})")
    ap.add_argument("--out", type=Path, default=Path("out/capacity"))
    a = ap.parse_args()
    rows = [r for r in a.rows if not ROWS[r][1] or TRACE.exists()]
    if len(rows) < len(a.rows):
        print(f"skipping {sorted(set(a.rows) - set(rows))}: {TRACE} not found", file=sys.stderr)
    a.out.mkdir(parents=True, exist_ok=True)
    probes_path = a.out / "probes.jsonl"
    known = load_probes(probes_path)
    results: dict = {r: {} for r in rows}
    with ProcessPoolExecutor(a.jobs) as pool:
        futures = {(r, s): pool.submit(search_row, r, s, a.policies, known, str(probes_path), a.start, a.sched_args)
                   for r in rows for s in a.seeds}
        for (r, s), fut in futures.items():
            results[r][s] = fut.result()
    (a.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results, a.seeds, a.policies, a.sched_args)
    (a.out / "table.md").write_text(table)
    plot(results, a.policies, a.out / "capacity.png")
    print(table)
    print(f"wrote {a.out}/table.md, results.json, capacity.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
