"""Golden counts (libCacheSim style): exact integers per policy on a fixed, seeded agent-like
request stream under tight budgets. A change in any number is a behaviour change to review.
Regenerate with HISTATE_REGEN_GOLDEN=1 and read the diff."""
import json
import os
import random
from pathlib import Path

import pytest

from histate.core import available_policies, make_cache

from .helpers import serve, tiny_config

GOLDEN = Path(__file__).with_name("golden_core.json")


def agent_stream(seed: int = 7, num_sessions: int = 6, num_turns: int = 12):
    """Sessions that mostly append, sometimes truncate inside an earlier turn or fork from one."""
    rnd = random.Random(seed)
    contexts = {s: [("sys", i) for i in range(4)] for s in range(num_sessions)}
    now = 0.0
    for turn in range(num_turns):
        for s in rnd.sample(range(num_sessions), num_sessions):
            ctx = contexts[s]
            event = rnd.random()
            if event < 0.15 and len(ctx) > 8:  # truncation / rewind-and-edit inside the context
                ctx = ctx[: rnd.randrange(5, len(ctx) - 2)]
            new = [(s, turn, i, rnd.random() < 0.1) for i in range(rnd.randint(3, 14))]
            ctx = ctx + new
            contexts[s] = ctx
            now += rnd.choice((1.0, 2.0, 30.0))
            yield tuple(ctx), now


def replay(policy_name: str) -> dict:
    cache = make_cache(policy_name, tiny_config(gpu_pages=60, cpu_pages=80, ssd_pages=200, tau_s=60.0))
    for keys, now in agent_stream():
        serve(cache, keys, now)
        cache.check_invariants()
    s = cache.stats
    return {
        "requests": s.num_requests,
        "input_pages": s.num_input_pages,
        "kv_hit_pages": s.num_kv_hit_pages,
        "reused_pages": s.num_reused_pages,
        "terminal_hits": s.num_terminal_hits,
        "evictions": sum(s.evictions.values()),
        "checkpoints_written": sum(s.checkpoints_written_by_tier.values()),
    }


def test_golden_counts_per_policy():
    got = {name: replay(name) for name in available_policies()}
    if os.environ.get("HISTATE_REGEN_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    expected = json.loads(GOLDEN.read_text())
    assert got == expected


def test_golden_ordering_unlimited_is_the_ceiling():
    expected = json.loads(GOLDEN.read_text())
    ceiling = expected["unlimited"]["reused_pages"]
    assert all(v["reused_pages"] <= ceiling for v in expected.values())
    assert expected["histate"]["reused_pages"] > expected["vllm-marconi"]["reused_pages"]
