"""How sglang-router's policies place agent sessions: sessions per worker and the hit rate that results.

`python -m histate.cluster.policies`: two `histate serve` workers (no L3), the same synthetic agent
workload through sglang-router once per policy, reporting per policy how many root sessions each
worker served, how many sessions were split over workers, and the hit rate.

Why `cache_aware` is refused for HiState (`histate cluster` runs `manual`): the policy matches the
request's *text* against an approximate radix tree per worker
(sgl-model-gateway/src/policies/cache_aware.rs, `CacheAwarePolicy::select_worker`:
`let text = request_text.unwrap_or("")`, match rate 0.0 for empty text). `/generate` requests with
`input_ids` -- what `histate bench`, and SGLang clients sending token ids, send -- carry no text, so
every match rate is 0 <= `--cache-threshold`, and the pick falls to the load/tree-size tie-break,
which with equal loads is the same worker every time; load balancing only starts once
`max_load - min_load > --balance-abs-threshold` (default 64 requests in flight) and
`max_load > min_load * --balance-rel-threshold` (1.5). Lowering the thresholds turns it into
shortest-queue routing, which spreads load but, with no text to match, keeps no session on its
worker: no setting gives both.
"""
from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict
from pathlib import Path

POLICIES = ("manual", "round_robin", "cache_aware")
CACHE_AWARE_REFUSAL = ("sglang-router cache_aware matches request text, and /generate with input_ids has none: "
                       "every session goes to one worker (docs/scaleout.md, 'Router policies')")


def measure(policy: str, sessions: int = 6, turns: int = 3, seed: int = 0) -> dict:
    from histate.bench.run import BenchOptions, run_bench
    from .workload import cluster_workload
    from histate.cluster.router import Router
    from histate.cluster.run import root_ids
    from histate.cluster.workers import WorkerPool
    from histate.sim.replay import ReplayConfig

    workload = cluster_workload(sessions, turns, seed)
    roots = root_ids(workload)
    base = Path(tempfile.mkdtemp(prefix=f"histate-policy-{policy}-"))
    with WorkerPool(2, base_dir=base) as pool, Router(pool.urls, policy=policy, log_dir=base) as router:
        result = run_bench(workload, BenchOptions(router.url, progress=False, request_timeout_s=120,
                                                  admission=ReplayConfig(max_live_sessions=sessions, seed=seed)))
    records = result.run.records
    workers_of = defaultdict(set)
    per_worker = defaultdict(set)
    for r in records:
        workers_of[roots[r.session_id]].add(r.server)
        per_worker[r.server].add(roots[r.session_id])
    later = [r for r in records if r.session_index > 0]
    return {"policy": policy, "requests": len(records),
            "sessions_per_worker": sorted(len(s) for s in per_worker.values()),
            "split_sessions": sum(len(w) > 1 for w in workers_of.values()),
            "hit_rate": sum(r.reused_tokens for r in records) / sum(r.input_tokens for r in records),
            "later_turns_hit_rate": sum(r.reused_tokens for r in later) / max(1, sum(r.input_tokens for r in later))}


def main() -> int:  # pragma: no cover - manual measurement
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for policy in POLICIES:
        m = measure(policy, args.sessions, args.turns, args.seed)
        print(f"{policy:<12} requests {m['requests']}  root sessions per worker {m['sessions_per_worker']}  "
              f"split over workers {m['split_sessions']}  hit rate {m['hit_rate']:.1%}  "
              f"later turns {m['later_turns_hit_rate']:.1%}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
