"""Paper §4.2 on the Weka Claude-Code sessions (../shared/traces/cc-traces-weka-042026), paper preset:
Qwen3.5-9B, one H100, 45 GiB GPU pool, 96 GiB CPU, 150 GiB SSD, 24 live sessions, 125 sessions
admitted in a seeded random order (the paper's 125-session Weka workload), think/tool gaps capped at
60 s so that the replay lasts ~2.5 h of simulated time (the paper sized its workload for ~3 h; with
the trace's own gaps, up to 40 min, the same 125 sessions take 26 h and the GPU is mostly idle).
`--max-gap 0` replays the trace's own timing. Skips cleanly without the trace. Prints the comparison table and writes summary.json, requests.csv and plots to --out.

    .venv/bin/python benchmark/paper_weka.py [--max-sessions 125] [--out out/paper_weka]
"""
from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

from histate.core import available_policies
from histate.sim.replay import ReplayConfig, replay_policies
from histate.sim.report import build_summary, format_table, write_outputs
from histate.sim.traces import LoadOptions, load_weka

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "cc-traces-weka-042026" / "traces.jsonl.gz"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--max-sessions", type=int, default=125, help="0 = every session")
    ap.add_argument("--policies", default=",".join(available_policies()))
    ap.add_argument("--seed", type=int, default=0)
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
    config = ReplayConfig(max_sessions=args.max_sessions or None, seed=args.seed)
    runs = replay_policies(workload, args.policies.split(","), config)
    summary = build_summary(runs)
    print(format_table(summary))
    for name, run in runs.items():
        n = len(run.records)
        print(f"  {name}: {n} requests in {run.wall_s:.1f} s ({n / run.wall_s:,.0f} req/s)")
    print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    span_h = max(r.completion_s for r in next(iter(runs.values())).records) / 3600
    print(f"simulated replay duration {span_h:.1f} h; gaps capped at {args.max_gap or 'no'} s")
    write_outputs(runs, summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
