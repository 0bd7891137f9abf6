"""`histate cluster`: a loopback fleet (Mooncake L3, workers, sglang-router), its failover runs or,
with --faults, every L3 fault scenario."""
from __future__ import annotations

import sys


def cluster_command(args) -> int:
    from histate.cluster.run import ClusterOptions, cold_output_digests, format_report, run_cluster, summarize, write_report
    from histate.cluster.workload import cluster_workload
    from histate.l3.services import unavailable_reason

    if args.router_policy == "cache_aware":
        from histate.cluster.policies import CACHE_AWARE_REFUSAL

        print(f"histate cluster: error: --router-policy cache_aware: {CACHE_AWARE_REFUSAL}", file=sys.stderr)
        return 2
    try:
        options = ClusterOptions(num_workers=args.workers, kill_worker=args.kill_worker, router_policy=args.router_policy,
                                 kill_after_fraction=args.kill_after,
                                 max_live_sessions=args.max_live_sessions or args.sessions,
                                 seed=args.seed, l3_segment_bytes=int(args.l3_mib * 2**20),
                                 progress=not args.no_progress)
    except ValueError as err:
        print(f"histate cluster: error: {err}", file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason:
        print(f"histate cluster: error: {reason}", file=sys.stderr)
        return 2
    from histate.cluster.router import router_executable

    if router_executable() is None:
        print("histate cluster: error: sglang-router is not installed (make venv installs it)", file=sys.stderr)
        return 2
    if args.faults:
        return _cluster_faults(args)
    workload = cluster_workload(args.sessions, args.turns, args.seed)
    runs = run_cluster(workload, options, args.out / "logs")
    summary = summarize(runs, cold_output_digests(workload, args.seed))
    write_report(summary, runs, args.out)
    print(format_report(summary))
    print(f"wrote {args.out}/report.md, summary.json, requests.csv")
    return 0


def _cluster_faults(args) -> int:
    """`histate cluster --faults`: one line per scenario; exit 1 when any answer was wrong, a fault did
    not fire, or a request stalled past the bound."""
    from histate.cluster.faults import STALL_BOUND_S, FaultOptions, fired_count, format_line, run_faults

    results = run_faults(FaultOptions(num_workers=args.workers, sessions=args.sessions, turns=args.turns,
                                      seed=args.seed, progress=not args.no_progress), args.out / "fault-logs")
    failed = False
    for r in results:
        print(format_line(r))
        fired = fired_count(r)
        failed |= r.wrong > 0 or (fired is not None and fired <= 0) or r.max_ttft_s >= STALL_BOUND_S
    print(f"stall bound {STALL_BOUND_S:g} s; " + ("FAILED" if failed else "every fault a miss, 0 wrong answers"))
    return 1 if failed else 0
