"""The test that ships with upstream/series 0016 ([hicache] write_back: back up a backed-up leaf's newer
state before demoting it).

Written as it would sit in SGLang's own test tree (no HiState import): a stock `UnifiedRadixCache` (Full +
Mamba, Python tree core) with SGLang's host tier under `--hicache-write-policy write_back`, on CPU (the CPU
stand-ins of the test support: host copies complete at once, states copied byte for byte). A later request
leaves a state inside a backed-up node; once the node's lower half has left the device, the upper half is
a backed-up device leaf whose state the host lacks. Before the patch `evict_device_leaf` demoted it as it
was and the state left the device with no copy anywhere; after it, the leaf's eviction backs the state up
first, and the host copy holds the same bytes.
"""
from __future__ import annotations

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from test_write_back_state_backup import _host_state, _node_at, write_back  # noqa: F401 (fixture)
from sglang_cpu.pools import PAGE, Driver


def _mamba(node):
    return node.component_data[ComponentType.MAMBA]


def test_a_backed_up_leafs_newer_state_is_backed_up_before_the_demote(write_back):
    cache, pools = write_back
    tokens = list(range(1, 8 * PAGE + 1))
    driver = Driver(cache, pools)
    driver.serve(tokens, [8 * PAGE], state_fill=lambda pos: pos / 16)
    assert cache.backup_node_for_write_back(_node_at(cache, 8 * PAGE).id)
    driver.serve(tokens[:4 * PAGE], [4 * PAGE], state_fill=lambda pos: pos / 16)
    inner, leaf = _node_at(cache, 4 * PAGE), _node_at(cache, 8 * PAGE)
    assert inner.backuped and _mamba(inner).value is not None and _mamba(inner).host_value is None
    expected = pools.mamba_pool.mamba_cache.temporal[:, int(_mamba(inner).value[0])].clone()

    cache.evict(EvictParams(num_tokens=8 * PAGE))  # the lower half goes first, then the upper half
    full = lambda node: node.component_data[ComponentType.FULL]
    assert full(leaf).value is None and full(inner).value is None, "the walk did not demote both halves"
    assert _mamba(inner).value is None
    assert _mamba(inner).host_value is not None, "the state left the device with no copy anywhere"
    assert torch.equal(_host_state(cache, inner), expected)  # the same bytes the device held
    cache.sanity_check()


def test_a_state_only_backup_counts_as_a_write(write_back):
    """`backup_node_for_write_back` of a node whose KV is on the host already copies its state alone: it
    reports the write and drains the ack (before the patch it returned False and left the ack pending)."""
    cache, pools = write_back
    tokens = list(range(1, 8 * PAGE + 1))
    driver = Driver(cache, pools)
    driver.serve(tokens, [8 * PAGE], state_fill=lambda pos: pos / 16)
    assert cache.backup_node_for_write_back(_node_at(cache, 8 * PAGE).id)
    driver.serve(tokens[:4 * PAGE], [4 * PAGE], state_fill=lambda pos: pos / 16)
    inner = _node_at(cache, 4 * PAGE)
    assert cache.backup_node_for_write_back(inner.id)
    assert _mamba(inner).host_value is not None and not cache.ongoing_write_through
    cache.sanity_check()
