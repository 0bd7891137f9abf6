"""Miss attribution (core/misses.py): every uncached prompt token gets one reason.

Expectations are computed by hand from each scenario's construction, and for random streams from the
simulator's `explain.EvictionLog`, an independent record of the same cache events (written for
`histate replay --explain`, sharing no code with `MissRecorder` or `attribute_misses`)."""
from __future__ import annotations

import random

import pytest

from histate.core import (MISS_REASONS, ConfigError, Departure, HybridPrefixCache, ItemKind, MissHistory,
                          MissRecorder, ObserverGroup, Tier, attribute_misses, make_policy)
from histate.sim.explain import EvictionLog

from .helpers import PAGE_TOKENS, expected_reasons, serve, tiny_config

P = PAGE_TOKENS


def _cache(policy: str = "histate", **capacity) -> tuple:
    cache = HybridPrefixCache(tiny_config(**capacity), make_policy(policy))
    history = MissHistory(max_keys=None)
    cache.observer = MissRecorder(history)
    return cache, history


def test_reasons_by_hand():
    keys = [f"k{i}" for i in range(10)]
    history = MissHistory()
    history.kv_gone("k6", Departure(5.0, Tier.GPU, 1.5))
    history.kv_gone("k7", Departure(5.0, Tier.SSD, lost=True))
    history.checkpoint_gone("k4", Departure(3.0, Tier.CPU, 0.5))  # the state at depth 5
    history.checkpoint_gone("k1", Departure(2.0, Tier.GPU, 0.2))  # above c: never read
    att = attribute_misses(keys, 10 * P + 30, P, kv_pages=6, reused_pages=2, history=history)
    assert att.tokens_by_reason == {"page_boundary": 30, "kv_evicted": P, "not_restored": P, "no_prefix": 2 * P,
                                    "state_evicted": 3 * P, "no_checkpoint": P, "never_cached": 0}
    assert att.uncached_tokens == 10 * P + 30 - 2 * P
    assert att.state_gap_tokens == 4 * P
    assert att.kv_departure.tier is Tier.GPU and att.state_departure.time_s == 3.0


def test_a_checkpoint_placed_again_clears_its_departure_and_lost_states_read_not_restored():
    keys = [1, 2, 3, 4]
    history = MissHistory()
    history.checkpoint_gone(2, Departure(1.0, Tier.GPU, 0.1))
    history.checkpoint_placed(2)
    assert attribute_misses(keys, 4 * P + 1, P, 4, 0, history).tokens_by_reason["no_checkpoint"] == 4 * P
    history.checkpoint_gone(4, Departure(2.0, lost=True))  # the state at depth 4
    att = attribute_misses(keys, 4 * P + 1, P, 4, 1, history).tokens_by_reason
    assert (att["not_restored"], att["no_checkpoint"], att["page_boundary"]) == (3 * P, 0, 1)


def test_kv_held_past_the_last_block_boundary_reads_page_boundary():
    history = MissHistory()
    history.kv_gone(5, Departure(1.0, Tier.GPU, 0.3))
    att = attribute_misses([1, 2, 3, 4, 5, 6], 6 * P + 3, P, kv_pages=2, reused_pages=2, history=history,
                           held_kv_pages=4).tokens_by_reason
    assert (att["page_boundary"], att["kv_evicted"], att["no_prefix"]) == (2 * P + 3, P, P)


def test_inconsistent_matches_are_refused():
    with pytest.raises(ValueError, match="inconsistent match"):
        attribute_misses([1, 2], 2 * P, P, kv_pages=1, reused_pages=2, history=MissHistory())
    with pytest.raises(ValueError, match="inconsistent match"):
        attribute_misses([1, 2, 3], 2 * P, P, kv_pages=1, reused_pages=0, history=MissHistory())
    with pytest.raises(ConfigError, match="max_keys"):
        MissHistory(max_keys=0)


def test_a_page_an_earlier_prompt_had_but_the_cache_never_held_reads_never_cached():
    history = MissHistory(max_keys=3)
    history.saw_context(["a", "b"])
    att = attribute_misses(["a", "b", "c"], 3 * P + 1, P, 0, 0, history).tokens_by_reason
    assert (att["never_cached"], att["no_prefix"]) == (2 * P, P)
    # walks back to "b", the deepest seen; the bound then forgets the oldest insert, "b" (a prompt's pages
    # go in deepest first, so a shared shallow prefix outlives the pages past it)
    history.saw_context(["a", "b", "c", "d"])
    assert not history.was_seen("b") and all(history.was_seen(k) for k in "acd")


def test_the_bound_forgets_the_oldest_departure_first():
    history = MissHistory(max_keys=2)
    history.kv_gone("a", Departure(1.0))
    history.checkpoint_gone("b", Departure(2.0))
    history.kv_gone("c", Departure(3.0))
    assert history.kv_departure("a") is None and history.checkpoint_departure("b") and history.kv_departure("c")
    history.kv_gone("d", Departure(4.0))
    assert history.checkpoint_departure("b") is None and len(history) == 2 and history.forgotten == 2


def test_kv_held_without_a_checkpoint_reads_no_checkpoint():
    cache, history = _cache(gpu_pages=64)
    serve(cache, list(range(1, 9)), 0.0, checkpoint_pages=[8])
    keys = [1, 2, 3, 4, 5, 100, 101]
    match = cache.begin_request(keys, 1.0).match
    att = attribute_misses(keys, 7 * P + 10, P, match.num_kv_pages, match.num_reused_pages, history)
    assert (match.num_kv_pages, match.num_reused_pages) == (5, 0)
    assert att.tokens_by_reason == {**dict.fromkeys(MISS_REASONS, 0), "no_checkpoint": 5 * P, "no_prefix": 2 * P,
                                    "page_boundary": 10}


def test_a_lost_checkpoint_reads_not_restored_and_an_evicted_bundle_kv_evicted():
    # GPU of 12 pages: one 8-page request with its terminal checkpoint (4 pages) fills it
    cache, history = _cache(gpu_pages=12)
    first = list(range(1, 9))
    serve(cache, first, 0.0, checkpoint_pages=[4, 8])
    assert cache.report_lost(first, 4, ItemKind.CHECKPOINT, Tier.GPU, 1.0)
    keys = first[:6] + [50]
    match = cache.match(keys)
    att = attribute_misses(keys, 7 * P + 1, P, match.num_kv_pages, match.num_reused_pages, history)
    assert att.tokens_by_reason["not_restored"] == 4 * P and att.tokens_by_reason["no_checkpoint"] == 2 * P
    assert att.state_departure.lost and att.state_departure.score is None
    serve(cache, list(range(200, 208)), 2.0, checkpoint_pages=[8])  # needs the room: evicts the first bundle
    match = cache.match(first)
    assert match.num_kv_pages == 0
    att = attribute_misses(first, 8 * P + 5, P, 0, 0, history)
    assert att.tokens_by_reason["kv_evicted"] == 8 * P and att.tokens_by_reason["page_boundary"] == 5
    assert att.kv_departure.tier is Tier.GPU and att.kv_departure.score is not None and not att.kv_departure.lost


@pytest.mark.parametrize("policy", ["histate", "vllm-disk", "marconi", "sglang-hicache"])
def test_random_streams_match_an_independent_event_record(policy):
    rng = random.Random(7)
    config = tiny_config(gpu_pages=40, cpu_pages=60, ssd_pages=120)
    cache = HybridPrefixCache(config, make_policy(policy))
    history = MissHistory(max_keys=None)
    log = EvictionLog()
    cache.observer = ObserverGroup(MissRecorder(history), log)
    prefixes: list = [[]]
    next_key = 1000
    reasons_seen: set = set()
    seen: set = set()
    for step in range(400):
        now = float(step)
        base = rng.choice(prefixes)
        keep = rng.randint(0, len(base))
        fresh = list(range(next_key, next_key + rng.randint(1, 6)))
        next_key += len(fresh)
        keys = base[:keep] + fresh
        L = len(keys) * P + rng.randint(1, P - 1)
        log.set_request(step)  # as the replay does around each request's cache calls
        lease = cache.begin_request(keys, now)
        m, c, h = lease.match.num_kv_pages, lease.match.num_reused_pages, lease.match.num_held_kv_pages
        got = attribute_misses(keys, L, P, m, c, history, h).tokens_by_reason
        assert got == expected_reasons(log, keys, L, P, m, c, now, seen, h), (step, m, c)
        assert sum(got.values()) == L - c * P
        reasons_seen |= {r for r, v in got.items() if v}
        cache.finish_request(lease, None, now, cache.plan_checkpoints(lease))
        history.saw_context(keys)
        seen.update(keys)
        if step % 37 == 5:  # a fault now and then
            victim = rng.choice(prefixes) or keys
            log.set_request(None)
            cache.report_lost(victim, rng.randint(1, len(victim)), rng.choice([ItemKind.KV, ItemKind.CHECKPOINT]),
                              rng.choice([Tier.GPU, Tier.CPU, Tier.SSD]), now)
        prefixes.append(keys)
    # the stream reaches the reasons (this seed: all seven for sglang-hicache, whose KV pool can refuse an
    # insert; all but never_cached for histate; vllm-disk and marconi have no fault landing on a copy)
    assert {"no_prefix", "kv_evicted", "state_evicted", "no_checkpoint", "page_boundary"} <= reasons_seen, reasons_seen
    if policy == "sglang-hicache":
        assert reasons_seen == set(MISS_REASONS)
    if policy == "histate":
        assert reasons_seen == set(MISS_REASONS) - {"never_cached"}
