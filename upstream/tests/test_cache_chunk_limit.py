"""The test that ships with upstream/series 0012 ([scheduler] the tree cache caps a continuing chunk).

Written as it would sit in SGLang's own test tree (no HiState import): `SchedulePolicy` over a stock
`UnifiedRadixCache` from SGLang's own unified-radix-cache test kit (CPU). A cache without a limiter leaves
SGLang's rule alone (no cap outside shortest-prefill-first); a cache with one decides the cap under every
policy, called with exactly the arguments the scheduler passes.
"""
from __future__ import annotations

import types

import pytest

from _full_mamba_kit import build_kit
from sglang.srt.managers.schedule_policy import SchedulePolicy


def policy_over(cache, name: str) -> SchedulePolicy:
    return SchedulePolicy(name, cache, enable_hierarchical_cache=False, enable_priority_scheduling=False,
                          schedule_low_priority_values_first=False)


@pytest.fixture
def cache():
    return build_kit(mamba_slots=4, kv_tokens=256).cache


def chunked(remaining: int):
    return types.SimpleNamespace(full_untruncated_fill_ids=list(range(remaining)), prefix_len=0)


def test_without_a_limiter_sglangs_rule_stands(cache):
    assert cache.continuing_chunk_limiter() is None
    assert policy_over(cache, "fcfs").shortest_prefill_chunk_limit(chunked(5000), [], 1000, 16) is None


@pytest.mark.parametrize("name", ["fcfs", "lpm", "shortest-prefill-first"])
def test_a_cache_limiter_decides_the_cap_under_every_policy(cache, name):
    calls = []

    def limiter(policy, chunked_req, waiting_queue, budget, page_size):
        calls.append((policy, chunked_req, waiting_queue, budget, page_size))
        return 512

    cache.continuing_chunk_limiter = lambda: limiter
    policy, req, queue = policy_over(cache, name), chunked(5000), []
    assert policy.shortest_prefill_chunk_limit(req, queue, 1000, 16) == 512
    assert calls == [(policy, req, queue, 1000, 16)]
    calls.clear()
    cache.continuing_chunk_limiter = lambda: (lambda *args: calls.append(args))  # None: uncapped
    assert policy.shortest_prefill_chunk_limit(req, queue, 1000, 16) is None and len(calls) == 1
