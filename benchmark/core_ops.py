"""Per-request cost of the core's match + insert + evict at 10^3 ... 10^6 cached pages.

Workload: many agent sessions appending to their own context (append hits, adaptive checkpoints),
GPU-only budget of N pages so that, once warm, every request evicts. We time the whole life cycle
(begin_request + plan_checkpoints + finish_request) in thread CPU time, after a warm-up that
fills the cache, and report the median / p99 in microseconds plus evictions per request, so cost per
evicted unit can be read off across sizes (it should grow no faster than log n).

`--per-op` also times each operation on its own (issue 29's "insert, match, evict and the eq. 7
re-rank"): match = `begin_request`; plan = `plan_checkpoints`; evict = one `_evict_one` (pop the
lowest unit, evict it, re-offer what changed); re-rank = one flush of the deferred re-offers at the
end of a `make_room` pass; insert = `finish_request` less the evictions and re-ranks inside it.

    .venv/bin/python benchmark/core_ops.py [--sizes 1000 10000 100000 1000000] [--requests 5000]
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from histate.core import CacheConfig, Tier, make_cache

PAGE_TOKENS = 64
# Thread CPU time, not wall time: on a shared 2-core machine, preemption by other processes would
# otherwise dominate the tail. What is measured is the work the core does per request.
CLOCK = time.thread_time_ns


def timed_evictions(cache) -> tuple:
    """Wrap the cache's single-eviction step and its deferred re-rank flush to time each call
    (benchmark-only patch): (eviction samples, re-rank samples, [ns spent in both since reset])."""
    samples_ns, rerank_ns, inside_ns = [], [], [0]
    evictor = cache.evictor
    inner_evict, inner_flush = evictor._evict_one, evictor._flush_deferred

    def evict_one(pool, now_s):
        t0 = CLOCK()
        done = inner_evict(pool, now_s)
        dt = CLOCK() - t0
        samples_ns.append(dt)
        inside_ns[0] += dt
        return done

    def flush_deferred():
        t0 = CLOCK()
        flushed = inner_flush()
        dt = CLOCK() - t0
        if flushed:
            rerank_ns.append(dt)
        inside_ns[0] += dt
        return flushed

    evictor._evict_one = evict_one
    evictor._flush_deferred = flush_deferred
    return samples_ns, rerank_ns, inside_ns


def _p(samples_ns: list, q: float) -> float:
    """Quantile `q` of `samples_ns` in microseconds (0.0 when empty)."""
    if not samples_ns:
        return 0.0
    ordered = sorted(samples_ns)
    return ordered[int(q * (len(ordered) - 1))] / 1e3


def run(num_pages: int, num_requests: int, policy: str, freeze_gc: bool, seed: int = 0) -> dict:
    cfg = CacheConfig(page_num_tokens=PAGE_TOKENS, kv_bytes_per_token=1, checkpoint_size_bytes=8 * PAGE_TOKENS,
                      capacity_bytes={Tier.GPU: num_pages * PAGE_TOKENS})
    cache = make_cache(policy, cfg)
    rnd = random.Random(seed)
    num_sessions = max(8, num_pages // 400)
    contexts = [[(s, -1, i) for i in range(8)] for s in range(num_sessions)]
    now = 0.0
    ops = {"match": [], "plan": [], "insert": []}
    inside_ns = [0]  # replaced by the timers' counter once warm

    def one_request(turn: int) -> int:
        nonlocal now
        s = rnd.randrange(num_sessions)
        ctx = contexts[s]
        if len(ctx) > 2000 or rnd.random() < 0.05:  # compaction / rewind: restart inside the context
            ctx = ctx[: rnd.randrange(4, max(5, len(ctx) // 2))]
        ctx = ctx + [(s, turn, i) for i in range(rnd.randint(4, 60))]
        contexts[s] = ctx
        now += 1.0
        t0 = CLOCK()
        lease = cache.begin_request(ctx, now)
        t1 = CLOCK()
        depths = cache.plan_checkpoints(lease)
        t2 = CLOCK()
        inside_before = inside_ns[0]
        cache.finish_request(lease, None, now, depths)
        t3 = CLOCK()
        ops["match"].append(t1 - t0)
        ops["plan"].append(t2 - t1)
        ops["insert"].append(t3 - t2 - (inside_ns[0] - inside_before))
        return t3 - t0

    warm = 0
    while cache.ledger.used_bytes[Tier.GPU] < 0.95 * num_pages * PAGE_TOKENS:
        one_request(warm)
        warm += 1
    if freeze_gc:  # what a server does after start-up (gc.freeze): old objects leave the GC's scans
        gc.collect()
        gc.freeze()
    eviction_ns, rerank_ns, inside_ns = timed_evictions(cache)
    for samples in ops.values():
        samples.clear()  # the warm-up's
    samples_ns = [one_request(warm + i) for i in range(num_requests)]
    if freeze_gc:
        gc.unfreeze()
    samples_us = sorted(x / 1e3 for x in samples_ns)
    return {
        "pages": num_pages,
        "nodes": cache.tree.num_nodes,
        "p50_us": statistics.median(samples_us),
        "p99_us": samples_us[int(0.99 * (len(samples_us) - 1))],
        "evictions_per_req": len(eviction_ns) / num_requests,
        "us_per_eviction": statistics.median(eviction_ns) / 1e3 if eviction_ns else 0.0,
        "ops": {name: (_p(v, 0.5), _p(v, 0.99)) for name, v in
                (*ops.items(), ("evict", eviction_ns), ("re-rank", rerank_ns))},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--policy", default="histate")
    ap.add_argument("--per-op", action="store_true", help="also p50 / p99 of each operation (module docstring)")
    args = ap.parse_args()
    print(f"policy={args.policy} requests={args.requests} (timed after warm-up); gc: default vs frozen after warm-up")
    print(f"{'cached pages':>12} {'nodes':>8} {'gc':>7} {'p50 us':>9} {'p99 us':>9} {'evict/req':>10} "
          f"{'median us/evict':>16}")
    for n in args.sizes:
        for freeze_gc in (False, True):
            r = run(n, args.requests, args.policy, freeze_gc)
            print(f"{r['pages']:>12,} {r['nodes']:>8,} {'frozen' if freeze_gc else 'default':>7} {r['p50_us']:>9.1f} "
                  f"{r['p99_us']:>9.1f} {r['evictions_per_req']:>10.2f} {r['us_per_eviction']:>16.1f}", flush=True)
            if args.per_op:
                print("      per operation p50 / p99 us: " + ", ".join(
                    f"{name} {p50:.1f} / {p99:.1f}" for name, (p50, p99) in r["ops"].items()), flush=True)


if __name__ == "__main__":
    main()
