"""SSD backups count only as far as they were stored (issue 30, item 3).

SGLang acks every storage backup, failed or not (cache_controller.py:1416-1458); HiState's SSD tier asks
its store what the backup left, per object, and takes the MIN over the ranks (`SsdTier.confirm_backups`).
Faults are injected into the real store under SGLang's real backup thread (sglang_cpu/hicache.py):
  * `Refusals` makes chosen puts fail as the store reports a failed put (nothing written), counting each;
  * `torn` makes the file system write half of a file and then fail (os.pwritev), as a full or dying disk.
Each test asserts its fault fired, then that the SSD bits and the SSD bytes HiState counted equal an
independent count of what the store holds, and that a checkpoint whose write failed keeps its device copy
and serves the next request with its exact bytes.
"""
from __future__ import annotations

import errno
import os
import re

import pytest
import torch

from histate.core import GPU_BIT, SSD_BIT
from histate.sglang_plugin import ssd_tier
from histate.sglang_plugin.core_nodes import core_of
from histate.storage.results import Fault, PutResult

from sglang_cpu.hicache import TieredDriver, drain_backups
from sglang_cpu.pools import PAGE, Driver, ManualClock, build_pools

from .test_hicache_tiers import _node_at, _ssd_cache, _state_bytes


class _Done:
    def __init__(self, results):
        self.results = results

    def wait(self, *args):
        return self.results


class Refusals:
    """The store's puts fail for the keys `refuse(key)` picks: a PutResult with a fault, nothing written
    (what the store reports for a full budget or an I/O error). `refused` lists them."""

    def __init__(self, store, refuse):
        self.refused: list = []
        put_many = store.put_many

        def faulty_put_many(items, pack=False):
            flags = [refuse(k) for k, _ in items]
            kept = iter(put_many([it for it, f in zip(items, flags) if not f], pack=pack) if not all(flags) else [])
            self.refused += [k for (k, _), f in zip(items, flags) if f]
            return [PutResult(k, Fault.IO_ERROR) if f else next(kept) for (k, _), f in zip(items, flags)]

        store.put_many = faulty_put_many
        store.submit_put = lambda items, pack=False: _Done(faulty_put_many(items, pack))


def _live_nodes(cache):
    return [sg for sg in cache.tree_core._node_arena.values() if sg.parent is not None]


def _check_bits_follow_the_store(cache):
    """Every node's SSD bits equal what the store holds (all its pages / its state object), and the SSD
    bytes HiState counted in (Little's law inflow of the SSD, the state's home tier) equal the sizes of
    exactly those objects; counted from the store's listing, not from the bits."""
    tier = cache.histate.ssd_tier
    tier.check_invariants()
    stored = set(tier.backend.store.keys())
    config = cache.histate.core_config
    expected_bytes = 0
    for sg in _live_nodes(cache):
        node = core_of(sg)
        kv_keys = {tier.backend.store_key("kv", h) for h in sg.hash_value}
        kv_on_ssd = kv_keys <= stored
        state_on_ssd = tier.backend.store_key("mamba", sg.hash_value[-1]) in stored
        assert node.ssd_kv == kv_on_ssd, (sg.id, node.ssd_kv, kv_on_ssd)
        assert node.ssd_state == (state_on_ssd and bool(node.ckpt_mask)), (sg.id, node.ssd_state, state_on_ssd)
        expected_bytes += kv_on_ssd * len(sg.key) * config.kv_bytes_per_token
        expected_bytes += (state_on_ssd and bool(node.ckpt_mask)) * config.checkpoint_size_bytes
    assert cache.histate.state.controller.state_flow.bytes_in == expected_bytes
    orphans = tier.orphans.keys()
    for key in stored:  # nothing on SSD that neither a bit nor an orphan accounts for
        assert key in orphans or any(
            key == tier.backend.store_key("mamba", sg.hash_value[-1]) and core_of(sg).ssd_state
            or key in {tier.backend.store_key("kv", h) for h in sg.hash_value} and core_of(sg).ssd_kv
            for sg in _live_nodes(cache)), key


def _served(cache, pools, tokens):
    """A 16-page prompt with states at 4, 8 and 16 pages; returns the node at 4 pages and its state's
    bytes as the forward pass left them (`state_fill`: a value the test knows)."""
    Driver(cache, pools).serve(tokens, [4 * PAGE, 8 * PAGE, 16 * PAGE], state_fill=lambda pos: pos / 8)
    node = _node_at(cache, tokens[:4 * PAGE])
    slot = int(node.component_data[2].value[0])
    state = pools.mamba_pool.mamba_cache
    expected = _state_bytes([state.temporal[:, slot], *(c[:, slot] for c in state.conv)]).clone()
    assert torch.all(state.temporal[:, slot] == 4 * PAGE / 8)  # the fill the test wrote, not a copy of it
    return node, expected


@pytest.mark.parametrize("fault", ["every_put", "state"])
def test_a_checkpoint_whose_write_failed_keeps_its_device_copy(sglang_plugins, tmp_path, fault):
    """Before: the ack alone set `ssd_state`, `home_historical` dropped the device and host copies of
    the historical states, and the next request missed (its restore read nothing)."""
    pools = build_pools(1024, 8)
    cache = _ssd_cache(tmp_path, pools, ManualClock(1.0))
    store = cache.histate.ssd_tier.backend.store
    refusals = Refusals(store, (lambda key: True) if fault == "every_put" else (lambda key: key.startswith("mamba/")))
    tokens = list(range(500, 500 + 16 * PAGE))
    node, expected = _served(cache, pools, tokens)
    drain_backups(cache)
    drain_backups(cache)
    assert len(refusals.refused) == 3  # the fault fired: the three states' puts
    assert store.keys() == []
    _check_bits_follow_the_store(cache)
    assert cache.histate.metrics.totals["checkpoints_homed_total"] == 0
    assert core_of(node).ckpt_mask & GPU_BIT and not core_of(node).ckpt_mask & SSD_BIT

    driver = TieredDriver(cache, pools)
    reused = driver.admit(tokens[:6 * PAGE] + [1] * PAGE)  # served from the device copy it kept
    assert reused == 4 * PAGE
    slot = int(node.component_data[2].value[0])
    state = pools.mamba_pool.mamba_cache
    assert torch.equal(_state_bytes([state.temporal[:, slot], *(c[:, slot] for c in state.conv)]), expected)
    cache.unlock(driver.admission_lock)
    cache.sanity_check()


def _demoted(cache, tokens):
    """Evict the prompt from the device (SGLang's walk: its nodes become host leaves); `demote`, which
    here counts the host as full, then writes their KV to SSD ahead of the host's own eviction."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache.evict(EvictParams(num_tokens=len(tokens)))
    drain_backups(cache)  # steps until the backups `demote` started are acknowledged


_PACK_TEMP = re.compile(r"/[0-9a-f]{16}\.tmp-")  # a packed file of KV pages being written (storage/layout.py)


def _torn_pack_writes(monkeypatch, count):
    """The next `count` writes of a KV pack put half their first buffer on disk, then fail (EIO)."""
    fired = []
    pwritev = os.pwritev

    def torn(fd, buffers, offset):
        if len(fired) < count and _PACK_TEMP.search(os.readlink(f"/proc/self/fd/{fd}")):
            fired.append(fd)
            first = memoryview(buffers[0]).cast("B")
            os.pwrite(fd, first[:first.nbytes // 2], offset)
            raise OSError(errno.EIO, "torn write (injected)")
        return pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", torn)
    return fired


@pytest.mark.parametrize("fault", ["kth_page", "torn"])
def test_a_kv_page_whose_write_failed_is_not_ssd_backed(sglang_plugins, tmp_path, monkeypatch, fault):
    """A demotion (KV to SSD ahead of host eviction) that loses one page (a refused put, or a packed file
    torn on disk) leaves its node not SSD-backed and not counted; `demote` writes it again later (not
    at once: a failing disk would take a write per step). Before: the ack marked the node SSD-backed."""
    monkeypatch.setattr(ssd_tier, "DEMOTE_MARGIN", 1.0)  # every host bundle is demoted at once
    monkeypatch.setattr(ssd_tier, "DEMOTE_RETRY_STEPS", 100)
    pools = build_pools(1024, 8)
    cache = _ssd_cache(tmp_path, pools, ManualClock(1.0))
    tier = cache.histate.ssd_tier
    store = tier.backend.store
    tokens = list(range(500, 500 + 16 * PAGE))
    _served(cache, pools, tokens)
    drain_backups(cache)
    if fault == "kth_page":
        seen = []

        def third_kv_page(key):
            if key.startswith("kv/"):
                seen.append(key)
                return len(seen) == 3
            return False

        refusals = Refusals(store, third_kv_page)
    else:
        fired = _torn_pack_writes(monkeypatch, count=1)
    _demoted(cache, tokens)
    if fault == "kth_page":
        assert len(refusals.refused) == 1  # the fault fired once
        lost = refusals.refused[0]
    else:
        assert len(fired) == 1  # the fault fired once: one pack lost all its pages
        lost = None
    failed = [sg for sg in _live_nodes(cache) if not core_of(sg).ssd_kv]
    assert failed, "the fault left every node SSD-backed"
    if lost is not None:
        assert lost not in store.keys()
        assert any(lost in {tier.backend.store_key("kv", h) for h in sg.hash_value} for sg in failed)
    _check_bits_follow_the_store(cache)
    assert tier.demoting == {} and tier.admitted == frozenset()

    steps = 0
    while not all(core_of(sg).ssd_kv for sg in _live_nodes(cache)):  # `demote` writes it again once due
        drain_backups(cache)
        steps += 1
        assert steps <= ssd_tier.DEMOTE_RETRY_STEPS
    assert steps >= ssd_tier.DEMOTE_RETRY_STEPS // 2  # not at once
    assert all(core_of(sg).ssd_kv for sg in _live_nodes(cache))  # written again by `demote`, then counted
    _check_bits_follow_the_store(cache)
    cache.sanity_check()


def test_a_kv_only_demotion_claims_no_state(sglang_plugins, tmp_path):
    """Two prompts share 6 pages, so a node of 6 pages holds KV and no state (no checkpoint was placed
    there). Its KV goes to SSD the way `demote` sends a node (admitted pages, SGLang's own
    `write_backup_storage`; a branch node is not a host leaf, so the test starts it), and every page is
    stored. Its KV is SSD-backed, and it has no SSD state: a KV-only backup's flags say nothing of a
    state. Kills reading the last KV page's flag as the state's, which marks a state on SSD that was
    never written (and counts its bytes)."""
    pools = build_pools(1024, 8)
    cache = _ssd_cache(tmp_path, pools, ManualClock(1.0))
    tier = cache.histate.ssd_tier
    first = list(range(500, 500 + 16 * PAGE))
    second = first[:6 * PAGE] + list(range(9000, 9000 + 4 * PAGE))
    driver = Driver(cache, pools)
    driver.serve(first, [16 * PAGE])
    driver.serve(second, [10 * PAGE])
    drain_backups(cache)
    (shared,) = [core_of(sg) for sg in _live_nodes(cache) if len(sg.key) == 6 * PAGE]  # the split node
    assert len(shared.sg.hash_value) == 6 and not shared.ckpt_mask and not shared.ssd_kv
    assert shared.sg.component_data[2].host_value is None  # nothing for the backup to write but KV
    tier.admitted = tier.admitted | set(shared.sg.hash_value)
    tier.demoting[id(shared)] = shared
    before = len(cache.ongoing_backup)
    cache.write_backup_storage(shared.sg.id)
    assert len(cache.ongoing_backup) == before + 1  # a backup started
    drain_backups(cache)
    store = tier.backend.store
    assert {tier.backend.store_key("kv", h) for h in shared.sg.hash_value} <= set(store.keys())
    assert tier.backend.store_key("mamba", shared.sg.hash_value[-1]) not in store.keys()
    assert shared.ssd_kv and not shared.ssd_state
    _check_bits_follow_the_store(cache)
    cache.sanity_check()
