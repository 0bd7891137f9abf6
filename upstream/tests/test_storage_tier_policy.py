"""The test that ships with upstream/series 0008 ([hicache] a storage tier policy).

Written as it would sit in SGLang's own test tree (no HiState import): a stock `UnifiedRadixCache` (Full +
Mamba, Python tree core) with SGLang's host tier and its own `file` storage backend, on CPU (the CPU
stand-ins of the test support: host copies complete at once). A recording policy is installed; every
expectation comes from what the requests did (which prompts were served, what storage holds on disk).
"""
from __future__ import annotations

import os

import pytest
from sglang.srt.mem_cache.storage_tier_policy import StorageTierPolicy
from sglang_cpu.hicache import HICACHE_ARGS, TieredDriver, _cpu_hicache, drain_backups
from sglang_cpu.pools import PAGE, build_cache, build_pools, cache_params, publish_server_args


class Recorder(StorageTierPolicy):
    def __init__(self, write: bool = True):
        self.write = write
        self.begun, self.ended, self.acked, self.committed = [], [], [], []
        self.steps, self.synced = 0, []

    def begin_backup(self, node_id):
        self.begun.append(node_id)
        return ("token", node_id) if self.write else None

    def end_backup(self, token, operation_id):
        self.ended.append((token, operation_id))

    def on_backups_acked(self, operation_ids, agreed):
        self.acked.append((tuple(operation_ids), agreed))

    def on_prefetch_committed(self, anchor_node_id, page_hashes):
        self.committed.append((anchor_node_id, tuple(page_hashes)))

    def step_sync_values(self):
        return [self.steps + 7, -(self.steps + 7)]  # the MIN over one rank is the value itself

    def adopt_step_sync(self, values):
        self.synced.append(tuple(values))

    def on_step(self):
        self.steps += 1


@pytest.fixture
def tiered(tmp_path, monkeypatch):
    """A stock cache with the host tier and the `file` storage backend under tmp_path."""
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    pools = build_pools(64 * PAGE, 16)
    server_args = publish_server_args(page_size=pools.page_size, chunk_tokens=max(16, pools.page_size),
                                      **{**HICACHE_ARGS, "hicache_ratio": 4.0}, hicache_storage_backend="file",
                                      hicache_storage_prefetch_policy="wait_complete")
    cache = build_cache("stock", pools)
    with _cpu_hicache():
        cache.init_hicache(server_args, cache_params(pools))
    for entry in cache.host_pool_group.entry_map.values():
        entry.host_pool.pin_memory = False
    cache.write_through_threshold = 1
    return cache, pools, tmp_path


def stored_files(path) -> set:
    return {name for _, _, files in os.walk(path) for name in files}


def test_without_a_policy_every_host_backup_is_written_to_storage(tiered):
    cache, pools, path = tiered
    assert cache.storage_tier_policy is None
    TieredDriver(cache, pools).serve(list(range(1, 4 * PAGE + 1)), [4 * PAGE])
    drain_backups(cache)
    assert stored_files(path)


def test_a_policy_sees_each_backup_queued_then_acknowledged_with_its_operation(tiered):
    cache, pools, path = tiered
    policy = Recorder()
    cache.set_storage_tier_policy(policy)
    driver = TieredDriver(cache, pools)
    prompts = [list(range(s * 1000 + 1, s * 1000 + 1 + 4 * PAGE)) for s in range(3)]
    for tokens in prompts:
        driver.serve(tokens, [4 * PAGE])
    drain_backups(cache)
    assert stored_files(path)
    assert len(policy.begun) >= len(prompts)  # one backup per prompt at least
    assert [token for token, _ in policy.ended] == [("token", node_id) for node_id in policy.begun]
    queued = [op for _, op in policy.ended if op is not None]
    assert len(queued) == len(set(queued)) >= len(prompts)
    acked = [op for ops, agreed in policy.acked for op in ops]
    assert sorted(acked) == sorted(queued)  # each queued backup acknowledged once, none other
    assert all(agreed for _, agreed in policy.acked)  # drained by the per-step agreed count
    assert not cache.ongoing_backup


def test_a_policy_that_declines_every_backup_keeps_storage_empty(tiered):
    cache, pools, path = tiered
    policy = Recorder(write=False)
    cache.set_storage_tier_policy(policy)
    TieredDriver(cache, pools).serve(list(range(1, 4 * PAGE + 1)), [4 * PAGE])
    drain_backups(cache)
    assert policy.begun and not policy.ended and not policy.acked
    assert not stored_files(path)


def test_the_step_sync_rides_on_every_step_and_the_step_hook_ends_it(tiered):
    cache, pools, _ = tiered
    policy = Recorder()
    cache.set_storage_tier_policy(policy)
    for _ in range(5):
        cache.check_hicache_events()
    assert policy.steps == 5
    assert policy.synced == [(7 + n, -(7 + n)) for n in range(5)]  # adopted before the step hook ran


def test_the_policy_outlives_a_flush(tiered):
    """`flush_cache` resets the tree and the HiCache state; the policy, like the storage backend, stays."""
    cache, _, _ = tiered
    policy = Recorder()
    cache.set_storage_tier_policy(policy)
    cache.reset()
    assert cache.storage_tier_policy is policy
    cache.check_hicache_events()
    assert policy.steps == 1


def test_a_prefetch_from_storage_is_reported_once_committed(tiered):
    cache, pools, _ = tiered
    policy = Recorder()
    cache.set_storage_tier_policy(policy)
    driver = TieredDriver(cache, pools)
    tokens = list(range(1, 16 * PAGE + 1))  # SGLang prefetches from 256 tokens up (prefetch_threshold)
    driver.serve(tokens, [16 * PAGE])
    drain_backups(cache)
    cache.reset()  # the tree and host copies go; storage keeps the pages
    pools.req_to_token_pool.clear()
    pools.allocator.clear()
    reused = driver.admit(tokens + [7] * PAGE)  # the scheduler's L3 prefetch brings them back
    cache.unlock(driver.admission_lock)
    assert reused == 16 * PAGE
    (anchor, pages), = policy.committed
    assert anchor == cache.tree_core.root_node.id and len(pages) == 16 * PAGE // cache.page_size


# --- 0010: the admission hold, the abort release, and a restored host value -------------------------------


class Holding(Recorder):
    """Holds every request until `ready` is set; records the releases."""

    def __init__(self):
        super().__init__()
        self.ready, self.asked, self.released = False, [], []

    def admission_ready(self, request):
        self.asked.append(request)
        return self.ready

    def on_request_released(self, request):
        self.released.append(request)


def test_a_policy_holds_admission_until_it_is_ready(tiered):
    from sglang_cpu.hicache import request

    cache, _, _ = tiered
    handle = request("r1", list(range(1, 2 * PAGE + 1))).cache_request_handle
    assert cache.check_prefetch_progress(handle)  # no policy: nothing to wait for
    policy = Holding()
    cache.set_storage_tier_policy(policy)
    assert not cache.check_prefetch_progress(handle) and not cache.check_prefetch_progress(handle)
    policy.ready = True
    assert cache.check_prefetch_progress(handle)
    assert policy.asked == [handle] * 3


def test_an_abort_is_reported_to_the_policy_once(tiered):
    from sglang_cpu.hicache import request

    cache, _, _ = tiered
    policy = Holding()
    cache.set_storage_tier_policy(policy)
    handle = request("r2", list(range(1, 2 * PAGE + 1))).cache_request_handle
    cache.release_aborted_request(handle)
    assert policy.released == [handle]


def test_a_restored_host_state_is_placed_as_a_prefetch_places_it(tiered):
    """A node backed up to the host without its state gets one through `set_component_host_value`: it
    holds the slot, joins the host LRU exactly when it has no device state, the tree stays consistent
    (SGLang's own sanity check), and a second placement on the same node is refused."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    cache, pools, _ = tiered
    TieredDriver(cache, pools).serve(list(range(1, 4 * PAGE + 1)), [4 * PAGE])
    drain_backups(cache)
    core = cache.tree_core
    mamba = ComponentType.MAMBA
    [node] = [n for n in core._node_arena.values() if n.component_data[mamba].host_value is not None]
    data = node.component_data[mamba]
    host_pool = cache.host_pool_group.get_pool(PoolName.MAMBA)
    host_pool.free(data.host_value)  # as if the host had dropped the state and kept the KV
    data.host_value = None
    cache.sanity_check()
    slot = host_pool.alloc(1)
    core.set_component_host_value(node.id, mamba, slot.clone())
    assert data.host_value is not None and int(data.host_value[0]) == int(slot[0])
    assert core.host_lru_lists[mamba].in_list(node) == (data.value is None)
    cache.sanity_check()
    with pytest.raises(AssertionError, match="already holds a host value"):
        core.set_component_host_value(node.id, mamba, slot.clone())


def test_a_core_that_cannot_place_host_values_refuses():
    from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
    from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import UnifiedTreeCoreInterface

    assert RustUnifiedTreeCore.set_component_host_value is UnifiedTreeCoreInterface.set_component_host_value
    with pytest.raises(NotImplementedError, match="does not place host values"):
        UnifiedTreeCoreInterface.set_component_host_value(object.__new__(RustUnifiedTreeCore), 1, 2, None)
