"""`histate replay --explain`: every lost page is attributed to exactly one cause, and each cause is
the right one on a scenario built to produce it."""
import pytest

from histate.core import CacheConfig, Tier, make_cache
from histate.sim.explain import EvictionLog, attribute, explain, summarize_attribution
from histate.sim.metrics import PolicyRun, RequestRecord
from histate.sim.replay import ReplayConfig, replay
from histate.sim.request import Request, Session, Workload, WorkloadStats
from histate.sim.workloads import demo_workload

P = 64  # tokens per page
KV_PAGE = P  # kv_bytes_per_token = 1
CKPT = 4 * KV_PAGE


class MiniReplay:
    """Requests straight through one cache (no engine), recording what a replay records."""

    def __init__(self, policy: str, gpu_pages: int):
        config = CacheConfig(page_num_tokens=P, kv_bytes_per_token=1, checkpoint_size_bytes=CKPT,
                             capacity_bytes={Tier.GPU: gpu_pages * KV_PAGE})
        self.cache = make_cache(policy, config)
        self.log = EvictionLog()
        self.cache.observer = self.log
        self.records, self.requests, self.now = [], [], 0.0

    def serve(self, session: str, keys, checkpoints=None) -> RequestRecord:
        self.now += 1.0
        uid = len(self.requests)
        self.log.set_request(uid)
        lease = self.cache.begin_request(keys, self.now)
        plan = self.cache.plan_checkpoints(lease) if checkpoints is None else checkpoints
        self.cache.finish_request(lease, None, self.now, plan)
        m = lease.match
        self.requests.append(Request(uid, session, 0, len(keys) * P, 0, tuple(keys), 0.0))
        rec = RequestRecord(uid, session, 0, self.now, len(keys) * P, m.num_kv_pages * P, m.num_reused_pages * P)
        self.records.append(rec)
        return rec

    def workload(self) -> Workload:
        return Workload("mini", [Session(f"s{r.uid}", (r,)) for r in self.requests], WorkloadStats())


def reference(mini: MiniReplay, reused_pages: dict) -> PolicyRun:
    """A reference run reusing `reused_pages[uid]` pages (0 for the others)."""
    return PolicyRun("ref", [RequestRecord(r.uid, r.session_id, 0, r.arrival_s, r.input_tokens,
                                           reused_pages.get(r.uid, 0) * P, reused_pages.get(r.uid, 0) * P)
                             for r in mini.records])


def causes_of(mini: MiniReplay, ref: PolicyRun, uid: int) -> dict:
    run = PolicyRun("histate", mini.records)
    (att,) = [a for a in attribute(mini.workload(), run, ref, mini.log) if a.uid == uid]
    return att.pages_by_cause, att


A = [("a", i) for i in range(12)]


def test_kv_evicted_by_another_sessions_insert():
    mini = MiniReplay("histate", gpu_pages=24)
    mini.serve("A", A[:10], checkpoints=[10])
    mini.serve("B", [("b", i) for i in range(20)], checkpoints=[20])  # needs A's room
    back = mini.serve("A", A)
    assert back.kv_hit_tokens == 0
    causes, att = causes_of(mini, reference(mini, {2: 10}), uid=2)
    assert causes == {"kv_evicted": 10}
    ev = mini.log.evictions[att.eviction]
    assert ev.during_uid == 1 and ev.unit == "bundle" and ev.tier == "GPU"


def test_state_evicted_while_its_kv_stayed():
    mini = MiniReplay("histate", gpu_pages=40)
    mini.serve("A", [("a", i) for i in range(16)], checkpoints=[8, 16])
    assert mini.cache.evict(Tier.GPU, mini.cache.free_bytes(Tier.GPU) + 1, mini.now)  # one unit: the cheapest
    back = mini.serve("A", [("a", i) for i in range(8)] + [("x", 0)])
    assert back.kv_hit_tokens == 8 * P and back.reused_tokens == 0
    causes, att = causes_of(mini, reference(mini, {1: 8}), uid=1)
    assert causes == {"state_evicted": 8}
    assert mini.log.evictions[att.eviction].unit == "checkpoint"


def test_no_checkpoint_near_an_internal_hit():
    mini = MiniReplay("histate", gpu_pages=100)
    mini.serve("A", [("a", i) for i in range(16)], checkpoints=[16])
    back = mini.serve("A", [("a", i) for i in range(10)] + [("x", 0)])
    assert back.kv_hit_tokens == 10 * P and back.reused_tokens == 0
    causes, _ = causes_of(mini, reference(mini, {1: 10}), uid=1)
    assert causes == {"no_checkpoint": 10}


def test_state_evicted_then_no_checkpoint_split_at_the_deepest_checkpoint_ever_placed():
    mini = MiniReplay("histate", gpu_pages=40)
    # eq. 7 with q = 0.9: C(6) = 0.1 * 6 * 2 / 8 = 0.15 tokens/64, C(8) = 0.1 * 2 * 8 / 16 = 0.1: 8 goes
    mini.serve("A", [("a", i) for i in range(16)], checkpoints=[6, 8, 16])
    mini.cache.evict(Tier.GPU, mini.cache.free_bytes(Tier.GPU) + 1, mini.now)
    back = mini.serve("A", [("a", i) for i in range(11)] + [("x", 0)])
    assert back.reused_tokens == 6 * P
    causes, _ = causes_of(mini, reference(mini, {1: 11}), uid=1)
    assert causes == {"state_evicted": 2, "no_checkpoint": 3}


def test_kv_never_cached_when_the_reference_reuses_pages_the_policy_never_held():
    mini = MiniReplay("histate", gpu_pages=100)
    mini.serve("A", [("a", i) for i in range(6)])
    causes, _ = causes_of(mini, reference(mini, {0: 6}), uid=0)
    assert causes == {"kv_never_cached": 6}


def test_every_lost_page_is_attributed_once_on_a_replay_under_pressure():
    workload = demo_workload(seed=3)
    config = ReplayConfig(gpu_cache_bytes=6 * 2**30, cpu_cache_bytes=0, ssd_cache_bytes=0, max_sessions=24)
    log = EvictionLog()
    runs = {"histate": replay(workload, "histate", config, observer=log),
            "unlimited": replay(workload, "unlimited", config)}
    atts = attribute(workload, runs["histate"], runs["unlimited"], log)
    ref = runs["unlimited"].by_uid()
    expected = {r.uid: ref[r.uid].reused_tokens // P - r.reused_tokens // P for r in runs["histate"].records
                if ref[r.uid].reused_tokens > r.reused_tokens}
    assert {a.uid: a.loss_pages for a in atts} == expected
    assert all(sum(a.pages_by_cause.values()) == a.loss_pages for a in atts)
    causes = {c for a in atts for c in a.pages_by_cause}
    assert {"kv_evicted", "no_checkpoint"} <= causes  # pressure evicts, mutations hit inside segments
    summary = summarize_attribution(atts, log, P, runs["histate"].by_uid())
    assert summary["lost_tokens"] == P * sum(expected.values())
    assert abs(sum(v["share"] for v in summary["by_cause"].values()) - 1.0) < 1e-9
    report = explain(workload, runs, {"histate": log})
    assert report["histate"]["unlimited"]["lost_tokens"] == summary["lost_tokens"]


def test_an_eviction_while_the_request_waits_in_the_queue_is_an_eviction():
    """SGLang pins a prefix only at admission: KV evicted after a request arrived but before its first
    match is lost to that eviction, not "never cached" (the record's matched_s, not its arrival)."""
    mini = MiniReplay("histate", gpu_pages=14)
    mini.serve("a", A, checkpoints=[12])               # uid 0, t=1: A cached with its terminal state
    mini.serve("b", [("b", i) for i in range(12)])     # uid 1, t=2: evicts A for room
    late = mini.serve("a", A + [("a2", 0)])            # uid 2, t=3: matches nothing
    ((evicted_at, _),) = [e for e in mini.log.kv_gone[A[0]]]
    assert late.kv_hit_tokens == 0 and 1.0 < evicted_at <= 2.0
    late.matched_s = late.arrival_s
    late.arrival_s = evicted_at - 0.5  # it arrived before the eviction and waited
    causes, att = causes_of(mini, reference(mini, {2: 12}), 2)
    assert causes == {"kv_evicted": 12} and att.matched_s == 3.0
    late.matched_s = None  # judged at its arrival, as before matched_s existed: no eviction yet, mislabelled
    causes, _ = causes_of(mini, reference(mini, {2: 12}), 2)
    assert causes == {"kv_never_cached": 12}
