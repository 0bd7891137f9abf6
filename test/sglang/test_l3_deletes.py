"""The plugin's L3 deletes (`--histate-l3-budget-gb`, `--histate-l3-servers`): the SSD tier ranks the
bundles this server wrote by eq. 7 (core/l3_ledger.py) from agreed events, and the L3 tier removes the
victims' objects (KV, state, digests) from SGLang's MooncakeStore.

SGLang's real HiCache on CPU over HiState's storage backend, against a loopback Mooncake master + store
service (as test_l3_terminal.py). Ledger sizes are the server's own (P bytes a KV page, S bytes a
state; one rank), a page is PAGE tokens, N_s = S * PAGE / P tokens.

  A1 = 4 pages backed up at t = 10, B = 2 pages at t = 50, A2 = A1 + 1 page at t = 100 (protected: just
  written). Bytes: 7 pages and 3 states > the budget 6P + 2S + P/2 (6 pages and 2 states fit).
  H(A1) = 10 + tau * (4 PAGE) / N_s              (C: its whole depth; M: its state, A2 needs its pages)
  H(B)  = 50 + tau * (2 PAGE) / (2 PAGE + N_s)
  tau is chosen so that H(B) < H(A1): B leaves (2 KV pages + its state), though A1's state is the
  oldest object (an LRU of objects would take it first).
"""
from __future__ import annotations

import hashlib
import math
import uuid

import pytest

from histate.l3 import digests

from .test_l3_mooncake import _use
from .test_l3_terminal import L3View, _path_hashes


def _cache(tmp_path, name, pools, **flags):
    from histate.sglang_plugin.config import resolve_config
    from histate.sglang_plugin.server_settings import storage_extra_config

    from sglang_cpu.hicache import build_hicache
    from sglang_cpu.pools import PAGE, ManualClock

    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / f"ssd-{name}")], "ssd_backend": "file",
                             "ssd_size_bytes": "64MiB", "l3": "mooncake", **flags}, {})
    extra = storage_extra_config(None, config)
    extra["prefetch_threshold"] = PAGE
    return build_hicache("histate", pools, histate_config=config, storage_extra=extra, clock=ManualClock(1.0))


def _sizes(pools) -> tuple:
    """(P, S): one KV page's and one state's bytes, as this server's pools hold them (one rank)."""
    from histate.sglang_plugin.host_stack import mamba_slot_bytes
    from histate.sglang_plugin.tree_cache import kv_bytes_per_token

    from sglang_cpu.pools import PAGE

    return kv_bytes_per_token(pools.allocator.get_kvcache()) * PAGE, \
        mamba_slot_bytes(pools.req_to_token_pool.mamba_pool)


def _tokens(num_pages: int) -> list:
    from sglang_cpu.pools import PAGE

    base = 1000 * (uuid.uuid4().int % 100000)
    return [base + i for i in range(num_pages * PAGE)]


def test_the_lowest_eq7_bundle_leaves_l3_and_reads_as_a_miss(mooncake, monkeypatch, tmp_path):
    from sglang_cpu.hicache import TieredDriver, drain_backups
    from sglang_cpu.pools import PAGE, Driver, build_pools

    _use(mooncake, monkeypatch)
    pools = build_pools(1024, 8)
    kv_page_bytes, state_bytes = _sizes(pools)
    n_s = state_bytes * PAGE / kv_page_bytes
    gap = 4 * PAGE / n_s - 2 * PAGE / (2 * PAGE + n_s)  # H(A1) - H(B) = tau * gap - 40
    tau_s = math.ceil(2 * 40 / gap)
    h_a1, h_b = 10 + tau_s * 4 * PAGE / n_s, 50 + tau_s * 2 * PAGE / (2 * PAGE + n_s)
    assert h_b < h_a1  # B is the victim by hand; by recency (object LRU) A1's state would go first
    budget_bytes = 6 * kv_page_bytes + 2 * state_bytes + kv_page_bytes // 2
    cache = _cache(tmp_path, "a", pools, tau_s=str(tau_s), l3_budget_bytes=repr(2 * budget_bytes / 1e9),
                   l3_servers="2", l3_require_digests=True)
    tier = cache.histate.ssd_tier
    assert tier.l3_ledger.config.budget_bytes in (budget_bytes, budget_bytes - 1)  # fleet / 2 servers
    l3 = tier.backend.l3
    driver, clock = Driver(cache, pools), cache.histate.clock
    tokens_a2, tokens_b = _tokens(5), _tokens(2)
    for now_s, tokens in ((10.0, tokens_a2[:4 * PAGE]), (50.0, tokens_b), (100.0, tokens_a2)):
        clock.now = now_s
        driver.serve(tokens, [len(tokens)])
        drain_backups(cache)
        if now_s < 100.0:
            assert l3.stats.snapshot()["l3_objects_removed"] == 0 and tier.l3_ledger.used_bytes <= budget_bytes
    assert l3.wait_removes(10.0)
    a2, b = _path_hashes(cache, tokens_a2), _path_hashes(cache, tokens_b)
    assert (len(a2), len(b)) == (5, 2)

    view = L3View(tier.backend)
    gone = [f"{view.tag}{h}_0_{s}" for h in b for s in ("k", "v")] + \
        [f"{view.tag}{b[-1]}_0_{s}" for s in ("temporal", "conv_0")]
    gone += [digests.digest_key(name) for name in gone]
    assert [view.raw.is_exist(name) for name in gone] == [0] * len(gone)
    assert l3.stats.snapshot()["l3_objects_removed"] == len(gone)  # 2 x 2 KV + 2 state objects, each + digest
    assert [view.kv(h) for h in a2] == [True] * 5 and view.state(a2[3]) and view.state(a2[4])
    assert not (l3.kv_written(b[0]) or l3.kv_written(b[1]) or l3.state_written(b[1]))  # a later write re-puts B
    # The kept objects are the bytes written: each equals its digest (taken from the host pool at the put).
    for h in a2:
        for suffix in ("k", "v"):
            name = f"{view.tag}{h}_0_{suffix}"
            assert hashlib.blake2b(view.raw.get(name), digest_size=16).digest() == view.raw.get(digests.digest_key(name))

    # A fresh server (digests required, a budget of its own): A2 restores from L3 and is its bundle now
    # (an L3 read is a ledger event, at its agreed clock); B is a miss and in no ledger.
    pools_c = build_pools(1024, 8)
    cache_c = _cache(tmp_path, "c", pools_c, l3_require_digests=True, l3_budget_bytes="1", l3_servers="1")
    backend_c, ledger_c = cache_c.histate.ssd_tier.backend, cache_c.histate.ssd_tier.l3_ledger
    assert backend_c.l3.require_digests and ledger_c.config.budget_bytes == 10**9  # the flags reach the tiers
    cache_c.histate.clock.now = 200.0
    assert TieredDriver(cache_c, pools_c).admit(tokens_a2 + [1]) == 5 * PAGE
    assert TieredDriver(cache_c, pools_c).admit(tokens_b + [1]) == 0
    assert {end: (b.path, b.last_s) for end, b in ledger_c.bundles.items()} == {a2[-1]: (tuple(a2), 200.0)}
    stats_c = backend_c.histate_stats()
    assert stats_c["l3_digest_mismatches"] == 0 and stats_c["l3_unverified"] == 0 and stats_c["l3_errors"] == 0


def test_without_a_fleet_budget_nothing_is_deleted(mooncake, monkeypatch, tmp_path):
    from sglang_cpu.pools import build_pools

    _use(mooncake, monkeypatch)
    cache = _cache(tmp_path, "d", build_pools(1024, 8))
    assert cache.histate.ssd_tier.l3_ledger is None and cache.histate.ssd_tier.backend.l3.fleet_budget_bytes == 0


class _DeadStore:
    """A Mooncake store whose master is gone: every remove blocks until released, then raises."""

    def __init__(self):
        import threading

        self.release, self.calls = threading.Event(), 0

    def batch_remove(self, keys, force=False):
        self.calls += 1
        self.release.wait(10.0)
        raise RuntimeError("master unreachable")


def test_a_blocked_remove_never_holds_the_caller(mooncake, monkeypatch, tmp_path):
    """The remover is behind (a dead master's RPC): the caller returns at once, at most
    MAX_PENDING_REMOVE_BATCHES batches wait, the rest are dropped and counted; the keys are forgotten."""
    import time

    from histate.sglang_plugin import l3_tier
    from sglang_cpu.pools import build_pools

    _use(mooncake, monkeypatch)
    cache = _cache(tmp_path, "e", build_pools(1024, 8))
    l3 = cache.histate.ssd_tier.backend.l3
    dead = _DeadStore()
    monkeypatch.setattr(l3.store, "store", dead)
    l3._written_kv.update({"x0", "x1"})
    start = time.monotonic()
    results = [l3.remove_bundles([f"x{i}"], [f"x{i}"]) for i in range(l3_tier.MAX_PENDING_REMOVE_BATCHES + 3)]
    assert time.monotonic() - start < 1.0
    assert results.count(False) >= 2 and l3.stats.snapshot()["l3_remove_batches_dropped"] == results.count(False)
    assert not l3.kv_written("x0") and not l3.kv_written("x1")
    dead.release.set()
    assert l3.wait_removes(10.0)
    assert dead.calls == results.count(True) and l3.stats.snapshot()["l3_errors"] == dead.calls


@pytest.mark.parametrize("agreed", [True, False], ids=["agreed-clock", "control-own-clocks"])
def test_two_tp_ranks_delete_the_same_bundles(mooncake, monkeypatch, tmp_path, agreed):
    """Two TP ranks (test_rank_agreement.py's harness: a real MIN/MAX all-reduce between two threads,
    each rank's wall clock read with its own jitter of up to 5 ms) serve the same ten 2-page sessions
    at one shared time, with a fleet budget of 3 such bundles: eq. 7 then ranks them by the times the
    ledger was fed. Fed at confirmed backups with HiState's agreed clock, both ranks hand the same
    victims, in the same order, to their L3 tier. The control gives each rank its own jittered clock
    (as if the ledger were fed on each rank's own time): their victims differ, which is what makes the
    agreement observable."""
    from histate.sglang_plugin.config import resolve_config

    from sglang_cpu.pools import PAGE, build_pools

    from .test_rank_agreement import JitteredClock, Rank, TwoRankGroup, _build_in_lockstep, _in_lockstep

    _use(mooncake, monkeypatch)
    kv_page_bytes, state_bytes = _sizes(build_pools(kv_tokens=160 * PAGE, mamba_slots=6, max_context=1 << 14))
    budget_bytes = 3 * (2 * kv_page_bytes + state_bytes)
    configs = [resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / f"rank{r}")], "ssd_backend": "file",
                               "ssd_size_bytes": "64MiB", "l3": "mooncake",
                               "l3_budget_bytes": repr((budget_bytes + kv_page_bytes // 2) / 1e9),
                               "l3_servers": "1"}, {}) for r in (0, 1)]
    group, shared = TwoRankGroup(), {"now_s": 1.0}
    clock_arg = "local_clock" if agreed else "clock"
    ranks = _build_in_lockstep(group, lambda r: Rank(r, group, {clock_arg: JitteredClock(shared, seed=r)},
                                                     ssd_config=configs[r]))
    for rank in ranks:
        l3 = rank.cache.histate.ssd_tier.backend.l3
        remove = l3.remove_bundles

        def logged(kv_keys, state_keys, rank=rank, remove=remove):
            rank.log.append(("remove", tuple(kv_keys), tuple(state_keys)))
            return remove(kv_keys, state_keys)

        monkeypatch.setattr(l3, "remove_bundles", logged)
    prompts = [_tokens(2) for _ in range(10)]

    def work(rank) -> None:
        for tokens in prompts:
            rank.driver.serve(tokens, [len(tokens)])
            for _ in range(4):
                rank.driver.step()

    assert _in_lockstep(ranks, group, work) == []
    removes = [[entry for entry in rank.log if entry[0] == "remove"] for rank in ranks]
    counts = [len(log) for log in removes]
    for rank in ranks:
        assert rank.cache.histate.ssd_tier.backend.l3.wait_removes(10.0)
    if not agreed:
        # The control only shows that the agreement is observable: its ranks decide on their own clocks,
        # so nothing it does is promised to match, its number of deletes included (a CI run saw 6 on one
        # rank, under load; never seen on this VM).
        assert removes[0] != removes[1], counts
        return
    assert counts == [7, 7]  # bundles 4 to 10 each push one out
    assert removes[0] == removes[1]
    for rank in ranks:
        assert rank.cache.histate.ssd_tier.l3_ledger.used_bytes == budget_bytes
