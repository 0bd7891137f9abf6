"""The test that ships with upstream/series 0015 ([hicache] write_back: back up a state the host lacks,
on a backed-up node too).

Written as it would sit in SGLang's own test tree (no HiState import): a stock `UnifiedRadixCache` (Full +
Mamba, Python tree core) with SGLang's host tier under `--hicache-write-policy write_back`, on CPU (the CPU
stand-ins of the test support: host copies complete at once, states copied byte for byte). A node whose KV
is backed up but whose state is on the device alone (here: a later request leaves a state inside a node
already backed up, and the split's upper half keeps the host KV) loses its device state to the MAMBA walk. Before the patch SGLang tombstoned it
with no copy anywhere; after it, the walk backs the state up first, and the host copy holds the same bytes.
"""
from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang_cpu.hicache import HICACHE_ARGS, _cpu_hicache
from sglang_cpu.pools import PAGE, Driver, build_cache, build_pools, cache_params, publish_server_args


@pytest.fixture
def write_back():
    pools = build_pools(64 * PAGE, 16)
    server_args = publish_server_args(page_size=pools.page_size, chunk_tokens=max(16, pools.page_size),
                                      **{**HICACHE_ARGS, "hicache_ratio": 4.0, "hicache_write_policy": "write_back"})
    cache = build_cache("stock", pools)
    with _cpu_hicache():
        cache.init_hicache(server_args, cache_params(pools))
    for entry in cache.host_pool_group.entry_map.values():
        entry.host_pool.pin_memory = False
    assert cache.is_write_back
    return cache, pools


def _node_at(cache, depth):
    node, seen = cache.tree_core.root_node, 0
    while seen < depth:
        node = next(iter(node.children.values())) if len(node.children) == 1 else None
        assert node is not None
        seen += len(node.key)
    assert seen == depth
    return node


def _host_state(cache, node) -> torch.Tensor:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    slot = int(node.component_data[ComponentType.MAMBA].host_value[0])
    return cache.host_pool_group.get_pool(PoolName.MAMBA).temporal_buffer[slot][:, 0].clone()


def test_a_state_the_host_lacks_is_backed_up_before_it_leaves_the_device(write_back):
    cache, pools = write_back
    tokens = list(range(1, 8 * PAGE + 1))
    driver = Driver(cache, pools)
    driver.serve(tokens, [8 * PAGE], state_fill=lambda pos: pos / 16)
    leaf = _node_at(cache, 8 * PAGE)
    assert not leaf.backuped  # write_back: nothing was copied to the host at insert
    assert cache.backup_node_for_write_back(leaf.id)  # KV and state to the host; the device keeps both
    # A later request leaves a state inside the backed-up node: the split's upper half keeps the host KV
    # and gets a state the host does not have.
    driver.serve(tokens[:4 * PAGE], [4 * PAGE], state_fill=lambda pos: pos / 16)
    inner, leaf = _node_at(cache, 4 * PAGE), _node_at(cache, 8 * PAGE)
    mamba = lambda node: node.component_data[ComponentType.MAMBA]
    assert inner.backuped and mamba(inner).value is not None and mamba(inner).host_value is None
    expected = pools.mamba_pool.mamba_cache.temporal[:, int(mamba(inner).value[0])].clone()

    lock = cache.lock(leaf.id)  # the leaf stays: the MAMBA walk must take the inner node's state
    cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    cache.unlock(lock)
    assert mamba(inner).value is None, "the walk did not take the inner state"
    assert mamba(inner).host_value is not None, "the state left the device with no copy anywhere"
    assert torch.equal(_host_state(cache, inner), expected)  # the same bytes the device held
    cache.sanity_check()


def test_a_state_with_a_host_copy_is_tombstoned_without_another_backup(write_back):
    """Unchanged by the patch: a state whose host copy exists leaves the device with no new transfer."""
    cache, pools = write_back
    tokens = list(range(1, 8 * PAGE + 1))
    Driver(cache, pools).serve(tokens, [4 * PAGE, 8 * PAGE], state_fill=lambda pos: pos / 16)
    inner, leaf = _node_at(cache, 4 * PAGE), _node_at(cache, 8 * PAGE)
    assert cache.backup_node_for_write_back(inner.id)
    writes = cache.cache_controller.write
    calls = []
    cache.cache_controller.write = lambda *a, **k: (calls.append(k.get("node_id")), writes(*a, **k))[1]
    lock = cache.lock(leaf.id)
    cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    cache.unlock(lock)
    mamba = inner.component_data[ComponentType.MAMBA]
    assert mamba.value is None and mamba.host_value is not None and calls == []
    cache.sanity_check()
