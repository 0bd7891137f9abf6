"""Paper §4.2 on the Weka Claude-Code sessions (../shared/traces/cc-traces-weka-042026), paper preset:
Qwen3.5-9B, one H100, 45 GiB GPU pool, 96 GiB CPU, 150 GiB SSD, 24 live sessions, 125 sessions
admitted in a seeded random order (the paper's 125-session Weka workload), think/tool gaps capped at
60 s so that the replay lasts ~2.5 h of simulated time (the paper sized its workload for ~3 h; with
the trace's own gaps, up to 40 min, the same 125 sessions take 26 h and the GPU is mostly idle).
`--max-gap 0` replays the trace's own timing. Skips cleanly without the trace. Prints the comparison table and writes summary.json, requests.csv and plots to --out.

    .venv/bin/python benchmark/paper_weka.py [--seeds 0 1 2] [--max-gap 60] [--out out/paper_weka]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
from pathlib import Path

from histate.core import available_policies
from histate.sim.replay import ReplayConfig, replay_policies
from histate.sim.report import build_summary, format_table, write_outputs

METRICS = ("token_hit_rate", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "ttft_mean_s", "cohort_recovered_fraction")
from histate.sim.traces import LoadOptions, load_weka

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "cc-traces-weka-042026" / "traces.jsonl.gz"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--max-sessions", type=int, default=125, help="0 = every session")
    ap.add_argument("--policies", default=",".join(available_policies()))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="admission-order seeds; with several, medians and ranges over seeds are printed too")
    ap.add_argument("--max-gap", type=float, default=60.0, help="cap on think/tool gaps, s (0 = none)")
    ap.add_argument("--out", type=Path, default=Path("out/paper_weka"))
    args = ap.parse_args()
    if not args.trace.exists():
        print(f"SKIP: {args.trace} not found (the Weka trace lives in ../shared, which this checkout lacks)")
        return 0
    workload = load_weka(args.trace, LoadOptions(progress=True, max_gap_s=args.max_gap or None))
    s = workload.stats
    print(f"{workload.name}: {s.sessions} sessions, {s.requests} requests kept "
          f"({s.requests_over_context} dropped by the 131072-token max context)")
    per_seed = []
    for seed in args.seeds:
        config = ReplayConfig(max_sessions=args.max_sessions or None, seed=seed)
        runs = replay_policies(workload, args.policies.split(","), config)
        summary = build_summary(runs)
        per_seed.append(summary)
        print(f"\n== seed {seed}")
        print(format_table(summary))
        for name, run in runs.items():
            n = len(run.records)
            print(f"  {name}: {n} requests in {run.wall_s:.1f} s ({n / run.wall_s:,.0f} req/s)")
        span_h = max(r.completion_s for r in next(iter(runs.values())).records) / 3600
        print(f"simulated replay duration {span_h:.1f} h; gaps capped at {args.max_gap or 'no'} s")
        write_outputs(runs, summary, args.out / f"seed{seed}")
    if len(per_seed) > 1:
        print_over_seeds(per_seed)
    print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    return 0


def print_over_seeds(per_seed: list) -> None:
    """Median [min, max] over seeds of each metric, and of the speedups vs vllm-marconi."""
    print(f"\n== over {len(per_seed)} seeds: median [min, max]")
    names = list(per_seed[0]["policies"])
    for name in names:
        cells = []
        for metric in METRICS + ("p95_x", "p99_x"):
            if metric.endswith("_x"):
                key = "ttft_p95_s" if metric == "p95_x" else "ttft_p99_s"
                vals = sorted(s["speedup_vs_vllm-marconi"][name][key] for s in per_seed)
            else:
                vals = sorted(s["policies"][name][metric] for s in per_seed)
            cells.append(f"{metric} {statistics.median(vals):.3f} [{vals[0]:.3f}, {vals[-1]:.3f}]")
        print(f"{name:<17} " + "  ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
