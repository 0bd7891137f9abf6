"""Fidelity: one small synthetic agent trace through SGLang's cache and through histate.core.

The SGLang side is HiStateRadixCache on real pools, driven request by request the way the scheduler
drives it. Two comparisons:

1. Room for everything: against `histate.core.HybridPrefixCache` with the same sizes and policy, the
   same reused tokens for every request and the same planned checkpoint positions (eq. 5).
2. Pressure on device, host and SSD: SGLang's HiCache runs for real (sglang_cpu/hicache.py) with
   HiState's ranking on all three tiers. Here the two engines cannot run the same trace to the same
   state, for reasons of SGLang's design, not of the policy:
     * placement: SGLang writes every node through device -> host -> SSD (inclusive tiers); the core's
       HiState keeps each copy in one tier and sends historical checkpoints to SSD (exclusive);
     * structure: SGLang's tree is token-granular, splits an edge wherever a match ends and never
       merges; the core merges checkpoint-less single-child nodes, so a bundle's M (the tokens it
       frees) differs between the two trees after a merge;
     * what a tier's walk can take: SGLang evicts a device leaf with its device state (the FULL
       component cascades), deletes a host leaf outright (its SSD copies are then reachable only by
       SGLang's own L3 prefetch), and never sheds a host copy of KV still on the device;
     * timing: SGLang backs up asynchronously and evicts on allocation failure, per component.
   So the test asserts the strongest equalities that hold on SGLang's own trajectory:
     * every eviction decision, on every tier, is exactly the one `histate.core` makes: the minimum
       of the core's eq. 7 (`PolicyState.score`) over the units SGLang's walk for that tier can take,
       found by brute force at the moment of the decision;
     * every request reuses exactly the core's hit accounting on that tree (MatchResult.c: the
       deepest checkpoint, in any tier, on its KV-matched path), which requires SSD-only checkpoints
       to be restored before admission and host hits to be loaded back.
   The learned statistics (q, the near-end prior) are frozen here: when they move, a lazy victim heap
   holds entries scored under the previous values until they reach the top, in the core as in the
   plugin, and a brute-force minimum under the new values can differ from either heap's choice.
"""
from __future__ import annotations

import itertools

from histate.core import CPU_BIT, GPU_BIT, SSD_BIT, CacheConfig, HybridPrefixCache, Tier, make_policy
from histate.sglang_plugin import eviction
from histate.sglang_plugin.config import resolve_config
from histate.sglang_plugin.core_nodes import core_of
from histate.sglang_plugin.server_settings import storage_extra_config
from histate.sim.workloads import AgentWorkloadConfig, agent_workload

from sglang_cpu import hicache as hicache_rig
from sglang_cpu.hicache import TieredDriver, build_hicache
from sglang_cpu.hicache import request as hicache_rig_request
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


class _Tokens:
    """Page keys -> token ids: each page key gets its own PAGE token ids (keys are prefix-chained,
    so the tokens are too)."""

    def __init__(self):
        self.base_of = {}

    def __call__(self, page_keys):
        out = []
        for k in page_keys:
            base = self.base_of.setdefault(k, len(self.base_of))
            out.extend(range(base * PAGE, (base + 1) * PAGE))
        return out


def test_sglang_cache_matches_core_reuse_per_request(sglang_plugins):
    publish_server_args()
    workload = agent_workload(TRACE, name="fidelity")
    requests = list(_round_robin(workload))
    tokens = _Tokens()

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


# --- pressure on device, host and SSD ---------------------------------------------------------------


class _MissModel:
    """What `--histate-miss-reasons` must say for each admission (docs/misses.md), from the test's own
    record of what earlier requests inserted (each pass inserts its prompt up to a checkpoint), not from
    the plugin's events: a page past the KV match was never inserted -> no_prefix, else it was cached and
    left (kv_evicted, or not_restored when an SSD copy stayed); between the resume point c and the KV
    match m, the deepest position that ever held a checkpoint splits state_evicted from no_checkpoint."""

    def __init__(self):
        self.inserted: set = set()     # token prefixes (as tuples) whose KV an insert cached
        self.checkpointed: set = set()  # token prefixes a checkpoint was inserted at
        self.totals: dict = {}
        self.wrong: list = []

    def served(self, request_tokens, outcome) -> None:
        end = max(outcome.checkpoints, default=0)
        for g in range(PAGE, end + 1, PAGE):
            self.inserted.add(tuple(request_tokens[:g]))
        for position in outcome.checkpoints:
            self.checkpointed.add(tuple(request_tokens[:position]))

    def check(self, req, request_tokens, reused) -> None:
        got = getattr(req, "_hs_misses").tokens_by_reason
        L = len(request_tokens)
        n = (L - 1) // PAGE  # SGLang matches at most the first L-1 tokens
        m = next((i for i in range(n) if not _held(req, i)), n)
        problems = []
        if sum(got.values()) != L - reused:
            problems.append(("sum", sum(got.values()), L - reused))
        kv = {"no_prefix": 0, "evicted": 0}
        for i in range(m, n):
            kv["no_prefix" if tuple(request_tokens[:(i + 1) * PAGE]) not in self.inserted else "evicted"] += PAGE
        if got["no_prefix"] != kv["no_prefix"] or got["kv_evicted"] + got["not_restored"] != kv["evicted"]:
            problems.append(("kv", got, kv))
        deepest = next((d for d in range(m, reused // PAGE, -1)
                        if tuple(request_tokens[:d * PAGE]) in self.checkpointed), None)
        state = (deepest or reused // PAGE) * PAGE - reused
        if got["state_evicted"] != state or got["no_checkpoint"] != m * PAGE - reused - state \
                or got["page_boundary"] != L - n * PAGE:
            problems.append(("state", got, m, reused, deepest))
        if problems:
            self.wrong.append((req.rid, problems))
        for reason, value in got.items():
            self.totals[reason] = self.totals.get(reason, 0) + value


def _held(req, page: int) -> bool:
    """Whether the admission's KV match covered `page`: SGLang's branching point (the KV match end, floored to
    the state grid, when it lies past the reused state) or else the reused prefix, on device and host."""
    return (page + 1) * PAGE <= max(req.mamba_branching_seqlen or 0, req.prefix_len + req.host_hit_length)

_BITS = {Tier.GPU: GPU_BIT, Tier.CPU: CPU_BIT, Tier.SSD: SSD_BIT}


def _deepest_checkpoint(cache, tokens):
    """The core's hit accounting on SGLang's tree: the end of the deepest node, among those the request's
    tokens match entirely, that holds a checkpoint in any tier (MatchResult.num_reused_pages)."""
    node, pos, reused = cache.tree_core.root_node, 0, 0
    while True:
        child = next((c for c in node.children.values()
                      if list(c.key.token_ids[:len(c.key)]) == tokens[pos:pos + len(c.key)]), None)
        if child is None:
            return reused
        node, pos = child, pos + len(child.key)
        if core_of(node).ckpt_mask:
            reused = pos


def test_under_pressure_on_every_tier_each_decision_is_the_cores(sglang_plugins, tmp_path, monkeypatch):
    import histate.sglang_plugin.config as plugin_config
    import histate.sglang_plugin.storage_backend as plugin_storage

    for module in (plugin_config, plugin_storage):  # the 64 MiB floor is one Qwen3.5 checkpoint; these are 544 B
        monkeypatch.setattr(module, "MIN_SSD_SIZE_BYTES", 1 << 20)
    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file",
                             "ssd_size_bytes": "1MiB", "miss_reasons": True}, {})
    publish_server_args()
    pools = build_pools(kv_tokens=160 * PAGE, mamba_slots=8, max_context=1 << 15)  # the trace: ~1,900 pages
    clock = ManualClock()
    cache = build_hicache("histate", pools, histate_config=config, storage_extra=storage_extra_config(None, config),
                          clock=clock, hicache_ratio=1.2)  # host: ~3,000 KV tokens and 16 state slots
    state = cache.histate.state
    for ema in (state.terminal_hits, *state.near_end_hits):
        ema.alpha = 0.0  # frozen statistics (module docstring)

    decisions, wrong = {}, []
    take_victim = eviction.TierVictims.next_victim

    def checked_next_victim(victims, tier, accept=None):
        units = [(state.score(core_of(sg), unit, _BITS[tier]), sg.id)
                 for sg in victims.tree_core._node_arena.values()
                 for unit in eviction.tier_units(core_of(sg), victims.tree_core, tier)
                 if accept is None or accept(core_of(sg), unit)]
        victim = take_victim(victims, tier, accept)
        if victim is None:
            assert not units, f"{tier.name}: {len(units)} units could go, none was taken"
            return None
        node, unit = victim
        decisions[tier] = decisions.get(tier, 0) + 1
        if state.score(node, unit, _BITS[tier]) > min(units)[0] + 1e-9:
            wrong.append((tier.name, node.sg.id, unit, min(units)))
        return victim

    monkeypatch.setattr(eviction.TierVictims, "next_victim", checked_next_victim)
    tokens, driver, misses = _Tokens(), TieredDriver(cache, pools), []
    admit = driver.admit
    admitted = []
    monkeypatch.setattr(hicache_rig, "request", lambda *a: admitted.append(hicache_rig_request(*a)) or admitted[-1])
    reasons = _MissModel()

    def admit_checked(request_tokens):
        expected = _deepest_checkpoint(cache, request_tokens)
        reused = admit(request_tokens)
        if reused != expected:
            misses.append((expected, reused))
        reasons.check(admitted[-1], request_tokens, expected)
        return reused

    driver.admit = admit_checked
    for i, request in enumerate(_round_robin(agent_workload(TRACE, name="fidelity"))):
        clock.now = float(i)
        request_tokens = tokens(request.page_keys)
        outcome = driver.serve(request_tokens, plan=cache.plan_checkpoints)
        reasons.served(request_tokens, outcome)
        cache.sanity_check()
        cache.histate.victims.check_offered()
    assert not wrong, wrong[:5]
    assert not misses, misses[:5]
    assert not reasons.wrong, reasons.wrong[:5]
    # every reason but page_boundary (these prompts end on a page) and not_restored (no fault) is reached
    # (tokens of this seeded run: kv_evicted 14,016, state_evicted 656, no_checkpoint 4,976, no_prefix 25,664)
    assert all(reasons.totals[r] > 0 for r in ("no_prefix", "kv_evicted", "state_evicted", "no_checkpoint")), \
        reasons.totals
    print("miss reasons (tokens):", reasons.totals)
    # The pressure is real on every tier (counts of this seeded run: device 209, host 140, SSD 112).
    assert min(decisions.get(t, 0) for t in Tier) >= 50, decisions
    assert cache.histate.metrics.totals[("ssd_restores_total", "ok")] >= 1  # SSD-only checkpoints were reused
