"""Speed of the simulator's substrate: trace loading, synthetic generation, engine replay.

    .venv/bin/python benchmark/sim_substrate.py [--weka ../shared/traces/cc-traces-weka-042026/traces.jsonl.gz]

Engine replay uses a stand-in for the cache (no histate.core): every session (subagents included,
treated as independent sessions) reuses the longest prefix it has itself inserted before, restored
from CPU, plus one checkpoint from SSD. 24 sessions are live at a time; a new one starts when one
ends (the paper's admission rule). This isolates the engine's cost per request; the replay driver
with a real cache adds the core's cost on top. Times are thread CPU seconds, median of --repeats.
"""
from __future__ import annotations

import argparse
import heapq
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

from histate.sim.costs import CPU_TIER, H100_SXM, QWEN35_9B, SSD_TIER  # noqa: E402
from histate.sim.engine import Engine, EngineConfig, EngineRequest, EventKind  # noqa: E402
from histate.sim.traces import LoadOptions, load_weka  # noqa: E402
from histate.sim.workloads import default_workload, mutation_microbenchmark  # noqa: E402

DEFAULT_WEKA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces", "cc-traces-weka-042026",
                            "traces.jsonl.gz")


def timed(fn, repeats):
    times, result = [], None
    for _ in range(repeats):
        start = time.thread_time()
        result = fn()
        times.append(time.thread_time() - start)
    return statistics.median(times), result


def replay(workload, live_sessions=24, seed=0):
    """Closed-loop replay through the engine with a per-session 'everything I inserted' cache."""
    engine = Engine(QWEN35_9B, H100_SXM, EngineConfig())
    sessions = list(workload.iter_sessions())
    random.Random(seed).shuffle(sessions)
    arrivals, seq, progress, inserted, by_uid = [], 0, {}, {}, {}

    def start(session, t):
        nonlocal seq
        progress[session.session_id] = [session, 0]
        seq += 1
        heapq.heappush(arrivals, (t + session.requests[0].gap_before_s, seq, session.requests[0]))

    live = 0
    while live < live_sessions and sessions:
        start(sessions.pop(), 0.0)
        live += 1
    ttfts = []
    while arrivals or engine.has_work():
        t = arrivals[0][0] if arrivals else float("inf")
        events = engine.advance_until(t)
        for ev in events:
            r = by_uid.pop(ev.request_id) if ev.kind is EventKind.FINISHED else by_uid[ev.request_id]
            if ev.kind is EventKind.FIRST_TOKEN:
                ttfts.append(ev.timing.ttft_s)
                inserted.setdefault(r.session_id, set()).update(r.page_keys)
                continue
            state = progress[r.session_id]
            state[1] += 1
            if state[1] < len(state[0].requests):
                nxt = state[0].requests[state[1]]
                seq += 1
                heapq.heappush(arrivals, (ev.time_s + nxt.gap_before_s, seq, nxt))
            else:
                live -= 1
                if sessions:
                    start(sessions.pop(), ev.time_s)
                    live += 1
        if events or t == float("inf"):
            continue
        _, _, r = heapq.heappop(arrivals)
        seen = inserted.get(r.session_id, ())
        reused_pages = 0
        for key in r.page_keys:
            if key not in seen:
                break
            reused_pages += 1
        reused = reused_pages * workload.page_num_tokens
        by_uid[r.uid] = r
        engine.submit(EngineRequest(
            r.uid, r.input_num_tokens - reused, r.input_num_tokens, r.output_num_tokens,
            {CPU_TIER: reused * QWEN35_9B.kv_bytes_per_token},
            QWEN35_9B.checkpoint_size_bytes if reused else 0, SSD_TIER if reused else None), t)
    ttfts.sort()
    return engine, ttfts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weka", default=DEFAULT_WEKA)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rows = []
    gen_s, w = timed(default_workload, args.repeats)
    rows.append(("generate default synthetic workload", gen_s, w.num_requests))
    gen_s, w16 = timed(lambda: mutation_microbenchmark(0.1), args.repeats)
    rows.append(("generate mutation microbenchmark (10%)", gen_s, w16.num_requests))
    workloads = [("default synthetic", w), ("mutation microbenchmark 10%", w16)]
    if os.path.exists(args.weka):
        for label, options in (("default clip 131072", LoadOptions()), ("no clip", LoadOptions(max_context_num_tokens=None))):
            load_s, weka = timed(lambda: load_weka(args.weka, options), args.repeats)
            rows.append((f"load Weka dev split ({label})", load_s, weka.num_requests))
            workloads.append((f"Weka ({label})", weka))
    else:
        print(f"(Weka trace not found at {args.weka}: loader rows skipped)")

    print("| step | thread CPU s (median) | requests | requests / s |")
    print("|---|---:|---:|---:|")
    for label, seconds, n in rows:
        print(f"| {label} | {seconds:.3f} | {n:,} | {n / seconds:,.0f} |")
    print()
    print("| engine replay (stand-in cache) | thread CPU s (median) | requests | simulated steps | "
          "requests / s | sim p50 / p99 TTFT s |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, workload in workloads:
        seconds, (engine, ttfts) = timed(lambda: replay(workload), args.repeats)
        n = len(ttfts)
        print(f"| {label} | {seconds:.3f} | {n:,} | {engine.stats.steps:,} | {n / seconds:,.0f} | "
              f"{ttfts[n // 2]:.3f} / {ttfts[int(n * 0.99)]:.3f} |")


if __name__ == "__main__":
    main()
