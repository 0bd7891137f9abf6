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

import torch

from histate.core import SSD_BIT
from histate.sglang_plugin import eviction
from histate.sglang_plugin.config import resolve_config
from histate.sglang_plugin.core_nodes import core_of
from histate.sglang_plugin.server_settings import storage_extra_config
from histate.sim.workloads import AgentWorkloadConfig, agent_workload

from sglang_cpu.hicache import TieredDriver, build_hicache
from sglang_cpu.pools import PAGE, build_pools, publish_server_args

MIN_STEPS = 10_000
NUM_REQUESTS = 600  # 10,504 steps, 3,294 evictions per rank; the control diverged after 247 requests
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

    def all_reduce(self, rank: int, tensor: torch.Tensor, op) -> None:
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        combine = torch.minimum if op == torch.distributed.ReduceOp.MIN else torch.maximum
        result = combine(self.slots[0], self.slots[1])
        self.barrier.wait()  # both read the slots before either overwrites its own
        tensor.copy_(result)


class JitteredClock:
    """One rank's wall clock: the shared time plus this rank's own jitter (up to JITTER_S)."""

    def __init__(self, shared: dict, seed: int):
        self.shared, self.rng = shared, random.Random(seed)

    def __call__(self) -> float:
        return self.shared["now_s"] + self.rng.uniform(0.0, JITTER_S)


class Rank:
    """One TP rank: its cache, its driver, and the log of every decision it takes."""

    def __init__(self, rank: int, group: TwoRankGroup, clock_kwargs: dict, ssd_config=None):
        self.pools = build_pools(kv_tokens=160 * PAGE, mamba_slots=6, max_context=1 << 14)
        storage = None if ssd_config is None else storage_extra_config(None, ssd_config)
        self.cache = build_hicache("histate", self.pools, histate_config=ssd_config, storage_extra=storage,
                                   hicache_ratio=1.2, **clock_kwargs)
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


def test_ranks_with_jittered_clocks_take_identical_decisions(sglang_plugins):
    publish_server_args()
    group, shared = TwoRankGroup(), {"now_s": 0.0}
    ranks = [Rank(r, group, {"local_clock": JitteredClock(shared, seed=r)}) for r in (0, 1)]
    assert _in_lockstep(ranks, group, _serve_stream(ranks, _requests(NUM_REQUESTS), shared)) == []
    assert ranks[0].steps == ranks[1].steps >= MIN_STEPS
    assert _first_difference(ranks[0].log, ranks[1].log) is None
    evicted = {entry[1] for entry in ranks[0].log if entry[0] == "evict"}
    assert evicted == {"GPU", "CPU"}, evicted  # decisions under pressure on both tiers were compared


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
