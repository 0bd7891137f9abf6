"""HiState's tree cache on SGLang's real pools (device="cpu"): factory, invariants, Figure 7."""
from __future__ import annotations

import dataclasses
import random
import types
from array import array

import pytest

from histate.core import GPU_BIT, Tier, UnitKind, make_policy
from histate.core.policies.histate import HiStateLruDisk
from histate.sglang_plugin.config import HiStateConfigError
from histate.sglang_plugin.core_nodes import core_of, has_device_state
from histate.sglang_plugin.eviction import tier_units

from sglang_cpu.pools import PAGE, Driver, ManualClock, build_cache, build_pools, cache_params, key, publish_server_args


@pytest.fixture
def sglang_cpu(sglang_plugins):
    return publish_server_args()


def _tree_ctx(server_args, params, *, hybrid_ssm=True):
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    return TreeCacheBuildContext(server_args=server_args, params=params, is_hybrid_swa=False,
                                 is_hybrid_ssm=hybrid_ssm, enable_hierarchical_cache=False,
                                 disable_radix_cache=False, tp_worker=None, model_config=None,
                                 tp_size=1, tp_rank=0, tp_group=None)


def test_sglang_factory_returns_histate_cache(sglang_plugins):
    """SGLang's own create_tree_cache() routes --radix-cache-backend histate to our factory."""
    from sglang.srt.mem_cache.registry import create_tree_cache
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from histate.sglang_plugin.components import HiStateFullComponent, HiStateMambaComponent
    from histate.sglang_plugin.tree_cache import HiStateRadixCache
    from histate.sglang_plugin.tree_core import HiStateTreeCore

    server_args = publish_server_args(radix_cache_backend="histate")
    pools = build_pools(1024, 8)
    cache = create_tree_cache(_tree_ctx(server_args, cache_params(pools, tree_core="rust")))
    assert type(cache) is HiStateRadixCache
    assert type(cache.tree_core) is HiStateTreeCore  # our registered tree core, not Rust
    assert type(cache.components[ComponentType.MAMBA]) is HiStateMambaComponent
    assert type(cache.components[ComponentType.FULL]) is HiStateFullComponent
    with pytest.raises(HiStateConfigError, match="needs a hybrid model"):
        create_tree_cache(_tree_ctx(server_args, cache_params(build_pools(1024, 8)), hybrid_ssm=False))


def _slot_conservation(cache, pools, kv_tokens, mamba_slots):
    """H1: every KV token and state slot is either free or held by exactly one tree node."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    kv_in_tree = states_in_tree = 0
    for node in cache.tree_core._node_arena.values():
        if node.parent is None:
            continue
        kv = node.component_data[ComponentType.FULL].value
        kv_in_tree += 0 if kv is None else len(kv)
        states_in_tree += has_device_state(node)
    assert pools.allocator.available_size() + kv_in_tree == kv_tokens
    assert pools.mamba_allocator.available_size() + states_in_tree == mamba_slots


def _assert_restorable(cache, tokens):
    """H2: a reported reuse ends exactly at a node that holds a device state."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    result = cache.match_prefix(MatchPrefixParams(key=key(tokens)))
    node = cache.tree_core.node_by_id(result.last_device_node)
    if result.device_prefix_len:
        assert core_of(node).depth_pages == result.device_prefix_len
        assert has_device_state(node)
    return result.device_prefix_len


@pytest.mark.parametrize("kind", ["histate", "stock"])
def test_random_request_sequences_keep_sglang_and_histate_invariants(sglang_cpu, kind):
    """Seeded agent-like traffic (appends, truncations, forks) under pressure on tiny pools."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams

    rng = random.Random(7)
    kv_tokens, mamba_slots = 96 * PAGE, 10
    pools = build_pools(kv_tokens, mamba_slots)
    clock = ManualClock()
    cache = build_cache(kind, pools, **({"clock": clock} if kind == "histate" else {}))
    driver = Driver(cache, pools)
    sessions = [[] for _ in range(4)]
    next_token = [10_000]
    reused_total = 0

    def fresh(num_pages):
        out = list(range(next_token[0], next_token[0] + num_pages * PAGE))
        next_token[0] += num_pages * PAGE
        return out

    for step in range(60):
        clock.now = float(step)
        s = rng.randrange(len(sessions))
        ctx = sessions[s]
        op = rng.random()
        if ctx and op < 0.2:  # rewind/edit: cut inside an earlier turn, then append
            ctx = ctx[: rng.randrange(1, len(ctx) // PAGE + 1) * PAGE]
        if len(ctx) > 40 * PAGE:  # a new session replaces a long one
            ctx = []
        ctx = ctx + fresh(rng.randrange(1, 6))
        sessions[s] = ctx
        plan = cache.plan_checkpoints if kind == "histate" else (lambda c, n, m: [n])
        outcome = driver.serve(ctx, plan=plan)
        cache.sanity_check()
        _slot_conservation(cache, pools, kv_tokens, mamba_slots)
        assert _assert_restorable(cache, ctx) == len(ctx)  # the request just inserted its terminal state
        if kind == "histate":
            cache.histate.victims.check_offered()
        if step % 7 == 3:  # a state request with one session pinned, as a running request would
            locked = cache.match_prefix(MatchPrefixParams(key=key(ctx)))
            lock = cache.lock(locked.last_device_node)
            cache.evict(EvictParams(num_tokens=4 * PAGE, mamba_num=2))
            assert _assert_restorable(cache, ctx) == locked.device_prefix_len  # H3: pins hold
            cache.unlock(lock)
            cache.sanity_check()
            _slot_conservation(cache, pools, kv_tokens, mamba_slots)
        assert outcome.reused_tokens % PAGE == 0
        reused_total += outcome.reused_tokens
    assert reused_total > 0  # the trace does hit
    if kind == "histate":  # ... and the pools are small enough that both unit kinds get evicted
        totals = cache.histate.metrics.totals
        assert totals[("evictions_total", "checkpoint", "device")] > 0 and totals[("evictions_total", "bundle", "device")] > 0
        driver.match(sessions[0], req=types.SimpleNamespace(session=None))  # a request-level match
        device_states = sum(has_device_state(n) for n in cache.tree_core._node_arena.values())
        assert cache.histate.metrics.totals[("checkpoints", "device")] == device_states > 0
    cache.evict(EvictParams(num_tokens=kv_tokens, mamba_num=mamba_slots))
    cache.sanity_check()
    assert pools.allocator.available_size() == kv_tokens
    assert pools.mamba_allocator.available_size() == mamba_slots


def test_each_eviction_takes_the_lowest_score(sglang_cpu):
    """The lazy heaps pick exactly the minimum of eq. 7 over all current units (brute force)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    rng = random.Random(3)
    pools = build_pools(400 * PAGE, 40)
    clock = ManualClock()
    cache = build_cache("histate", pools, clock=clock)
    driver = Driver(cache, pools)
    for i in range(12):
        clock.now = 1.0 + i
        base = list(range(100_000 * (i % 4), 100_000 * (i % 4) + rng.randrange(4, 20) * PAGE))
        driver.serve(base, plan=lambda c, n, m: sorted({p for p in range(c + 3 * PAGE, n, 3 * PAGE)} | {n}))
    runtime = cache.histate
    for t in range(10):
        clock.now = 100.0 + t
        units = [(runtime.state.score(core_of(n), u, GPU_BIT), n.id, u) for n in cache.tree_core._node_arena.values()
                 for u in tier_units(core_of(n), cache.tree_core, Tier.GPU)
                 if u is UnitKind.CHECKPOINT or has_device_state(n)]
        expected = min(units)
        before = {n.id for n in cache.tree_core._node_arena.values() if has_device_state(n)}
        cache.evict(EvictParams(num_tokens=0, mamba_num=1))
        after = {n.id for n in cache.tree_core._node_arena.values() if has_device_state(n)}
        assert before - after == {expected[1]}, (expected, before - after)
        cache.sanity_check()


# --- Figure 7 (paper §3.3): one checkpoint slot to free -----------------------------------------

B = list(range(1_000, 1_000 + 80 * PAGE))
C = list(range(50_000, 50_000 + 30 * PAGE))
STATES = {"S1": B[:40 * PAGE], "S2": B[:44 * PAGE], "S3": B, "S6": C}


class LruRefreshAll(HiStateLruDisk):
    name = "lru-refresh-all"
    refresh_all = True


def _figure7(kind, policy=None):
    pools = build_pools(130 * PAGE, 8)
    clock = ManualClock()
    cache = build_cache(kind, pools, **({"clock": clock, "policy": policy} if kind == "histate" else {}))
    driver = Driver(cache, pools)
    for now, tokens in ((1.0, STATES["S1"]), (2.0, STATES["S2"]), (3.0, STATES["S3"]), (4.0, STATES["S6"])):
        clock.now = now
        driver.serve(tokens, [len(tokens)])
    clock.now = 10.0
    driver.serve(B, [])  # B appends again: a hit at S3 (C waits for a tool result)
    return cache, clock


@pytest.mark.parametrize("kind, policy, evicted", [
    ("histate", make_policy("histate"), "S2"),
    ("histate", make_policy("histate-lru-disk"), "S1"),
    ("histate", LruRefreshAll(), "S6"),
    ("stock", None, "S1"),
], ids=["histate", "lru", "lru-refresh-all", "sglang-stock"])
def test_figure7_decisions(sglang_cpu, kind, policy, evicted):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams

    cache, clock = _figure7(kind, policy)
    clock.now = 11.0
    result = cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    assert result.mamba_num_evicted == 1
    cache.sanity_check()
    surviving = {name for name, tokens in STATES.items()
                 if cache.match_prefix(MatchPrefixParams(key=key(tokens))).device_prefix_len == len(tokens)}
    assert surviving == set(STATES) - {evicted}
    if evicted == "S2":  # sparsified, not lost: a fork at S2 resumes from S1
        fork = cache.match_prefix(MatchPrefixParams(key=key(STATES["S2"] + [7] * PAGE)))
        assert (fork.full_kv_hit_length, fork.device_prefix_len) == (44 * PAGE, 40 * PAGE)
    if kind == "histate":
        unit = "bundle" if evicted == "S6" else "checkpoint"
        assert cache.histate.metrics.totals[("evictions_total", unit, "device")] == 1


# --- copy-on-write admission (SGLang's real path) ------------------------------------------------

@pytest.mark.parametrize("kind", ["stock", "histate"])
def test_copy_on_write_admissions_back_to_back(sglang_plugins, kind):
    """Two admissions through `Req.init_next_round_input(cow_mamba=True)`, as the scheduler runs
    them (scheduler.py:4260), on a full state pool. Each copies its matched checkpoint into a
    request slot, and with none free `MambaComponent.finalize_match_result_in_cache` locks the
    matched node, calls `evict_for_alloc(mamba_num=1)` and unlocks (mamba.py:210-221).

    Tree: M (8 tokens, state) -> L (16 tokens, state), and N (8 other tokens, state); 3 slots.
    Admission 1 matches M: the walk must leave M (locked) and evicts N. Admission 2 matches L:
    the only evictable state is now M's (its Mamba lock is gone, L's path keeps its KV locked),
    and stock evicts it. HiState's ranker had dropped M when it met it locked in admission 1, so
    before the fix this raised "Can not alloc mamba cache" (R1)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture
    from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures

    from ._sglang_kit import FULL_MAMBA_CONFIGS, assert_evict_frees_what_the_ledger_reports, kit_on_cpu

    kit = UnifiedRadixCacheFixtures()
    kit.cfg = dataclasses.replace(FULL_MAMBA_CONFIGS[0], mamba_cache_size=3)  # page 1, no extra buffer
    with kit_on_cpu(kind):
        cache, allocator, pool = build_fixture(kit.cfg)
    a, n = list(range(100, 116)), list(range(500, 508))
    for tokens in (a[:8], n, a):  # M, N, then L below M
        kit._insert(cache, allocator, pool, tokens)
    assert pool.mamba_allocator.available_size() == 0 and cache.mamba_evictable_size() == 3

    def admit(tokens):
        req = Req(rid=str(tokens[-1]), origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        req.init_next_round_input(cache, cow_mamba=True)
        return req

    first = admit(a[:8] + [7, 7])
    assert first.prefix_len == 8 and first.kv.holds_mamba
    assert kit_match(cache, n) == 0  # N was the victim; M and L are intact
    assert kit_match(cache, a) == 16
    second = admit(a + [9, 9])
    assert second.prefix_len == 16 and second.kv.holds_mamba
    assert kit_match(cache, a[:8] + [1]) == 0  # M's checkpoint was the victim (its KV stays)
    cache.sanity_check()
    assert_evict_frees_what_the_ledger_reports(cache, allocator, pool)
    if kind == "histate":
        cache.histate.victims.check_offered()


@pytest.mark.parametrize("kind", ["stock", "histate"])
@pytest.mark.parametrize("skip_decode_lock", [False, True])
def test_decode_hold_with_and_without_its_state_lock(sglang_plugins, kind, skip_decode_lock):
    """SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK: after a running request's checkpoint, SGLang re-locks
    its node without the Mamba lock (unified_radix_cache.py:1300-1314), so the state it already
    copied may be evicted during decode. Through the real `checkpoint` and `release` paths: the
    held state is evictable exactly when the option is on, eviction frees it, and HiState ranks
    it as a checkpoint unit (H4) while the KV path stays pinned."""
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture
    from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures
    from sglang.test.mem_cache_utils import finish_req

    from ._sglang_kit import FULL_MAMBA_CONFIGS, assert_evict_frees_what_the_ledger_reports, assert_histate_invariants, kit_on_cpu

    kit = UnifiedRadixCacheFixtures()
    kit.cfg = FULL_MAMBA_CONFIGS[0]
    with kit_on_cpu(kind):
        cache, allocator, pool = build_fixture(kit.cfg)
    with envs.SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK.override(skip_decode_lock):
        req, _ = kit._make_inflight_req(cache, allocator, pool, list(range(1, 33)))
        cache.checkpoint(req, up_to=32)  # what a running request does at its prompt end
        node = cache.tree_core.node_by_id(req.last_node)
        assert node.component_data[ComponentType.FULL].lock_ref == 1
        assert node.component_data[ComponentType.MAMBA].lock_ref == (0 if skip_decode_lock else 1)
        assert cache.mamba_evictable_size() == (1 if skip_decode_lock else 0)
        assert_histate_invariants(cache)
        assert_evict_frees_what_the_ledger_reports(cache, allocator, pool)
        freed = cache.evict(EvictParams(num_tokens=32, mamba_num=1))
        assert (freed.mamba_num_evicted, freed.num_tokens_evicted) == ((1, 0) if skip_decode_lock else (0, 0))
        assert kit_match(cache, list(range(1, 33))) == (0 if skip_decode_lock else 32)
        finish_req(cache, req, 32)
        cache.sanity_check()
        assert_histate_invariants(cache)


def test_a_unit_met_locked_is_parked_and_offered_again_on_unlock(sglang_cpu):
    """R1 by construction: a walk that meets a locked unit parks it (the core's victim heap), and the
    lock release re-offers it although the unit set looks unchanged to the leaf-set hook (SGLang lowers
    `lock_ref` before it updates the sets). The lock is taken through the component alone, which
    notifies nobody (as FULL's path lock does to every ancestor of a locked node; `inc_lock_ref`
    updates the leaf sets of the anchor only, unified_tree_core.py:730-743).
    Tree: A (state) -> C (state), and B (state): A, an interior checkpoint, ranks lowest, then B."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, IncLockRefResult, MatchPrefixParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    pools = build_pools(64 * PAGE, 3)
    clock = ManualClock()
    cache = build_cache("histate", pools, clock=clock)
    driver = Driver(cache, pools)
    a, b = list(range(100, 100 + 4 * PAGE)), list(range(900, 900 + 4 * PAGE))
    for now, tokens, positions in ((0.5, b, [4 * PAGE]), (1.0, a + [5] * 4 * PAGE, [4 * PAGE, 8 * PAGE])):
        clock.now = now
        driver.serve(tokens, positions)
    clock.now = 1.0  # (the lookup below refreshes A: keep it the oldest)
    node_a = cache.tree_core.node_by_id(cache.match_prefix(MatchPrefixParams(key=key(a))).last_device_node)
    mamba = cache.components[ComponentType.MAMBA]
    receipt = mamba.acquire_component_lock(node_a, IncLockRefResult(node_id=node_a.id))
    clock.now = 60.0
    assert cache.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted == 1
    assert has_device_state(node_a) and core_of(node_a).is_parked  # met locked: parked, not lost
    assert kit_match(cache, b) == 0 and kit_match(cache, a + [5] * 4 * PAGE) == 8 * PAGE  # B went instead
    mamba.release_component_lock(node_a, receipt.to_dec_params())
    cache.histate.victims.check_offered()  # H4: offered again
    assert cache.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted == 1
    assert not has_device_state(node_a)  # the lowest unit goes first once it is free
    cache.sanity_check()


def kit_match(cache, tokens) -> int:
    from sglang.test.kits.unified_radix_cache.fixtures import match_prefix

    return match_prefix(cache, tokens).device_prefix_len


@pytest.mark.parametrize("page_size, chunk_tokens", [(256, 256), (16, 256)], ids=["page-256", "mamba2-chunk-256"])
def test_default_intervals_build_a_cache_on_a_256_token_state_grid(sglang_plugins, page_size, chunk_tokens):
    """R4: with a 256-token state grid (`--page-size 256`, or a model whose state chunk is 256)
    the default intervals (from 128 tokens) used to make cache construction raise, after the
    weights load, blaming --histate-intervals, which the user never set. The default off the grid
    is dropped now; the plan uses grid positions only."""
    publish_server_args(page_size=page_size, chunk_tokens=chunk_tokens)
    cache = build_cache("histate", build_pools(64 * 256, 8, page_size=page_size))
    assert cache.histate.grid_tokens == 256
    assert cache.histate.core_config.supported_intervals_pages == (1, 2, 4, 8, 16, 32, 64, 128)
    plan = cache.plan_checkpoints(0, 4000)
    assert plan and all(position % 256 == 0 for position in plan)
