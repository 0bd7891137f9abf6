"""Fidelity: one small synthetic agent trace through SGLang's cache and through histate.core.

The SGLang side is HiStateRadixCache on real pools, driven request by request the way the
scheduler drives it; the reference is `histate.core.HybridPrefixCache` with the same sizes and
the same policy. With capacity for the whole trace both must report the same reused tokens for
every request and plan the same checkpoint positions (adaptive interval control, eq. 5).
"""
from __future__ import annotations

import itertools

from histate.core import CacheConfig, HybridPrefixCache, Tier, make_policy
from histate.sim.workloads import AgentWorkloadConfig, agent_workload

from sglang_cpu.pools import PAGE, Driver, ManualClock, build_cache, build_pools, publish_server_args

TRACE = AgentWorkloadConfig(
    num_sessions=5, num_turns=7, system_prompt_num_tokens=8 * PAGE, first_input_num_tokens=(20 * PAGE, 60 * PAGE),
    append_num_tokens=(2 * PAGE, 30 * PAGE), output_num_tokens=(PAGE, 4 * PAGE), truncation_rate=0.15,
    rewind_edit_rate=0.15, fork_rate=0.1, compaction_rate=0.0, cut_granularity_num_tokens=2 * PAGE,
    page_num_tokens=PAGE, max_context_num_tokens=None, seed=11)


def _round_robin(workload):
    """Requests interleaved across sessions by turn index (what concurrent sessions look like)."""
    per_session = [s.requests for s in workload.iter_sessions()]
    for turn in itertools.zip_longest(*per_session):
        yield from (r for r in turn if r is not None)


def test_sglang_cache_matches_core_reuse_per_request(sglang_plugins):
    publish_server_args()
    workload = agent_workload(TRACE, name="fidelity")
    requests = list(_round_robin(workload))
    token_of = {}  # page key -> its PAGE token ids (keys are prefix-chained, so are the tokens)

    def tokens(page_keys):
        out = []
        for k in page_keys:
            base = token_of.setdefault(k, len(token_of))
            out.extend(range(base * PAGE, (base + 1) * PAGE))
        return out

    total_pages = sum(r.num_pages for r in requests)
    pools = build_pools(kv_tokens=(total_pages + 64) * PAGE, mamba_slots=total_pages + 64, max_context=1 << 15)
    clock = ManualClock()
    cache = build_cache("histate", pools, clock=clock)
    driver = Driver(cache, pools)
    runtime = cache.histate
    core = HybridPrefixCache(
        CacheConfig(page_num_tokens=PAGE, kv_bytes_per_token=runtime.core_config.kv_bytes_per_token,
                    checkpoint_size_bytes=runtime.core_config.checkpoint_size_bytes,
                    capacity_bytes={Tier.GPU: 1 << 40},
                    supported_intervals_pages=runtime.core_config.supported_intervals_pages),
        make_policy("histate"))

    mismatches, reused_total, mutated_hits = [], 0, 0
    for i, request in enumerate(requests):
        clock.now = float(i)
        lease = core.begin_request(request.page_keys, float(i))
        core_positions = core.plan_checkpoints(lease)
        core.finish_request(lease, None, float(i), core_positions)
        outcome = driver.serve(tokens(request.page_keys), plan=cache.plan_checkpoints)
        core_reused = lease.match.num_reused_pages * PAGE
        sglang_positions = [p // PAGE for p in outcome.checkpoints]
        if outcome.reused_tokens != core_reused or sglang_positions != core_positions:
            mismatches.append((request.uid, outcome.reused_tokens, core_reused, sglang_positions, core_positions))
        reused_total += outcome.reused_tokens
        mutated_hits += request.is_mutation and outcome.reused_tokens > 0
    cache.sanity_check()
    assert not mismatches, mismatches[:5]
    assert reused_total == core.stats.num_reused_pages * PAGE > 0
    assert mutated_hits > 0  # the trace exercises hits inside earlier turns, not only appends
