"""R2: TP ranks take identical decisions (SGLang runs one tree per rank and needs the same ones).

Two HiState caches, one per simulated TP rank, each in its own thread with SGLang's HiCache attached
(sglang_cpu/hicache.py), are fed the same request stream. Each rank's wall clock is the same time
plus its own jitter. Their collectives go through `TwoRankGroup`, a real MIN/MAX all-reduce between the
two threads, installed where SGLang's cache reduces over its TP group (`_all_reduce_attn_groups`,
unified_radix_cache.py:355-362). After >= 10^4 scheduler steps the two ranks must have matched the same
lengths, planned the same checkpoints and evicted the same units, in the same order, on every tier.
The control run gives each rank its own clock, as HiState did before (a `time.monotonic` per rank):
the ranks then diverge, which is what makes the agreement observable.
"""
from __future__ import annotations

import itertools
import random
import threading

import pytest
import torch

from histate.core import GPU_BIT, SSD_BIT
from histate.sglang_plugin import eviction
from histate.sglang_plugin.config import resolve_config
from histate.sglang_plugin.core_nodes import core_of
from histate.sglang_plugin.server_settings import storage_extra_config
from histate.sim.workloads import AgentWorkloadConfig, agent_workload

from sglang_cpu.hicache import TieredDriver, build_hicache
from sglang_cpu.pools import PAGE, build_pools, publish_server_args

MIN_STEPS = 10_000
NUM_REQUESTS = 600  # 10,504 steps, 3,294 evictions per rank; the control diverged after 247 requests
SIZES_REQUESTS = 6  # ranks with different local sizes (issue 30): no host pressure yet
DECODE_STEPS = 14  # scheduler steps between two admissions (each agrees the clock)
JITTER_S = 0.005  # each rank's clock reads up to 5 ms late, independently
TRACE = AgentWorkloadConfig(
    num_sessions=320, num_turns=8, system_prompt_num_tokens=4 * PAGE, first_input_num_tokens=(8 * PAGE, 24 * PAGE),
    append_num_tokens=(PAGE, 8 * PAGE), output_num_tokens=(PAGE, 2 * PAGE), truncation_rate=0.15,
    rewind_edit_rate=0.15, fork_rate=0.1, compaction_rate=0.0, cut_granularity_num_tokens=PAGE,
    page_num_tokens=PAGE, max_context_num_tokens=None, seed=5)


class TwoRankGroup:
    """An all-reduce between two threads (the TP group of two ranks)."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.barrier = threading.Barrier(2, timeout=timeout_s)  # a rank waiting longer: a collective mismatch
        self.slots: list = [None, None]
        self.building = threading.Lock()  # `_build_in_lockstep`: one rank builds at a time between collectives
        self.local = threading.local()

    def all_reduce(self, rank: int, tensor: torch.Tensor, op) -> None:
        building = getattr(self.local, "building", False)
        if building:  # let the other rank build up to this collective; its server args are its own
            from sglang.srt.runtime_context import get_server_args
            from sglang.srt.server_args import set_global_server_args_for_scheduler

            server_args = get_server_args()
            self.building.release()
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        combine = torch.minimum if op == torch.distributed.ReduceOp.MIN else torch.maximum
        result = combine(self.slots[0], self.slots[1])
        self.barrier.wait()  # both read the slots before either overwrites its own
        if building:
            self.building.acquire()
            set_global_server_args_for_scheduler(server_args)
        tensor.copy_(result)


class JitteredClock:
    """One rank's wall clock: the shared time plus this rank's own jitter (up to JITTER_S)."""

    def __init__(self, shared: dict, seed: int):
        self.shared, self.rng = shared, random.Random(seed)

    def __call__(self) -> float:
        return self.shared["now_s"] + self.rng.uniform(0.0, JITTER_S)


class Rank:
    """One TP rank: its cache, its driver, and the log of every decision it takes."""

    def __init__(self, rank: int, group: TwoRankGroup, clock_kwargs: dict, ssd_config=None, state_shape=None,
                 write_policy: str = "write_through", hicache_ratio: float = 1.2):
        self.pools = build_pools(kv_tokens=160 * PAGE, mamba_slots=6, max_context=1 << 14, state_shape=state_shape)
        storage = None if ssd_config is None else storage_extra_config(None, ssd_config)
        self.cache = build_hicache("histate", self.pools, histate_config=ssd_config, storage_extra=storage,
                                   hicache_ratio=hicache_ratio, write_policy=write_policy, **clock_kwargs)
        self.cache._all_reduce_attn_groups = lambda tensor, op: group.all_reduce(rank, tensor, op)
        self.driver = TieredDriver(self.cache, self.pools)
        self.log: list = []
        self.steps = 0
        self.error: BaseException = None
        step = self.driver.step

        def counted_step():
            self.steps += 1
            step()

        self.driver.step = counted_step


def _build_in_lockstep(group: TwoRankGroup, make) -> list:
    """`make(rank)` for both ranks, each in its thread, with the collectives of construction (sizes at
    init, the SSD budget and the objects found at attach) going through `group`, as SGLang's ranks build
    their caches at once. One rank builds at a time between two collectives (process-wide state such as
    the published server args is not per thread here)."""
    from histate.sglang_plugin.tree_cache import HiStateRadixCache

    built, errors = [None, None], []

    def run(rank: int) -> None:
        group.local.rank, group.local.building = rank, True
        group.building.acquire()
        try:
            built[rank] = make(rank)
        except BaseException as error:  # noqa: BLE001 - returned to the main thread
            errors.append(error)
            group.barrier.abort()
        finally:
            group.local.building = False
            group.building.release()

    original = HiStateRadixCache.__dict__.get("_all_reduce_attn_groups")
    HiStateRadixCache._all_reduce_attn_groups = lambda self, tensor, op: group.all_reduce(group.local.rank, tensor, op)
    try:
        threads = [threading.Thread(target=run, args=(r,), name=f"build{r}") for r in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        if original is None:
            del HiStateRadixCache._all_reduce_attn_groups
        else:
            HiStateRadixCache._all_reduce_attn_groups = original
    assert errors == [], errors
    return built


def _path_id(sg) -> tuple:
    """A node's identity that does not depend on the process (SGLang's node ids are a global counter)."""
    return core_of(sg).depth_pages, int(sg.key.token_ids[0]), int(sg.key.token_ids[len(sg.key) - 1])


def _in_lockstep(ranks: list, group: TwoRankGroup, work) -> list:
    """Run `work(rank)` on both ranks, each in its thread, logging every eviction; returns the errors
    (a collective mismatch breaks the barrier)."""
    take = eviction.TierVictims.next_victim
    owner = {id(r.cache.histate.victims): r for r in ranks}

    def logged(victims, tier, accept=None):
        victim = take(victims, tier, accept)
        if victim is not None:
            owner[id(victims)].log.append(("evict", tier.name, victim[1].value, _path_id(victim[0].sg)))
        return victim

    def run(rank: Rank) -> None:
        try:
            work(rank)
        except BaseException as error:  # noqa: BLE001 - returned to the main thread
            rank.error = error
            group.barrier.abort()  # the other rank must not wait for this one

    eviction.TierVictims.next_victim = logged
    try:
        threads = [threading.Thread(target=run, args=(rank,), name=f"rank{i}") for i, rank in enumerate(ranks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        eviction.TierVictims.next_victim = take
    return [rank.error for rank in ranks if rank.error is not None]


def _serve_stream(ranks: list, requests: list, shared: dict):
    def work(rank: Rank) -> None:
        for i, tokens in enumerate(requests):
            outcome = rank.driver.serve(tokens, plan=rank.cache.plan_checkpoints)
            rank.log.append(("request", i, outcome.reused_tokens, outcome.kv_hit_tokens, tuple(outcome.checkpoints)))
            for _ in range(DECODE_STEPS):  # decode steps: time moves, each rank adds its own jitter
                if rank is ranks[0]:
                    shared["now_s"] += 0.004
                rank.driver.step()

    return work


def _requests(num_requests: int) -> list:
    tokens_of: dict = {}

    def tokens(page_keys):
        out = []
        for k in page_keys:
            base = tokens_of.setdefault(k, len(tokens_of))
            out.extend(range(base * PAGE, (base + 1) * PAGE))
        return out

    sessions = [s.requests for s in agent_workload(TRACE, name="ranks").iter_sessions()]
    ordered = [r for turn in itertools.zip_longest(*sessions) for r in turn if r is not None]
    return [tokens(r.page_keys) for r in ordered[:num_requests]]


def _first_difference(a: list, b: list):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x, y
    return None if len(a) == len(b) else (min(len(a), len(b)), "length", (len(a), len(b)))


def _reclaim_digest_by_path(monkeypatch) -> None:
    """Under write_back SGLang checks on every step that the ranks reclaimed the same host duplicates, by a
    digest of node ids (unified_tree_core.py:2021-2044, unified_radix_cache.py:3442-3465). Node ids come from
    one counter per process, and these two ranks share a process, so the digest is taken over `_path_id`
    instead: the same check, by the node's place in the tree."""
    from sglang.srt.mem_cache.unified_cache import unified_tree_core as core_module

    release = core_module.UnifiedTreeCore._release_full_host_duplicate

    def by_path(self, node, *args, **kwargs):
        digest = self.write_back_duplicate_reclaim_digest
        release(self, node, *args, **kwargs)
        depth, first, last = _path_id(node)
        self.write_back_duplicate_reclaim_digest = (
            digest * 1000003 + (depth * 7919 + first) * 7919 + last + 1) & core_module._RECLAIM_DIGEST_MASK

    monkeypatch.setattr(core_module.UnifiedTreeCore, "_release_full_host_duplicate", by_path)


@pytest.mark.parametrize("write_policy, ssd", [("write_through", False), ("write_back", False), ("write_back", True)],
                         ids=["write_through", "write_back", "write_back_ssd"])
def test_ranks_with_jittered_clocks_take_identical_decisions(sglang_plugins, monkeypatch, tmp_path, write_policy, ssd):
    """Also under write_back, where every device eviction backs its node up first (HiState's MAMBA walk
    asks for the state's backup itself: `eviction.write_back_moves_state`) and SGLang reclaims host
    duplicates under host pressure; and under write_back with an SSD tier, where each new checkpoint is
    written to the SSD through a host staging slot (state_writes.py), agreed at the per-step all-reduce."""
    publish_server_args()
    _reclaim_digest_by_path(monkeypatch)
    group, shared = TwoRankGroup(), {"now_s": 0.0}
    configs = _ssd_configs(tmp_path, "256MiB") if ssd else [None, None]
    ranks = [Rank(r, group, {"local_clock": JitteredClock(shared, seed=r)}, ssd_config=configs[r],
                  write_policy=write_policy) for r in (0, 1)]
    assert ranks[0].cache.is_write_back == (write_policy == "write_back")
    # with the SSD tier half the stream (5,000+ steps, hundreds of state writes): its steps cost 4x (CI time)
    num_requests, min_steps = (NUM_REQUESTS // 2, MIN_STEPS // 2) if ssd else (NUM_REQUESTS, MIN_STEPS)
    assert _in_lockstep(ranks, group, _serve_stream(ranks, _requests(num_requests), shared)) == []
    assert ranks[0].steps == ranks[1].steps >= min_steps
    assert _first_difference(ranks[0].log, ranks[1].log) is None
    evicted = {entry[1] for entry in ranks[0].log if entry[0] == "evict"}
    assert evicted == {"GPU", "CPU"}, evicted  # decisions under pressure on both tiers were compared
    # write_back: host duplicates were reclaimed (SGLang checked their order across the ranks each step);
    # with the SSD tier the host holds few (states go to the SSD, so the MAMBA walk backs up no node's KV
    # to tombstone its state: none on this stream)
    assert bool(ranks[0].cache.tree_core.write_back_duplicate_reclaim_digest) == (write_policy == "write_back"
                                                                                  and not ssd)
    if ssd:  # the state writes ran, and each rank's SSD holds what the other's does
        writers = [rank.cache.histate.ssd_tier.state_writes for rank in ranks]
        assert writers[0].num_stored == writers[1].num_stored > 100 and writers[0].num_failed == 0
        assert _ssd_view(ranks[0].cache) == _ssd_view(ranks[1].cache)
        assert {_rank_free(k) for k in ranks[0].cache.histate.ssd_tier.backend.store.keys()} == \
            {_rank_free(k) for k in ranks[1].cache.histate.ssd_tier.backend.store.keys()}


def test_ranks_with_their_own_clocks_diverge(sglang_plugins):
    """The control: each rank scoring with its own jittered clock (HiState before R2) diverges."""
    publish_server_args()
    group, shared = TwoRankGroup(timeout_s=2.0), {"now_s": 0.0}
    ranks = [Rank(r, group, {"clock": JitteredClock(shared, seed=r)}) for r in (0, 1)]
    errors = _in_lockstep(ranks, group, _serve_stream(ranks, _requests(NUM_REQUESTS // 2), shared))
    assert _first_difference(ranks[0].log, ranks[1].log) is not None
    assert all(isinstance(e, threading.BrokenBarrierError) for e in errors)  # diverged ranks: collective mismatch


def test_a_restore_one_rank_cannot_read_is_a_miss_on_every_rank(sglang_plugins, tmp_path):
    """SSD restores are agreed like SGLang's L3 hits (MIN over the ranks): rank 1's copy of a checkpoint
    is damaged, so neither rank reuses it and both forget it; they then keep deciding alike."""
    from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

    from .test_hicache_tiers import _drop_state

    publish_server_args()
    group = TwoRankGroup()
    configs = [resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / f"rank{r}")], "ssd_backend": "file",
                               "ssd_size_bytes": "64MiB"}, {}) for r in (0, 1)]
    ranks = [Rank(r, group, {"clock": lambda: 1.0}, ssd_config=configs[r]) for r in (0, 1)]
    prompt = list(range(500, 500 + 16 * PAGE))
    probe = prompt[:6 * PAGE] + [1] * PAGE

    def work(rank: Rank) -> None:
        cache = rank.cache
        rank.driver.serve(prompt, [4 * PAGE, 8 * PAGE, 16 * PAGE])  # written through to SSD
        node = next(sg for sg in cache.tree_core._node_arena.values() if core_of(sg).depth_pages == 4 * PAGE)
        _drop_state(cache, node, EvictLayer.DEVICE)
        _drop_state(cache, node, EvictLayer.HOST)
        assert core_of(node).ckpt_mask == SSD_BIT
        if rank is ranks[1]:
            backend = cache.histate.ssd_tier.backend
            entry = backend.store._index.get(backend.store_key("mamba", node.hash_value[-1]))
            with open(entry.path, "r+b") as f:
                f.seek(entry.header.header_bytes)
                f.write(b"\xff" * 8)
        rank.log.append(("reused", rank.driver.admit(probe), core_of(node).ckpt_mask))
        rank.driver.serve(probe, [7 * PAGE])

    assert _in_lockstep(ranks, group, work) == []
    assert ranks[0].log == ranks[1].log
    assert ranks[0].log[0] == ("reused", 0, 0)  # a miss on both ranks, and the checkpoint is gone on both
    for rank in ranks:
        assert rank.cache.histate.metrics.totals[("ssd_restores_total", "miss")] == 1
        rank.cache.sanity_check()


# --- issue 30: SSD acks, objects found at a restart, and the sizes eq. 7 scores by, under faults -----

def _ssd_configs(tmp_path, size="64MiB"):
    return [resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / f"rank{r}")], "ssd_backend": "file",
                            "ssd_size_bytes": size}, {}) for r in (0, 1)]


def _ssd_view(cache) -> list:
    """Each node's SSD bits and checkpoint tiers, by a process-independent identity."""
    return sorted((_path_id(sg), core_of(sg).ssd_kv, core_of(sg).ssd_state, core_of(sg).ckpt_mask)
                  for sg in cache.tree_core._node_arena.values() if sg.parent is not None)


def _three_states_on_two_ranks(tmp_path, write_policy: str = "write_through", refuse_states_on_rank1: bool = False):
    """Two ranks serve one 16-page prompt that leaves states at 4, 8 and 16 pages (written to the SSD
    through the host under write_through, at creation under write_back), take a step, then admit a probe
    that reuses 6 pages. Each rank logs its SSD view and what the probe reused. With
    `refuse_states_on_rank1`, rank 1's store refuses every state. Returns (ranks, refusals or None)."""
    from .test_backup_acks import Refusals

    publish_server_args()
    group = TwoRankGroup()
    configs = _ssd_configs(tmp_path)
    ranks = [Rank(r, group, {"clock": lambda: 1.0}, ssd_config=configs[r], write_policy=write_policy)
             for r in (0, 1)]
    refusals = Refusals(ranks[1].cache.histate.ssd_tier.backend.store, lambda key: key.startswith("mamba/")) \
        if refuse_states_on_rank1 else None
    prompt = list(range(500, 500 + 16 * PAGE))

    def work(rank: Rank) -> None:
        rank.driver.serve(prompt, [4 * PAGE, 8 * PAGE, 16 * PAGE])
        rank.driver.step()
        rank.log.append(("view", _ssd_view(rank.cache)))
        rank.log.append(("reused", rank.driver.admit(prompt[:6 * PAGE] + [1] * PAGE)))
        rank.cache.unlock(rank.driver.admission_lock)

    assert _in_lockstep(ranks, group, work) == []
    assert ranks[0].log == ranks[1].log
    return ranks, refusals


def test_a_state_one_rank_did_not_store_is_on_ssd_on_no_rank(sglang_plugins, tmp_path):
    """SGLang acks a failed backup like a good one, on every rank. Rank 1's store refuses the states;
    rank 0's stores them. The SSD tier confirms an object only where every rank holds it (MIN over the
    ranks): neither rank sets an SSD bit, both keep the historical states on the device (no homing) and
    reuse them alike, and rank 0 deletes the copies no agreed record holds."""
    ranks, refusals = _three_states_on_two_ranks(tmp_path, refuse_states_on_rank1=True)
    assert len(refusals.refused) == 3  # the fault fired on rank 1: three states refused
    view = dict(ranks[0].log)["view"]
    assert not any(ssd_state for _, _, ssd_state, _ in view) and len(view) == 3
    assert dict(ranks[0].log)["reused"] == 4 * PAGE  # the 4-page state kept its device copy on both ranks
    tiers = [r.cache.histate.ssd_tier for r in ranks]
    assert tiers[0].unconfirmed_deleted == 3 and tiers[1].unconfirmed_deleted == 0
    assert tiers[0].backend.store.keys() == [] == tiers[1].backend.store.keys()
    for rank in ranks:
        assert rank.cache.histate.metrics.totals["checkpoints_homed_total"] == 0
        rank.cache.sanity_check()


def test_a_state_write_one_rank_did_not_store_is_on_ssd_on_no_rank(sglang_plugins, tmp_path):
    """write_back's state-only writes (state_writes.py) are agreed like backups: rank 1's store refuses
    every state, rank 0's stores them. No rank sets an SSD bit or homes a state, both keep every state's
    device copy and reuse it alike, rank 0 deletes the copies it stored, and both free their staging slots."""
    ranks, refusals = _three_states_on_two_ranks(tmp_path, "write_back", refuse_states_on_rank1=True)
    assert len(refusals.refused) == 3  # the fault fired on rank 1: three states refused
    view = dict(ranks[0].log)["view"]
    assert not any(ssd_state for _, _, ssd_state, _ in view) and len(view) == 3
    assert dict(ranks[0].log)["reused"] == 4 * PAGE  # the 4-page state kept its device copy on both ranks
    for rank in ranks:
        writes = rank.cache.histate.ssd_tier.state_writes
        assert (writes.num_started, writes.num_stored, writes.num_failed) == (3, 0, 3)
        assert writes.host_pool.available_size() == writes.host_pool.size  # staging slots freed
        assert rank.cache.histate.ssd_tier.backend.store.keys() == []  # rank 0 deleted what it stored
        assert rank.cache.histate.metrics.totals["checkpoints_homed_total"] == 0
        rank.cache.sanity_check()


def test_state_writes_stored_on_every_rank_home_historical_states(sglang_plugins, tmp_path):
    """The control of the test above, without the fault: both ranks store the three states, set their
    SSD bits and home the two historical ones (their device copies go), and reuse the 4-page state from
    the SSD alike."""
    ranks, _ = _three_states_on_two_ranks(tmp_path, "write_back")
    view = dict(ranks[0].log)["view"]
    assert [(ssd_state, ckpt) for _, _, ssd_state, ckpt in sorted(view)] == \
        [(True, SSD_BIT), (True, SSD_BIT), (True, SSD_BIT | GPU_BIT)]  # historical on the SSD alone
    assert dict(ranks[0].log)["reused"] == 4 * PAGE  # restored from the SSD
    for rank in ranks:
        writes = rank.cache.histate.ssd_tier.state_writes
        assert (writes.num_started, writes.num_stored, writes.num_failed) == (3, 3, 0)
        assert rank.cache.histate.metrics.totals["checkpoints_homed_total"] == 2
        assert rank.cache.histate.metrics.totals[("ssd_restores_total", "ok")] == 1
        rank.cache.sanity_check()


def _rank_free(key: str) -> str:
    return key.rsplit("__", 1)[0]  # the store key without the rank suffix (`rank_suffix`: `_<model>_<tp>_<size>`)


def test_objects_found_at_a_restart_are_orphans_only_where_every_rank_has_them(sglang_plugins, tmp_path,
                                                                                monkeypatch):
    """Each rank finds its own store's objects at a restart. Rank 0 holds pages {a, b, c}, rank 1
    {b, c, d}: only b and c are orphans, on both ranks, in the same order; a and d are deleted where they
    are. The trim that follows deletes the same objects in the same order on both ranks. Before, each
    rank orphaned what it found: the trims took different objects."""
    from histate.sglang_plugin import ssd_tier

    publish_server_args()
    configs = _ssd_configs(tmp_path)
    pages = {name: torch.full((64,), float(i)) for i, name in enumerate("abcd")}
    held = {0: "abc", 1: "bcd"}
    first = [Rank(r, TwoRankGroup(), {"clock": lambda: 1.0}, ssd_config=configs[r]) for r in (0, 1)]
    for r, rank in enumerate(first):  # a first life of the server wrote these
        backend = rank.cache.histate.ssd_tier.backend
        for name in held[r]:
            assert backend.store.put(backend.store_key("kv", f"page-{name}"), pages[name]).stored
        backend.close()

    group = TwoRankGroup()
    ranks = _build_in_lockstep(group, lambda r: Rank(r, group, {"clock": lambda: 1.0}, ssd_config=configs[r]))
    tiers = [rank.cache.histate.ssd_tier for rank in ranks]
    for tier in tiers:
        assert len(tier.orphans) == 2
        assert {_rank_free(k) for k in tier.orphans.keys()} == {"kv/page-b", "kv/page-c"}
        assert {_rank_free(k) for k in tier.backend.store.keys()} == {"kv/page-b", "kv/page-c"}
    assert [_rank_free(k) for k, _ in tiers[0].orphans.in_order()] == [_rank_free(k) for k, _ in tiers[1].orphans.in_order()]

    deleted = {0: [], 1: []}
    for r, tier in enumerate(tiers):
        delete = tier.backend.store.delete
        monkeypatch.setattr(tier.backend.store, "delete",
                            lambda key, _d=delete, _r=r: (deleted[_r].append(_rank_free(key)), _d(key))[1])
    monkeypatch.setattr(ssd_tier, "HIGH_WATERMARK", 0.0)
    monkeypatch.setattr(ssd_tier, "LOW_WATERMARK", 0.0)

    def work(rank: Rank) -> None:
        rank.driver.step()  # agrees the SSD usage, then trims

    assert _in_lockstep(ranks, group, work) == []
    assert deleted[0] == deleted[1] and sorted(deleted[0]) == ["kv/page-b", "kv/page-c"]


def _scores(rank: Rank) -> list:
    """Every device unit's eq. 7 score, and the order the device walk would take them in (nothing leaves)."""
    from histate.core import GPU_BIT, Tier

    runtime = rank.cache.histate
    order = runtime.victims.peek(Tier.GPU, lambda node, unit: True, lambda node, unit: False)
    return [(_path_id(node.sg), unit.value, runtime.state.score(node, unit, GPU_BIT)) for node, unit in order]


def test_ranks_with_different_local_sizes_score_alike(sglang_plugins):
    """Rank 1's state slots are twice rank 0's (as a pipeline stage with more GDN layers would have
    them): the sizes eq. 5-7 and Little's law price units by are agreed at construction (MAX), so both
    ranks plan the same checkpoints, give every unit the same score and would evict in the same order.
    Before, each priced checkpoints by its own slot size. (Few requests: SGLang sizes its host pools
    from each rank's own bytes, so under host pressure these two ranks would part for SGLang's reasons.)"""
    from histate.sglang_plugin.host_stack import mamba_slot_bytes

    from sglang_cpu.pools import TINY_STATE

    publish_server_args()
    group = TwoRankGroup()
    shapes = [TINY_STATE, {**TINY_STATE, "state_size": 2 * TINY_STATE["state_size"]}]
    shared = {"now_s": 0.0}
    ranks = _build_in_lockstep(group, lambda r: Rank(r, group, {"local_clock": JitteredClock(shared, seed=r)},
                                                     state_shape=shapes[r]))
    local = [mamba_slot_bytes(r.pools.mamba_pool) for r in ranks]
    assert local[0] < local[1]  # the ranks' own sizes differ
    configs = [r.cache.histate.core_config for r in ranks]
    assert configs[0] == configs[1] and configs[0].checkpoint_size_bytes == local[1]  # the MAX

    def work(rank: Rank) -> None:
        _serve_stream(ranks, _requests(SIZES_REQUESTS), shared)(rank)
        rank.log.append(("scores", _scores(rank)))

    assert _in_lockstep(ranks, group, work) == []
    assert _first_difference(ranks[0].log, ranks[1].log) is None
    scores = next(entry[1] for entry in ranks[0].log if entry[0] == "scores")
    assert len({unit for _, unit, _ in scores}) == 2  # bundles and checkpoints were both ranked
