"""The test that ships with upstream/series 0017 ([hicache] a public device->host copy of one pool's slots).

Written as it would sit in SGLang's own test tree (no HiState import): a stock `UnifiedRadixCache` (Full +
Mamba, Python tree core) with SGLang's host tier under `--hicache-write-policy write_back`, on CPU (the CPU
stand-ins of the test support: host copies complete at once, states copied byte for byte). A cache policy
stages a node's device state in a host slot it allocated itself, with `HybridCacheController.
backup_pool_slots`, which returns once the copy finished: the host slot then holds the device's bytes, and
the tree is untouched (no host value, no backup, no ack queued, no host slot allocated by the controller).
"""
from __future__ import annotations

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from test_write_back_state_backup import _node_at, write_back  # noqa: F401 (fixture)
from sglang_cpu.pools import PAGE, Driver


def test_a_device_state_is_copied_into_a_host_slot_the_caller_owns(write_back):
    cache, pools = write_back
    Driver(cache, pools).serve(list(range(1, 8 * PAGE + 1)), [4 * PAGE, 8 * PAGE], state_fill=lambda pos: pos / 16)
    node = _node_at(cache, 4 * PAGE)
    device_slot = node.component_data[ComponentType.MAMBA].value
    host_pool = cache.host_pool_group.get_pool(PoolName.MAMBA)
    free_before = host_pool.available_size()
    host_slot = host_pool.alloc(1)
    assert cache.cache_controller.backup_pool_slots(PoolName.MAMBA, host_slot, device_slot) is None  # it waited

    expected = pools.mamba_pool.mamba_cache.temporal[:, int(device_slot[0])]
    assert torch.equal(host_pool.temporal_buffer[int(host_slot[0])][:, 0], expected)
    assert host_pool.available_size() == free_before - 1  # only the caller's slot
    assert node.component_data[ComponentType.MAMBA].host_value is None and not node.backuped
    assert not cache.cache_controller.ack_write_queue and not cache.ongoing_write_through
    host_pool.free(host_slot)
    cache.sanity_check()
