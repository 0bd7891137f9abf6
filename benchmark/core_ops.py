"""Per-request cost of the core's match + insert + evict at 10^3 ... 10^6 cached pages.

Workload: many agent sessions appending to their own context (append hits, adaptive checkpoints),
GPU-only budget of N pages so that, once warm, every request evicts. We time the whole life cycle
(begin_request + plan_checkpoints + finish_request) in thread CPU time, after a warm-up that
fills the cache, and report the median / p99 in microseconds plus evictions per request, so cost per
evicted unit can be read off across sizes (it should grow no faster than log n).

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


def timed_evictions(cache) -> list:
    """Wrap the cache's single-eviction step to time each evicted unit (benchmark-only patch)."""
    samples_ns = []
    inner = cache.evictor._evict_one

    def evict_one(pool, now_s):
        t0 = CLOCK()
        done = inner(pool, now_s)
        samples_ns.append(CLOCK() - t0)
        return done

    cache.evictor._evict_one = evict_one
    return samples_ns


def run(num_pages: int, num_requests: int, policy: str, freeze_gc: bool, seed: int = 0) -> dict:
    cfg = CacheConfig(page_num_tokens=PAGE_TOKENS, kv_bytes_per_token=1, checkpoint_size_bytes=8 * PAGE_TOKENS,
                      capacity_bytes={Tier.GPU: num_pages * PAGE_TOKENS})
    cache = make_cache(policy, cfg)
    rnd = random.Random(seed)
    num_sessions = max(8, num_pages // 400)
    contexts = [[(s, -1, i) for i in range(8)] for s in range(num_sessions)]
    now = 0.0

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
        cache.finish_request(lease, None, now, cache.plan_checkpoints(lease))
        return CLOCK() - t0

    warm = 0
    while cache.ledger.used_bytes[Tier.GPU] < 0.95 * num_pages * PAGE_TOKENS:
        one_request(warm)
        warm += 1
    if freeze_gc:  # what a server does after start-up (gc.freeze): old objects leave the GC's scans
        gc.collect()
        gc.freeze()
    eviction_ns = timed_evictions(cache)
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
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--policy", default="histate")
    args = ap.parse_args()
    print(f"policy={args.policy} requests={args.requests} (timed after warm-up); gc: default vs frozen after warm-up")
    print(f"{'cached pages':>12} {'nodes':>8} {'gc':>7} {'p50 us':>9} {'p99 us':>9} {'evict/req':>10} "
          f"{'median us/evict':>16}")
    for n in args.sizes:
        for freeze_gc in (False, True):
            r = run(n, args.requests, args.policy, freeze_gc)
            print(f"{r['pages']:>12,} {r['nodes']:>8,} {'frozen' if freeze_gc else 'default':>7} {r['p50_us']:>9.1f} "
                  f"{r['p99_us']:>9.1f} {r['evictions_per_req']:>10.2f} {r['us_per_eviction']:>16.1f}", flush=True)


if __name__ == "__main__":
    main()
