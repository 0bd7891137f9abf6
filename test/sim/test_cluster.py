"""Cluster mode (sim/cluster.py, router.py, l3.py): expectations worked out by hand from the rules
in those modules' docstrings, not read back from the code."""
import hashlib
import math

import pytest

from histate.core import MISS_REASONS
from histate.sim.cluster import ClusterConfig, replay_cluster
from histate.sim.l3 import KV, STATE, L3Store, L3StoreConfig
from histate.sim.replay import GiB, ReplayConfig, replay
from histate.sim.request import Request, Session, Workload, WorkloadStats
from histate.sim.workloads import default_workload

TIGHT = ReplayConfig(gpu_cache_bytes=2 * GiB, cpu_cache_bytes=4 * GiB, ssd_cache_bytes=12 * GiB, max_live_sessions=8,
                     stagger_s=0.0)


def test_one_server_without_l3_is_the_single_server_replay_request_by_request():
    """Same arrivals, first tokens, completions and reuse for every request (bug it catches: any
    reordering of engine calls in the multi-engine loop, e.g. arrivals before same-time events)."""
    w = default_workload(seed=0)
    for policy in ("histate", "sglang-hicache", "vllm-marconi"):
        single = replay(w, policy, TIGHT)
        cluster = replay_cluster(w, policy, TIGHT, ClusterConfig(num_servers=1))
        key = lambda r: (r.uid, r.arrival_s, r.first_token_s, r.completion_s, r.reused_tokens, r.kv_hit_tokens,
                         tuple(r.miss_tokens.items()))
        assert [key(r) for r in cluster.records] == [key(r) for r in single.records]


# --- routing ---------------------------------------------------------------------------------------

def _session(sid, first_key, num_requests, gap_s, subagents=(), parent=None, spawn=-1):
    reqs = []
    for i in range(num_requests):
        pages = 4 + 2 * i
        reqs.append(Request(uid=0, session_id=sid, index=i, input_num_tokens=pages * 64, output_num_tokens=2,
                            page_keys=tuple(range(first_key, first_key + pages)), gap_before_s=gap_s,
                            parent_session_id=parent))
    return Session(sid, tuple(reqs), parent_session_id=parent, spawn_after_index=spawn, subagents=tuple(subagents))


def _renumber(sessions):
    """Give every request a dense uid (Request is frozen: rebuild)."""
    uid = 0

    def fix(s):
        nonlocal uid
        reqs = []
        for r in s.requests:
            reqs.append(Request(uid, r.session_id, r.index, r.input_num_tokens, r.output_num_tokens, r.page_keys,
                                r.gap_before_s, parent_session_id=r.parent_session_id))
            uid += 1
        return Session(s.session_id, tuple(reqs), s.parent_session_id, s.spawn_after_index,
                       subagents=tuple(fix(c) for c in s.subagents))
    return [fix(s) for s in sessions]


def _workload(sessions):
    sessions = _renumber(sessions)
    n = sum(len(x.requests) for root in sessions for x in root.iter_sessions())
    return Workload("hand", sessions, WorkloadStats(sessions=len(sessions), requests=n))


def _root_of(workload):
    return {x.session_id: root.session_id for root in workload.sessions for x in root.iter_sessions()}


def test_manual_routing_sticks_each_root_and_a_failure_moves_only_the_dead_servers_sessions():
    """Ten roots of 6 requests 30 s apart, root r0 with a subagent; 3 servers; server 1 dies at 75 s.
    Before 75 s every request of a root (subagent included) is on one server; afterwards the roots
    that were not on server 1 stay where they were, and those on server 1 each settle on one other
    server. (Bugs caught: routing by session id instead of root id -- the subagent would land by its
    own hash; re-placing every key after a removal -- roots off server 1 would move.)"""
    child = _session("r0-sub", 10_000, 2, 1.0, parent="r0", spawn=0)
    roots = [_session(f"r{i}", 1000 * (i + 1), 6, 30.0, subagents=[child] if i == 0 else ()) for i in range(10)]
    w = _workload(roots)
    config = ReplayConfig(max_live_sessions=10, stagger_s=0.0)
    run = replay_cluster(w, "sglang-hicache", config, ClusterConfig(num_servers=3, fail_server=(1, 75.0)))
    root_of = _root_of(w)
    before, after = {}, {}
    for r in run.records:
        side = before if r.arrival_s < 75.0 else after
        side.setdefault(root_of[r.session_id], set()).add(run.server_of_uid[r.uid])
    assert all(len(s) == 1 for s in before.values()), before
    on_dead = {root for root, s in before.items() if s == {1}}
    assert on_dead and len(on_dead) < 10  # the hash spreads ten roots over three servers
    for root, servers in after.items():
        if root in on_dead:
            assert len(servers) == 1 and 1 not in servers
        else:
            assert servers == before[root]
    assert sorted(run.moved_roots) == sorted(on_dead)


def test_manual_router_places_a_new_key_by_rendezvous_hash_over_live_servers():
    """The owner of a key is the live server with the largest sha1(seed, key, server) (restated here)."""
    from histate.sim.router import ManualRouter

    def owner(key, live):
        return max(live, key=lambda s: hashlib.sha1(f"0\x00{key}\x00{s}".encode()).digest())
    router = ManualRouter(4, seed=0)
    for key in ("a", "b", "c", "d", "e"):
        assert router.route(key, (), [0] * 4) == owner(key, [0, 1, 2, 3])
    router.remove(2)
    for key in ("a", "b", "c", "d", "e"):
        first = owner(key, [0, 1, 2, 3])
        assert router.route(key, (), [0] * 4) == (first if first != 2 else owner(key, [0, 1, 3]))


# --- the L3 store ----------------------------------------------------------------------------------

def test_l3_eviction_order_lru_with_leases_and_soft_pins():
    """Capacity 100 B, watermark 0.9, ratio 0.05, objects of 20 B.
    t0 put A, t1 put B, t2 get A (lease to 12), t3 put C, t4 put D, t5 re-put B (B most recent):
    LRU order A C D B. t6 put E: 100 B > 90 -> evict ceil(0.05 x 5) = 1; A is leased, so C goes.
    t20 put F: A D B E F = 100 B > 90 -> evict 1: A's lease expired, A goes.
    Then a pinned P: t30 put P (pinned), D B E F P = 100 -> evict 1 = D (unpinned LRU).
    (Bugs caught: evicting by insertion order, ignoring the lease, ignoring the pin.)"""
    store = L3Store(L3StoreConfig(100, 0.9, 0.05, lease_ttl_s=10.0))
    key = lambda name: (KV, name)
    store.put(key("A"), 20, 0.0)
    store.put(key("B"), 20, 1.0)
    store.objects[key("A")]  # present
    store.put((STATE, "A"), 0, 1.5)  # zero-size state of A: lets get() read the bundle [A]
    assert store.get(["A"], 1, 2.0) == 20
    store.put(key("C"), 20, 3.0)
    store.put(key("D"), 20, 4.0)
    store.put(key("B"), 20, 5.0)
    store.put(key("E"), 20, 6.0)
    assert [k[1] for k in store.objects if k[0] == KV] == ["A", "D", "B", "E"]
    store.put(key("F"), 20, 20.0)
    assert [k[1] for k in store.objects if k[0] == KV] == ["D", "B", "E", "F"]
    store.put(key("P"), 20, 30.0, soft_pin=True)
    assert [k[1] for k in store.objects if k[0] == KV] == ["B", "E", "F", "P"]


def test_l3_soft_pinned_objects_go_last_or_never():
    """Five 20 B objects, the oldest pinned: the first eviction takes the oldest unpinned one. With
    allow_evict_soft_pinned_objects=False and only pinned objects left, a put that does not fit is
    rejected."""
    store = L3Store(L3StoreConfig(100, 0.9, 0.05))
    store.put((KV, 0), 20, 0.0, soft_pin=True)
    for i in range(1, 5):
        store.put((KV, i), 20, float(i))
    assert not store.contains((KV, 1)) and store.contains((KV, 0))
    strict = L3Store(L3StoreConfig(40, 1.0, 0.05, allow_evict_soft_pinned_objects=False))
    strict.put((KV, 0), 20, 0.0, soft_pin=True)
    strict.put((KV, 1), 20, 1.0, soft_pin=True)
    assert not strict.put((KV, 2), 20, 2.0)
    assert strict.stats.puts_rejected == 1


def test_l3_read_rule_needs_every_kv_page_and_the_state_at_the_end():
    """KV 0, 1, 3 and states at 1 and 3: restorable 2 pages (the state at page 3 has a KV hole at 2).
    Adding KV 2 makes it 4. Removing the state at 1 with KV 2 still missing makes it 0."""
    store = L3Store(L3StoreConfig(10**6))
    for k in (0, 1, 3):
        store.put((KV, k), 1, 0.0)
    store.put((STATE, 1), 1, 0.0)
    store.put((STATE, 3), 1, 0.0)
    assert store.restorable_pages([0, 1, 2, 3]) == 2
    store.put((KV, 2), 1, 0.0)
    assert store.restorable_pages([0, 1, 2, 3]) == 4
    other = L3Store(L3StoreConfig(10**6))
    for k in (0, 1, 3):
        other.put((KV, k), 1, 0.0)
    other.put((STATE, 3), 1, 0.0)
    assert other.restorable_pages([0, 1, 2, 3]) == 0


# --- failover through L3 ---------------------------------------------------------------------------

def _one_moving_session():
    """Session "s": a 10-page prompt (640 tokens, 1 output token) at t = 0, then 100 s later a
    12-page prompt extending it (keys 0..11). A second session "t" keeps the other server busy."""
    s = Session("s", (Request(0, "s", 0, 640, 1, tuple(range(10)), 0.0),
                      Request(1, "s", 1, 768, 1, tuple(range(12)), 100.0)))
    t = Session("t", (Request(2, "t", 0, 640, 1, tuple(range(500, 510)), 0.0),
                      Request(3, "t", 1, 640, 1, tuple(range(500, 510)), 100.0)))
    return Workload("failover", [s, t], WorkloadStats(sessions=2, requests=4))


@pytest.mark.parametrize("policy", ["histate", "sglang-hicache"])
def test_a_moved_session_restores_its_old_servers_l3_pages(policy):
    """Request 0 of "s" computes its 10 pages on server K; at finish K writes KV pages 0..9 and the
    state at page 9 to L3 (terminal bundle / write-through). K dies at 50 s. Request 1 lands on the
    other server, whose own caches never saw "s": it restores exactly 10 pages = 640 tokens from L3,
    and computes the 2 new pages. (Bug caught: an off-by-one in the read rule's state key, or a
    restore that counts only KV.)"""
    w = _one_moving_session()
    config = ReplayConfig(max_live_sessions=2, stagger_s=0.0)
    probe = replay_cluster(w, policy, config, ClusterConfig(num_servers=2))
    k = probe.server_of_uid[0]
    run = replay_cluster(w, policy, config, ClusterConfig(num_servers=2, l3_store=L3StoreConfig(10**12),
                                                          fail_server=(k, 50.0)))
    assert run.server_of_uid[0] == k and run.server_of_uid[1] != k
    by_uid = {r.uid: r for r in run.records}
    assert run.l3_hit_tokens_by_uid[1] == 640
    assert by_uid[1].reused_tokens == 640
    assert 1 in run.first_after_move_uids
    # miss reasons count the L3 pages as reused: only the 2 new pages are left, and no request had them
    assert by_uid[1].miss_tokens == {**dict.fromkeys(MISS_REASONS, 0), "no_prefix": 128}


def test_without_l3_the_moved_session_recomputes():
    """Same failover with --l3-size-gb 0: nothing to restore on the new server, reuse 0 tokens."""
    w = _one_moving_session()
    config = ReplayConfig(max_live_sessions=2, stagger_s=0.0)
    k = replay_cluster(w, "histate", config, ClusterConfig(num_servers=2)).server_of_uid[0]
    run = replay_cluster(w, "histate", config, ClusterConfig(num_servers=2, fail_server=(k, 50.0)))
    by_uid = {r.uid: r for r in run.records}
    assert by_uid[1].reused_tokens == 0 and run.l3_hit_tokens_by_uid[1] == 0
    with_l3 = replay_cluster(w, "histate", config, ClusterConfig(num_servers=2, l3_store=L3StoreConfig(10**12),
                                                                 fail_server=(k, 50.0)))
    assert {r.uid: r for r in with_l3.records}[1].ttft_s < by_uid[1].ttft_s


def test_policies_without_a_real_l3_path_get_none():
    w = _one_moving_session()
    config = ReplayConfig(max_live_sessions=2, stagger_s=0.0)
    run = replay_cluster(w, "vllm-marconi", config, ClusterConfig(num_servers=2, l3_store=L3StoreConfig(10**12)))
    assert run.l3_stats is None and not run.has_l3 and sum(run.l3_hit_tokens_by_uid.values()) == 0
    assert math.isfinite(max(r.ttft_s for r in run.records))


# --- fixed placement and the failure after the K-th completion (benchmark/cluster_sim_vs_live.py) ---

def test_fixed_router_replays_each_requests_recorded_worker_while_it_lives():
    """Request placement 7 -> 1, 8 -> 0 for key a (recorded workers (0, 1)): request 7 goes to 1 although
    the key's first worker is 0 (a live retry or failover did that), request 8 to 0, an unrecorded
    request to the key's first live worker, 0; once 1 is dead, request 7 follows the key's fallback,
    0. (Bug caught: routing by key alone, which puts request 7 on 0.)"""
    from histate.sim.router import make_router

    router = make_router("fixed", 2, seed=0, placement={"a": (0, 1)}, request_placement={7: 1, 8: 0})
    assert router.route("a", (), [0, 0], uid=7) == 1
    assert router.route("a", (), [0, 0], uid=8) == 0
    assert router.route("a", (), [0, 0], uid=9) == 0
    router.remove(1)
    assert router.route("a", (), [0, 0], uid=7) == 0


def test_fixed_router_follows_the_recorded_workers_then_falls_back_to_manual():
    """Placement a -> 1, b -> (0, 2) on 3 servers. a goes to 1, b to 0; server 0 dies: b goes to its
    next recorded worker, 2 (not wherever the hash puts it); server 1 dies: a, with no recorded
    worker left, goes to the only live one, 2. An unrecorded key c is placed by the manual rule
    (rendezvous sha1(seed, key, server), restated). (Bugs caught: ignoring the recorded order after a
    failure; refusing unrecorded keys.)"""
    from histate.sim.router import make_router

    router = make_router("fixed", 3, seed=0, placement={"a": 1, "b": (0, 2)})
    assert router.route("a", (), [0] * 3) == 1
    assert router.route("b", (), [0] * 3) == 0
    owner = max([0, 1, 2], key=lambda s: hashlib.sha1(f"0\x00c\x00{s}".encode()).digest())
    assert router.route("c", (), [0] * 3) == owner
    router.remove(0)
    assert router.route("b", (), [0] * 3) == 2
    assert router.route("a", (), [0] * 3) == 1
    router.remove(1)
    assert router.route("a", (), [0] * 3) == 2
    with pytest.raises(ValueError):
        make_router("fixed", 2, placement={"a": 2})
    with pytest.raises(ValueError):
        make_router("manual", 2, placement={"a": 1})


def test_failure_after_the_kth_completed_request_moves_the_dead_servers_root():
    """Roots r0 (requests 30 s apart) on server 0 and r1 (40 s apart) on server 1, 3 requests each,
    distinct keys. Completions in time order: r0#0 (~30 s), r1#0 (~40 s), r0#1 (~60 s) -- the 3rd, so
    server 0 dies when r0#1 completes. r0#2 (~90 s) then runs on server 1 and, without L3, reuses
    nothing (server 1 never saw r0's keys); r1 stays on 1 and keeps reusing its own pages.
    (Bugs caught: counting arrivals instead of completions; failing at time 0 or never.)"""
    r0 = _session("r0", 1000, 3, 30.0)
    r1 = _session("r1", 2000, 3, 40.0)
    w = _workload([r0, r1])
    config = ReplayConfig(model="tiny-qwen3.5", max_live_sessions=2, stagger_s=0.0)
    cluster = ClusterConfig(num_servers=2, router="fixed", placement={"r0": 0, "r1": 1}, fail_after_requests=(0, 3))
    run = replay_cluster(w, "histate", config, cluster)
    by_uid = {r.uid: r for r in run.records}
    # uids: r0 -> 0, 1, 2; r1 -> 3, 4, 5 (_renumber)
    assert run.servers[0].failed_at_s == by_uid[1].completion_s
    assert 60 < run.servers[0].failed_at_s < 61
    assert [run.server_of_uid[u] for u in range(6)] == [0, 0, 1, 1, 1, 1]
    assert run.moved_roots == ["r0"] and run.first_after_move_uids == [2]
    assert by_uid[2].reused_tokens == 0
    assert by_uid[4].reused_tokens > 0 and by_uid[1].reused_tokens > 0
    assert run.servers[0].requests == 2 and run.servers[1].requests == 4


def test_fleet_live_session_limit_admits_one_root_at_a_time():
    """max_live_sessions_total=1 on 2 servers: the second root's first request arrives only after the
    first root's last request completed (30 s gap after its release), whatever max_live_sessions says."""
    w = _workload([_session("r0", 1000, 2, 30.0), _session("r1", 2000, 2, 30.0)])
    config = ReplayConfig(model="tiny-qwen3.5", max_live_sessions=4, stagger_s=0.0)
    run = replay_cluster(w, "histate", config, ClusterConfig(num_servers=2, max_live_sessions_total=1))
    first, second = sorted({r.session_id for r in run.records}, key=lambda s: min(
        r.arrival_s for r in run.records if r.session_id == s))
    last_done = max(r.completion_s for r in run.records if r.session_id == first)
    assert min(r.arrival_s for r in run.records if r.session_id == second) == pytest.approx(last_done + 30.0)


def test_l3_is_asked_only_past_what_the_reader_holds():
    """KV of page 0 evicted from L3, pages 1-3 and the state at page 3 present: a reader holding page 0
    itself restores 4 pages; one holding nothing restores none (the run of KV breaks at page 0).
    (Bug caught: requiring L3 to hold the reader's own leading pages, which neither server does.)"""
    from histate.sim.l3 import KV, STATE, L3Store, L3StoreConfig

    store = L3Store(L3StoreConfig(10**9))
    for k in (1, 2, 3):
        store.put((KV, k), 10, 0.0)
    store.put((STATE, 3), 10, 0.0)
    assert store.restorable_pages([0, 1, 2, 3]) == 0
    assert store.restorable_pages([0, 1, 2, 3], held_pages=1) == 4
    assert store.restorable_pages([0, 1, 2, 3], held_pages=4) == 4


# --- what leaves L3: the servers' eq. 7 ledgers (core/l3_ledger.py) vs the master's LRU alone ------

def _leading_pages_case():
    """Session "s" (server 0) writes pages 0..9 + state at t ~ 0 and pages 10, 11 + state at t ~ 10;
    session "t" (server 1) then writes six unrelated 20-page bundles 30 s apart (its prompt is
    rewritten each turn: distinct keys). Server 0 dies at 300 s; s's third turn (pages 0..13) arrives at
    ~410 s on server 1."""
    s = Session("s", (Request(0, "s", 0, 640, 1, tuple(range(10)), 0.0),
                      Request(1, "s", 1, 768, 1, tuple(range(12)), 10.0),
                      Request(2, "s", 2, 896, 1, tuple(range(14)), 400.0)))
    t = Session("t", tuple(Request(3 + i, "t", i, 1280, 1, tuple(range(1000 * (i + 1), 1000 * (i + 1) + 20)),
                                   30.0 if i else 5.0) for i in range(6)))
    return Workload("leading-pages", [s, t], WorkloadStats(sessions=2, requests=9))


@pytest.mark.parametrize("ranking", ["eq7", "lru"])
def test_eq7_ledgers_keep_the_leading_pages_the_masters_lru_drops(ranking):
    """A page is 2 MiB (64 tokens) and a state 51.5 MB in this model, so s's two bundles take 128 MB
    and each of t's 93.4 MB; the store holds 400 MB (watermark 360 MB). t alone writes 560 MB.
    * Master's LRU alone: s's pages 0..9 are the store's oldest objects (written once, never read
      back by server 0, which holds them) and leave first, so after the failure s's third turn
      restores nothing: it recomputes all 14 pages.
    * eq. 7 ledgers, 0.85 x 400 MB / 2 = 170 MB a server: server 1 keeps only its newest t bundle
      (two are 187 MB) and deletes the older ones itself; server 0's 128 MB fit. The store never
      passes its watermark, the master evicts nothing, and s's third turn restores its turn-2 bundle
      from L3: 12 pages = 768 tokens.
    (Bugs caught: ledger deletes not applied to the store; a ledger that deletes another
    session's leading pages; a budget that is the whole capacity per server.)"""
    w = _leading_pages_case()
    config = ReplayConfig(max_live_sessions=2, stagger_s=0.0)
    run = replay_cluster(w, "histate", config, ClusterConfig(
        num_servers=2, router="fixed", placement={"s": 0, "t": 1}, l3_store=L3StoreConfig(400 * 10**6),
        l3_ranking=ranking, fail_server=(0, 300.0)))
    assert run.server_of_uid[1] == 0 and run.server_of_uid[2] == 1 and 2 in run.first_after_move_uids
    if ranking == "eq7":
        assert run.l3_stats.deleted_objects > 0 and run.l3_stats.evicted_objects == 0
        assert run.l3_hit_tokens_by_uid[2] == 768
    else:
        assert run.l3_stats.deleted_objects == 0 and run.l3_stats.evicted_objects > 0
        assert run.l3_hit_tokens_by_uid[2] == 0
