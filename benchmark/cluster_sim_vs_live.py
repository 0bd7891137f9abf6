"""Cluster sim vs live: the loopback fleet of `histate cluster` and the simulator's cluster mode on the
same sessions, placed on the same workers, with the same kill (issue 18: within 5 points before the
simulator extrapolates to 16 servers). How the twin is configured: histate/cluster/sim_twin.py.

    .venv/bin/python benchmark/cluster_sim_vs_live.py                      # ~35 s live + ~1 s simulated
    .venv/bin/python benchmark/cluster_sim_vs_live.py --reuse out/cluster  # an existing histate cluster out dir

Writes OUT/live/ (the `histate cluster` out dir, unless --reuse), OUT/table.md and OUT/compare.json,
and prints the table. Every simulator number is labelled "simulated".
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from histate.cluster.workload import cluster_workload
from histate.cluster.sim_twin import (MiB, TwinOptions, compare, format_table, max_gap_points,
                                      read_live)


def run_live(args, out_dir: Path) -> None:
    cmd = [sys.executable, "-m", "histate.cli", "cluster", "--workers", str(args.workers), "--sessions", str(args.sessions),
           "--turns", str(args.turns), "--max-live-sessions", str(args.max_live_sessions or args.sessions), *(["--kill-worker", str(args.kill_worker)]
           if args.kill_worker is not None else []), "--kill-after", str(args.kill_after), "--l3-mib", str(args.l3_mib), "--seed",
           str(args.seed), "--out", str(out_dir), "--no-progress"]
    subprocess.run(cmd, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-live-sessions", type=int, default=None, help="default: all sessions (histate cluster's)")
    ap.add_argument("--kill-worker", type=int, default=None, help="default: histate cluster's (the busiest at the kill)")
    ap.add_argument("--kill-after", type=float, default=0.5)
    ap.add_argument("--l3-mib", type=float, default=512.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-overhead-ms", type=float, default=None,
                    help="simulated time per forward pass (default: fitted to the live l3 run's duration, sim_twin.py)")
    ap.add_argument("--reuse", type=Path, help="a `histate cluster` out dir run with these same workload flags")
    ap.add_argument("--out", type=Path, default=Path("out/cluster_sim_vs_live"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    live_dir = args.reuse or args.out / "live"
    if args.reuse is None:
        run_live(args, live_dir)
    workload = cluster_workload(args.sessions, args.turns, args.seed)   # the CLI's own builder, same seed
    options = TwinOptions(max_live_sessions=args.max_live_sessions or args.sessions, seed=args.seed,
                          l3_segment_bytes=int(args.l3_mib * MiB), step_overhead_s=None if args.step_overhead_ms is None else args.step_overhead_ms / 1e3)
    table = compare(workload, read_live(live_dir), options)
    text = format_table(table)
    gaps = max_gap_points(table)
    text += "\n\nlargest |simulated - live| (cluster hit rate, moved next-request hit rate): " + ", ".join(
        f"{name} {gap:.1f} points" for name, gap in gaps.items())
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "compare.json").write_text(json.dumps({"live_dir": str(live_dir), "table": table, "max_gap_points": gaps},
                                                      indent=1, default=str))
    print(f"wrote {args.out}/table.md, compare.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
