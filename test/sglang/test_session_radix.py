"""`--enable-session-radix-cache` with HiState, on SGLang's own session bookkeeping.

SGLang's contract for the flag (arg_groups/fields/memory.py:86-89): "eviction consumes unreferenced
entries before referenced ones, and closing a session only dereferences its KV". The references are
SGLang's: a finished request of a session registers its leaf through `release_kv_cache` ->
`checkpoint_into_tree` -> `UnifiedSessionRefTracker.register_session_ref` (unified_radix_cache.py:
1329-1335), `release_radix_session` (the scheduler's close) drops them. Everything here runs those real
paths on SGLang's kit fixture (`build_fixture(..., enable_session_radix_cache=True)`: real pools, real
`Req`s), for stock `UnifiedRadixCache` and `HiStateRadixCache`; `sanity_check()` includes SGLang's own
session validation (`validate_session_state`).
"""
from __future__ import annotations

import dataclasses
import random

import pytest

from histate.core import GPU_BIT, Tier, UnitKind
from histate.sglang_plugin.core_nodes import core_of, has_device_state
from histate.sglang_plugin.eviction import tier_units

from ._sglang_kit import (FULL_MAMBA_CONFIGS, assert_evict_frees_what_the_ledger_reports, assert_histate_invariants,
                          kit_on_cpu)

FULL, MAMBA = 0, 2  # sglang ComponentType.FULL / MAMBA


class SessionRig:
    """A kit fixture with session references on, and finished turns through SGLang's release path."""

    def __init__(self, kind: str, mamba_slots: int = 8, kv_tokens: int = 256):
        from sglang.test.kits.unified_radix_cache.fixtures import build_fixture
        from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures

        self.kind = kind
        self.kit = UnifiedRadixCacheFixtures()
        self.kit.cfg = dataclasses.replace(FULL_MAMBA_CONFIGS[0], mamba_cache_size=mamba_slots, kv_size=kv_tokens)
        with kit_on_cpu(kind):
            self.cache, self.allocator, self.pool = build_fixture(self.kit.cfg, enable_session_radix_cache=True)
        assert self.cache.enable_session_radix_cache and self.cache.tree_core.enable_session_radix_cache

    def turn(self, tokens: list, session_id=None) -> bool:
        """One finished request (of `session_id`): the scheduler's allocation with eviction on shortage,
        then `release_kv_cache(checkpoint=True)`. False if eviction could not make room."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        from sglang.srt.mem_cache.common import release_kv_cache

        cache = self.cache
        if self.pool.mamba_allocator.available_size() < 1:
            cache.evict(EvictParams(num_tokens=0, mamba_num=1))
        if self.allocator.available_size() < len(tokens):
            cache.evict(EvictParams(num_tokens=len(tokens) - self.allocator.available_size()))
        if self.pool.mamba_allocator.available_size() < 1 or self.allocator.available_size() < len(tokens):
            return False
        req, _ = self.kit._make_inflight_req(cache, self.allocator, self.pool, tokens, allocated=True)
        req.session_id = session_id
        if session_id is not None:
            req.session_generation = cache.ensure_session_generation(session_id)
        req.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(req, cache, checkpoint=True)
        return True

    def matched(self, tokens: list) -> int:
        from sglang.test.kits.unified_radix_cache.fixtures import match_prefix

        return match_prefix(self.cache, tokens).device_prefix_len

    def kv_matched(self, tokens: list) -> int:
        from sglang.test.kits.unified_radix_cache.fixtures import match_prefix

        return match_prefix(self.cache, tokens).full_kv_hit_length

    def evict(self, num_tokens: int = 0, mamba_num: int = 0):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return self.cache.evict(EvictParams(num_tokens=num_tokens, mamba_num=mamba_num))

    def check(self) -> None:
        self.cache.sanity_check()
        # a deep copy: SGLang's session LRU predicate is a local lambda, which pickle cannot copy
        assert_evict_frees_what_the_ledger_reports(self.cache, self.allocator, self.pool, share_tensors=False)
        assert_histate_invariants(self.cache)


def _seq(start: int, n: int) -> list:
    return list(range(start, start + n))


@pytest.mark.parametrize("kind", ["stock", "histate"])
def test_a_session_prefix_is_evicted_after_every_unreferenced_one_and_never_pinned(sglang_plugins, kind):
    """Three finished requests of 32 tokens, the oldest of an open session: a state request for two takes
    the two unreferenced ones (the younger ones), and the session's state still goes when nothing else is
    left (a reference is an order, not a pin: the ledger promised it)."""
    rig = SessionRig(kind)
    a, b, c = _seq(1, 32), _seq(100, 32), _seq(200, 32)
    assert rig.turn(a, "s1") and rig.turn(b) and rig.turn(c)
    rig.check()
    assert rig.evict(mamba_num=2).mamba_num_evicted == 2
    assert (rig.matched(a), rig.matched(b), rig.matched(c)) == (32, 0, 0)
    rig.check()
    assert rig.cache.mamba_evictable_size() == 1  # the referenced state is evictable ...
    assert rig.evict(mamba_num=1).mamba_num_evicted == 1  # ... and eviction frees it
    assert rig.matched(a) == 0
    rig.check()


@pytest.mark.parametrize("kind", ["stock", "histate"])
def test_closing_a_session_makes_its_kv_an_ordinary_candidate_again(sglang_plugins, kind):
    """KV referenced through FULL only (the session's frontier has no state): P is the shared prefix of an
    unreferenced request (P+X) and a session's turn (P+Y). Once both leaves go, SGLang recedes the session's
    coverage to P, a leaf with KV and no state (components/base.py:314-327). U1, U2 come later. A KV request
    for U1's size takes U1, not the older P (referenced). After the session closes, P is the oldest
    candidate and goes first, before the younger U2 (HiState: its entry, re-ranked while referenced, is
    re-offered when the reference goes)."""
    rig = SessionRig(kind)
    p = _seq(1, 16)
    px, py = p + _seq(500, 16), p + _seq(600, 16)
    assert rig.turn(px) and rig.turn(py, "s2")
    assert rig.evict(num_tokens=32).num_tokens_evicted == 32  # both leaves (X, then the referenced Y)
    node_p = _node_starting(rig, p[0])
    assert rig.kv_matched(p) == 16 and not has_device_state(node_p) and not node_p.children
    assert node_p.component_data[FULL].session_ref == 1 and node_p.component_data[MAMBA].session_ref == 0
    u1, u2 = _seq(300, 16), _seq(400, 16)
    assert rig.turn(u1) and rig.turn(u2)
    rig.check()
    assert rig.evict(num_tokens=16).num_tokens_evicted == 16
    assert (rig.kv_matched(p), rig.kv_matched(u1), rig.kv_matched(u2)) == (16, 0, 16)
    rig.cache.release_radix_session("s2")
    assert node_p.component_data[FULL].session_ref == 0
    rig.check()
    assert rig.evict(num_tokens=16).num_tokens_evicted == 16
    assert (rig.kv_matched(p), rig.kv_matched(u2)) == (0, 16)
    rig.check()


def _node_starting(rig, token):
    [node] = [n for n in rig.cache.tree_core._node_arena.values()
              if n.parent is rig.cache.tree_core.root_node and n.key.token_ids[0] == token]
    return node


@pytest.mark.parametrize("kind, goes_after_close", [("stock", "c"), ("histate", "a")])
def test_a_closed_sessions_state_is_ranked_by_its_real_last_use(sglang_plugins, kind, goes_after_close):
    """A (the open session's turn, oldest), B, C unreferenced. The first state eviction takes B; the
    session closes; the next takes A on HiState (its real last use is the oldest; its heap entry, re-ranked
    while A was referenced, is re-offered when the reference goes), the lowest eq. 7 score by brute force.
    Stock SGLang takes C: its MAMBA LRU moves a state to the MRU end when its reference goes
    (`_refresh_session_partition`, components/base.py:204-211), as if it had just been used."""
    rig = SessionRig(kind)
    seqs = {"a": _seq(1, 32), "b": _seq(100, 32), "c": _seq(200, 32)}
    assert rig.turn(seqs["a"], "s1") and rig.turn(seqs["b"]) and rig.turn(seqs["c"])
    assert rig.evict(mamba_num=1).mamba_num_evicted == 1
    assert {k for k, s in seqs.items() if rig.matched(s)} == {"a", "c"}
    rig.cache.release_radix_session("s1")
    rig.check()
    if kind == "histate":
        assert _lowest_state_unit(rig) == _node_starting(rig, seqs[goes_after_close][0]).id
    assert rig.evict(mamba_num=1).mamba_num_evicted == 1
    assert {k for k, s in seqs.items() if rig.matched(s)} == {"a", "c"} - {goes_after_close}
    rig.check()


def _referenced(sg) -> bool:
    """HiState's reading of SGLang's counters: every unit of a node on a live session's path (FULL) or
    holding its frontier state (MAMBA)."""
    return sg.component_data[MAMBA].session_ref > 0 or sg.component_data[FULL].session_ref > 0


def _lowest(rig, takes) -> tuple:
    """Brute force over the device units a walk `takes` (node, unit): unreferenced before referenced, then
    the lowest eq. 7 score. (referenced, score, node id)."""
    state, core = rig.cache.histate.state, rig.cache.tree_core
    return min((_referenced(n), state.score(core_of(n), u, GPU_BIT), n.id)
               for n in core._node_arena.values() for u in tier_units(core_of(n), core, Tier.GPU) if takes(n, u))


def _lowest_state_unit(rig) -> int:
    """The node whose state a one-slot state request must free (a checkpoint, or a bundle with a state)."""
    return _lowest(rig, lambda n, u: u is UnitKind.CHECKPOINT or has_device_state(n))[2]


def test_a_state_the_session_moved_past_stays_referenced_while_on_its_live_path(sglang_plugins):
    """The session's next turn moves its frontier reference from the old state A to the new one (MAMBA's
    `_advance_session_coverage`, components/mamba.py:107-115) with no other change at A: the turn repeats
    R = A+X, whose state the tree already holds (no new checkpoint, no new node). Before, a state eviction
    (R pinned by a running request) took U, not the referenced A. After the turn A holds no frontier
    reference, but it is still on the session's path (FULL's coverage) and still a resume point inside its
    context, so HiState keeps ranking it after every unreferenced unit: the next state eviction takes V,
    newer than A. Once the session closes, A is an ordinary checkpoint, older than R: it goes next."""
    rig = SessionRig("histate")
    a = _seq(1, 32)
    r, u, v = a + _seq(700, 16), _seq(300, 32), _seq(400, 32)
    assert rig.turn(a, "s1") and rig.turn(r) and rig.turn(u)
    node_a, node_u = _node_starting(rig, a[0]), _node_starting(rig, u[0])
    node_r = rig.cache.tree_core.node_by_id(_device_node(rig, r))
    assert node_a.children and node_a.component_data[MAMBA].session_ref == 1
    lock = rig.cache.inc_lock_ref(node_r.id)  # a running request holds R
    assert _lowest_state_unit(rig) == node_u.id
    assert rig.evict(mamba_num=1).mamba_num_evicted == 1 and rig.matched(u) == 0
    rig.cache.dec_lock_ref(node_r.id, lock.to_dec_params())
    assert rig.turn(v) and rig.turn(r, "s1")
    node_v = _node_starting(rig, v[0])
    assert node_a.component_data[MAMBA].session_ref == 0 and node_r.component_data[MAMBA].session_ref == 1
    assert node_a.component_data[FULL].session_ref == 1  # on the path to the session's leaf R
    rig.check()
    assert _lowest_state_unit(rig) == node_v.id
    assert rig.evict(mamba_num=1).mamba_num_evicted == 1
    assert not has_device_state(node_v) and has_device_state(node_a)
    rig.cache.release_radix_session("s1")
    assert node_a.component_data[FULL].session_ref == 0
    rig.check()
    assert _lowest_state_unit(rig) == node_a.id
    assert rig.evict(mamba_num=1).mamba_num_evicted == 1
    assert not has_device_state(node_a) and (rig.kv_matched(a), rig.matched(r)) == (32, 48)
    rig.check()


def _device_node(rig, tokens):
    from sglang.test.kits.unified_radix_cache.fixtures import match_prefix

    return match_prefix(rig.cache, tokens).last_device_node


def _has_device_kv(rig, node_id) -> bool:
    node = rig.cache.tree_core._node_arena.get(node_id)
    return node is not None and node.component_data[FULL].value is not None


@pytest.mark.parametrize("kind", ["stock", "histate"])
def test_session_fuzz_every_eviction_is_the_lowest_unit_after_the_unreferenced(sglang_plugins, kind):
    """Seeded sessions (open, turns that append or rewind, close), plain requests and forks, running requests
    pinning prefixes, single-unit evictions of states and of KV, on a small pool. After every step: SGLang's
    `sanity_check` (session bookkeeping included), the ledger contract (evict(n) frees what the ledgers
    report: a reference never blocks eviction) and H4. On HiState every eviction is the brute-force minimum
    of (referenced, eq. 7 score) over the units that walk can take."""
    taken = {True: 0, False: 0}
    for seed in range(6):
        rng = random.Random(seed)
        rig = SessionRig(kind, mamba_slots=10, kv_tokens=320)
        open_sessions: dict = {}
        chains: list = []
        held: list = []
        next_id = [0]

        def fresh(n):
            next_id[0] += 1
            return _seq(1000 * next_id[0], n)

        for step in range(30):
            op = rng.random()
            if op < 0.3:  # a session's turn
                if not open_sessions or rng.random() < 0.3:
                    open_sessions[f"s{seed}-{step}"] = []
                sid = rng.choice(sorted(open_sessions))
                ctx = open_sessions[sid]
                if ctx and rng.random() < 0.25:
                    ctx = ctx[:rng.randrange(1, len(ctx) + 1)]  # rewind / edit
                ctx = ctx + fresh(rng.randrange(4, 20))
                if rig.turn(ctx, sid):
                    open_sessions[sid] = ctx
                    chains.append(ctx)
            elif op < 0.45:  # a request outside any session, often a fork
                base = rng.choice(chains)[:rng.randrange(1, 40)] if chains and rng.random() < 0.6 else []
                tokens = base + fresh(rng.randrange(4, 20))
                if rig.turn(tokens):
                    chains.append(tokens)
            elif op < 0.55 and open_sessions:  # a session closes (or times out)
                sid = rng.choice(sorted(open_sessions))
                del open_sessions[sid]
                rig.cache.release_radix_session(sid)
            elif op < 0.65 and chains:  # a running request pins its prefix (or lets one go)
                node_id = _device_node(rig, rng.choice(chains))
                if not rig.cache.tree_core.is_root(node_id):
                    held.append((node_id, rig.cache.inc_lock_ref(node_id)))
            elif op < 0.72 and held:
                node_id, receipt = held.pop(rng.randrange(len(held)))
                rig.cache.dec_lock_ref(node_id, receipt.to_dec_params())
            elif op < 0.86:  # a state request for one slot
                if kind == "histate" and rig.cache.mamba_evictable_size():
                    referenced, _, expected = _lowest(rig, lambda n, u: u is UnitKind.CHECKPOINT or has_device_state(n))
                    assert rig.evict(mamba_num=1).mamba_num_evicted == 1
                    node = rig.cache.tree_core._node_arena.get(expected)
                    assert node is None or not has_device_state(node), f"seed {seed} step {step}"
                    taken[referenced] += 1
                else:
                    rig.evict(mamba_num=1)
            else:  # a KV request for one token: one bundle
                expected = (_lowest(rig, lambda n, u: u is UnitKind.BUNDLE)[2]
                            if kind == "histate" and rig.cache.full_evictable_size() else None)
                rig.evict(num_tokens=1)
                if expected is not None:
                    assert not _has_device_kv(rig, expected), f"seed {seed} step {step}"
            rig.check()
        for node_id, receipt in held:
            rig.cache.dec_lock_ref(node_id, receipt.to_dec_params())
        rig.check()
    if kind == "histate":
        assert taken[True] and taken[False]  # both orders were exercised


@pytest.mark.parametrize("kind", ["stock", "histate"])
def test_host_eviction_takes_unreferenced_prefixes_first_too(sglang_plugins, kind):
    """SGLang applies the order on the host tier as well (FULL's host leaf heap, MAMBA's host LRU partition,
    components/full.py:250-280, mamba.py:1012-1069). A, B, C (oldest first) are backed up to the host by
    SGLang's write-through and demoted off the device; a session finished A (`register_session_ref`, what
    the finished turn's insert calls, with SGLang's `Req`). A host KV request for one prefix takes B, a host
    state request then takes C, and the next one A's state (host RAM is never promised away)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from sglang_cpu.hicache import TieredDriver, build_hicache, request
    from sglang_cpu.pools import PAGE, ManualClock, build_pools

    pools = build_pools(64 * PAGE, 8)
    clock = ManualClock()
    cache = build_hicache(kind, pools, params_fields={"enable_session_radix_cache": True},
                          **({"clock": clock} if kind == "histate" else {}))
    driver = TieredDriver(cache, pools)
    seqs = {name: list(range(base, base + 4 * PAGE)) for name, base in (("a", 1000), ("b", 2000), ("c", 3000))}
    nodes = {}
    for now, name in enumerate("abc", start=1):
        clock.now = float(now)
        driver.serve(seqs[name], [len(seqs[name])])
        nodes[name] = cache.tree_core.node_by_id(driver.match(seqs[name]).last_device_node)
    turn = request("a-turn", seqs["a"])
    turn.session_id, turn.session_generation = "s1", cache.ensure_session_generation("s1")
    cache.session_refs.register_session_ref(turn, leaf=nodes["a"].id)
    assert nodes["a"].component_data[ComponentType.MAMBA].session_ref == 1
    clock.now = 10.0
    cache.evict(EvictParams(num_tokens=cache.full_evictable_size()))  # demote: the host copies stay
    assert all(n.evicted and n.backuped for n in nodes.values())
    assert {name for name, n in nodes.items() if n in cache.tree_core.evictable_host_leaves} == set("abc")
    cache.sanity_check()

    def on_host(kind_of):
        return {name for name, n in nodes.items()
                if n.id in cache.tree_core._node_arena and n.component_data[kind_of].host_value is not None}

    if kind == "histate":
        assert _lowest_host(cache, lambda n, u: u is UnitKind.BUNDLE) == nodes["b"].id
    assert cache.evict_host(4 * PAGE, ComponentType.FULL) >= 4 * PAGE
    assert on_host(ComponentType.FULL) == {"a", "c"}
    assert cache.evict_host(1, ComponentType.MAMBA) == 1
    assert on_host(ComponentType.MAMBA) == {"a"}
    assert cache.evict_host(1, ComponentType.MAMBA) == 1
    assert on_host(ComponentType.MAMBA) == set()
    cache.sanity_check()
    if kind == "histate":
        cache.histate.victims.check_offered()


def _lowest_host(cache, takes) -> int:
    from histate.core import CPU_BIT

    state, core = cache.histate.state, cache.tree_core
    return min((_referenced(n), state.score(core_of(n), u, CPU_BIT), n.id)
               for n in core._node_arena.values() for u in tier_units(core_of(n), core, Tier.CPU) if takes(n, u))[2]


def test_a_session_resume_point_is_homed_to_ssd_only_once_released(sglang_plugins, tmp_path):
    """Asymmetric tiering homes a historical checkpoint (its node has a child) to SSD alone once its SSD
    copy is acknowledged. A session's frontier state is where that session resumes: while referenced it
    keeps its device and host copies; the step after the session closes it is homed like the others."""
    from histate.core import CPU_BIT, SSD_BIT
    from histate.sglang_plugin.config import resolve_config
    from histate.sglang_plugin.server_settings import storage_extra_config

    from sglang_cpu.hicache import build_hicache, drain_backups, request
    from sglang_cpu.pools import PAGE, Driver, ManualClock, build_pools

    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file",
                             "ssd_size_bytes": "64MiB"}, {})
    pools = build_pools(64 * PAGE, 8)
    cache = build_hicache("histate", pools, histate_config=config, storage_extra=storage_extra_config(None, config),
                          clock=ManualClock(), params_fields={"enable_session_radix_cache": True})
    driver = Driver(cache, pools)
    tokens = list(range(500, 500 + 16 * PAGE))
    driver.serve(tokens, [4 * PAGE, 8 * PAGE, 16 * PAGE])
    first, middle, terminal = (cache.tree_core.node_by_id(driver.match(tokens[:n * PAGE]).last_device_node)
                               for n in (4, 8, 16))
    turn = request("s-turn", tokens[:8 * PAGE])  # the session's last turn ended at 8 pages
    turn.session_id, turn.session_generation = "s", cache.ensure_session_generation("s")
    cache.session_refs.register_session_ref(turn, leaf=middle.id)
    assert middle.component_data[MAMBA].session_ref == 1
    drain_backups(cache)
    cache.sanity_check()
    assert core_of(first).ckpt_mask == SSD_BIT  # historical: homed
    assert core_of(middle).ckpt_mask == GPU_BIT | CPU_BIT | SSD_BIT  # historical but referenced: kept
    assert core_of(terminal).ckpt_mask & (GPU_BIT | SSD_BIT) == GPU_BIT | SSD_BIT
    cache.release_radix_session("s")
    cache.check_hicache_events()  # the next scheduler step
    assert core_of(middle).ckpt_mask == SSD_BIT
    cache.sanity_check()
    cache.histate.victims.check_offered()


def test_the_ssd_ranks_a_live_sessions_path_after_unreferenced_units(sglang_plugins, tmp_path):
    """SGLang's sessions stop at the host; HiState reads them on its own SSD tier too. P (t=1) and Q (t=2)
    each leave a historical checkpoint homed to SSD and a terminal one written through. With P's end
    registered by session "s", the lowest SSD unit is on Q although Q is newer (eq. 7 alone would take P's
    first); once "s" closes, P's again."""
    from histate.sglang_plugin.config import resolve_config
    from histate.sglang_plugin.server_settings import storage_extra_config

    from sglang_cpu.hicache import build_hicache, drain_backups, request
    from sglang_cpu.pools import PAGE, Driver, ManualClock, build_pools

    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file",
                             "ssd_size_bytes": "64MiB"}, {})
    pools = build_pools(64 * PAGE, 8)
    clock = ManualClock()
    cache = build_hicache("histate", pools, histate_config=config, storage_extra=storage_extra_config(None, config),
                          clock=clock, params_fields={"enable_session_radix_cache": True})
    driver = Driver(cache, pools)
    p, q = list(range(500, 500 + 8 * PAGE)), list(range(9000, 9000 + 8 * PAGE))
    clock.now = 1.0
    driver.serve(p, [4 * PAGE, 8 * PAGE])
    p_end = cache.tree_core.node_by_id(driver.match(p).last_device_node)  # a match refreshes: before Q
    clock.now = 2.0
    driver.serve(q, [4 * PAGE, 8 * PAGE])
    turn = request("s-turn", p)
    turn.session_id, turn.session_generation = "s", cache.ensure_session_generation("s")
    cache.session_refs.register_session_ref(turn, leaf=p_end.id)
    drain_backups(cache)
    cache.check_hicache_events()
    p_nodes = {id(core_of(sg)) for sg in _path_nodes(cache, p_end)}

    def lowest_on_p() -> bool:
        (node, _unit), *_ = cache.histate.victims.peek(Tier.SSD, lambda n, u: True, lambda n, u: True)
        return id(node) in p_nodes

    assert not lowest_on_p()
    cache.release_radix_session("s")
    assert lowest_on_p()
    cache.sanity_check()
    cache.histate.victims.check_offered()


def _path_nodes(cache, sg) -> list:
    nodes = []
    while sg is not None and not cache.tree_core.is_root(sg.id):
        nodes.append(sg)
        sg = sg.parent
    return nodes


def test_sglang_builds_histate_with_session_references(sglang_plugins):
    """The scheduler's construction path (`create_tree_cache` with the flag in `CacheInitParams`, as
    kv_cache_builder.py:412 sets it) gives HiState's cache with SGLang's session tracking on, and passes
    SGLang's own check that the flag found a cache that tracks sessions (registry.py:252-258)."""
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache

    from histate.sglang_plugin.tree_cache import HiStateRadixCache
    from histate.sglang_plugin.tree_core import HiStateTreeCore

    from sglang_cpu.pools import build_pools, cache_params, publish_server_args

    server_args = publish_server_args(radix_cache_backend="histate", enable_session_radix_cache=True)
    params = cache_params(build_pools(1024, 8), enable_session_radix_cache=True)
    cache = create_tree_cache(TreeCacheBuildContext(
        server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=True,
        enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None, model_config=None,
        tp_size=1, tp_rank=0, tp_group=None))
    assert type(cache) is HiStateRadixCache and type(cache.tree_core) is HiStateTreeCore
    assert cache.enable_session_radix_cache and cache.tree_core.enable_session_radix_cache
    assert cache.session_refs.enable_session_radix_cache
