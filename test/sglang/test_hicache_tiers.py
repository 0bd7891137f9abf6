"""Host and SSD tiers: HiState's host sizing, the `dynamic` storage backend, SSD-only matches.

HiCache's device<->host copies need CUDA kernels; here host pools are built for real (pinning
mocked, as SGLang does on machines without CUDA) and the copies go through `FakeMambaTransfer`,
a stand-in for the transfer controller that moves bytes with torch on the CPU.
"""
from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from histate.sglang_plugin.config import resolve_config
from histate.sglang_plugin.host_stack import GB, histate_build_scope, histate_host_split, install_host_policy, \
    stock_host_split
from histate.sglang_plugin.server_settings import storage_extra_config

from ._urc_fixtures import PAGE, Driver, ManualClock, build_cache, build_pools, cache_params, publish_server_args

HICACHE_ARGS = dict(enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_mem_layout="page_first",
                    hicache_io_backend="direct", hicache_write_policy="write_through")


@contextmanager
def _no_cuda_pinning():
    import sglang.srt.mem_cache.pool_host.common as host_common

    with mock.patch.object(host_common, "_cuda_host_register", lambda *a, **k: None):
        yield


def _with_host_tier(kind, pools, **kwargs):
    server_args = publish_server_args(**HICACHE_ARGS)
    cache = build_cache(kind, pools, **kwargs)
    install_host_policy()
    with _no_cuda_pinning(), histate_build_scope(resolve_config({"enable": True}, {}) if kind == "histate" else None):
        cache.init_hicache(server_args, cache_params(pools))
    cache.write_through_threshold = 1 << 30  # no automatic D->H backups (they need CUDA kernels)
    return cache


def _host_pools(cache):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    return cache.host_pool_group.get_pool(PoolName.KV), cache.host_pool_group.get_pool(PoolName.MAMBA)


def test_host_tier_gives_dram_to_kv_and_bounds_state_staging(sglang_plugins):
    kv_tokens, mamba_slots = 2048, 16
    stock = _with_host_tier("stock", build_pools(kv_tokens, mamba_slots))
    stock_kv, stock_states = _host_pools(stock)
    assert (stock_kv.size, stock_states.size) == (2 * kv_tokens + PAGE, 2 * mamba_slots + 1)  # mirrored split

    cache = _with_host_tier("histate", build_pools(kv_tokens, mamba_slots))
    kv_host, state_host = _host_pools(cache)
    split = cache.histate_host_split
    budget = stock_kv.size * stock_kv.size_per_token + stock_states.size * stock_states.size_per_token
    assert abs(split.budget_bytes - budget) <= PAGE * stock_kv.size_per_token + state_host.size_per_token
    assert split.state_slots == 16 and state_host.size == 16 + 1  # bounded staging (+ SGLang's pad slot)
    assert split.state_slot_bytes == state_host.size_per_token
    assert kv_host.size == (split.kv_bytes // kv_host.size_per_token // PAGE + 1) * PAGE
    assert kv_host.size > stock_kv.size  # the bytes the mirrored split gave to states now hold KV


def test_host_split_arithmetic_for_qwen35_9b():
    """The sizing report's numbers (docs/results.md): 96 GiB host, 45 GiB device pool at ratio 0.9."""
    ckpt, kv_per_token, budget = 51_511_296, 32 * 1024, 96 * 2**30
    device_states = 45 * 2**30 * 9 // 19
    stock = stock_host_split(budget, 45 * 2**30 - device_states, device_states, ckpt)
    ours = histate_host_split(budget, ckpt, staging_slots=48)
    assert stock.state_bytes == 48_826_996_627 and stock.state_slots == 947  # 45.47 GiB of states
    assert ours.state_bytes == 48 * ckpt and ours.kv_bytes == budget - 48 * ckpt  # 2.30 GiB of staging
    assert (stock.kv_tokens(kv_per_token), ours.kv_tokens(kv_per_token)) == (1_655_646, 3_070_272)
    with pytest.raises(ValueError, match="--histate-host-state-slots"):
        histate_host_split(10 * GB, ckpt, staging_slots=1000)


# --- the storage backend ------------------------------------------------------------------------

def _storage_config(tmp_path, **section):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file",
                             "ssd_size_bytes": "64MiB"}, {})
    extra = storage_extra_config(None, config)
    extra["histate"].update(section)
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="org/model", extra_config=extra)


def test_sglang_dynamic_factory_loads_histate_backend(sglang_plugins, tmp_path):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from histate.sglang_plugin.storage_backend import HiStateStorageBackend

    backend = StorageBackendFactory.create_backend("dynamic", _storage_config(tmp_path), mem_pool_host=None)
    try:
        assert isinstance(backend, HiStateStorageBackend)
        assert backend.store.config.dirs == [str(tmp_path / "ssd")]
        assert backend.store.config.capacity_bytes == 64 * 2**20
    finally:
        backend.close()


@pytest.fixture
def backend(sglang_plugins, tmp_path):
    from histate.sglang_plugin.storage_backend import HiStateStorageBackend

    instance = HiStateStorageBackend(_storage_config(tmp_path), {})
    yield instance
    instance.close()


def test_kv_pages_round_trip_byte_exact(backend):
    pages = [torch.arange(i, i + 64, dtype=torch.bfloat16) for i in range(3)]
    assert backend.batch_set(["h0", "h1", "h2"], pages)
    assert backend.batch_exists(["h0", "h1", "h2", "h3"]) == 3
    outs = [torch.zeros(64, dtype=torch.bfloat16) for _ in range(4)]
    got = backend.batch_get(["h0", "h1", "h2", "h3"], outs)
    assert all(torch.equal(g, p) for g, p in zip(got[:3], pages)) and got[3] is None
    assert backend.get("h1", torch.zeros(32, dtype=torch.bfloat16)) is None  # wrong size: a miss, no raise
    assert backend.exists("h2") and not backend.exists("h9")


def test_mamba_v2_round_trip_and_restorable_positions(sglang_plugins, backend):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    cache = _with_host_tier("histate", build_pools(1024, 8))
    _, state_host = _host_pools(cache)
    backend.register_mem_host_pool_v2(state_host, PoolName.MAMBA)
    slots = state_host.alloc(2)
    for value, slot in zip((3.0, 5.0), slots.tolist()):
        for tensor in state_host._iter_page_tensors(slot):
            tensor.fill_(value)
    before = [state_host.get_data_page(s, flat=True).clone() for s in slots.tolist()]
    keys = [f"p{i}" for i in range(6)]
    assert backend.batch_set(keys, [torch.ones(8) * i for i in range(6)])
    written = backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots, keys=["p1", "p4"])])
    assert written == {PoolName.MAMBA: [True, True]}
    # States after pages 2 and 5 (keys p1, p4): exactly those prefixes are resume points.
    probe = PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    result = backend.batch_exists_v2(keys, [probe])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (5, [2, 5])
    fresh = state_host.alloc(2)
    loaded = backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=fresh, keys=["p1", "p4"])])
    assert loaded == {PoolName.MAMBA: [True, True]}
    assert all(torch.equal(state_host.get_data_page(s, flat=True), b) for s, b in zip(fresh.tolist(), before))


def test_storage_faults_are_misses(backend):
    page = torch.arange(64, dtype=torch.float32)
    assert backend.batch_set(["k"], [page])
    entry = backend.store._index.get(backend.store_key("kv", "k"))
    with open(entry.path, "r+b") as f:  # flip payload bytes behind the store's back
        f.seek(entry.header.header_bytes)
        f.write(b"\xff" * 8)
    assert backend.batch_get(["k"], [torch.zeros(64)]) == [None]
    assert not backend.exists("k")  # the corrupt object is gone; the store keeps serving
    assert backend.batch_set(["k"], [page]) and torch.equal(backend.get("k", torch.zeros(64)), page)


# --- SSD-only checkpoints are usable matches ----------------------------------------------------

class FakeMambaTransfer:
    """Device <-> host state copies in torch on the CPU (the CUDA controller's job in a server)."""

    def __init__(self, pools, host_pool):
        self.device = pools.mamba_pool.mamba_cache
        self.host = host_pool

    def _pairs(self, device_slot, host_slot):
        yield self.device.temporal[:, device_slot], self.host.temporal_buffer[host_slot][:, 0]
        for dev, host in zip(self.device.conv, self.host.conv_buffer):
            yield dev[:, device_slot], host[host_slot][:, 0]

    def backup(self, device_slot, host_slot):
        for dev, host in self._pairs(device_slot, host_slot):
            host.copy_(dev)

    def device_bytes(self, device_slot):
        return torch.cat([d.contiguous().view(torch.uint8).reshape(-1) for d, _ in self._pairs(device_slot, 0)])


def _drop(cache, node, layer):
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import BaseEvictionResult

    result = BaseEvictionResult()
    cache.tree_core._evict_component_and_detach_lru(
        node, cache.components[ComponentType.MAMBA], result.device_frees, result.host_frees,
        result.cache_actions, target=layer)
    cache._apply_eviction_result(result)


def test_ssd_only_checkpoint_is_restored_through_the_storage_backend(sglang_plugins, backend):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

    from ._urc_fixtures import key

    pools = build_pools(1024, 8)
    cache = _with_host_tier("histate", pools, clock=ManualClock(1.0))
    _, state_host = _host_pools(cache)
    backend.register_mem_host_pool_v2(state_host, PoolName.MAMBA)
    cache.attach_ssd(backend)
    tokens = list(range(500, 500 + 16 * PAGE))
    Driver(cache, pools).serve(tokens, [4 * PAGE, 8 * PAGE, 16 * PAGE], state_fill=lambda pos: pos / 8)
    node = cache.tree_core.node_by_id(cache.match_prefix(MatchPrefixParams(key=key(tokens[:4 * PAGE]))).last_device_node)
    for n in cache.tree_core._node_arena.values():  # SGLang fills these once a storage backend is attached
        if n.parent is not None:
            n.hash_value = [f"page{t}" for t in range(4 * PAGE - len(n.key), 4 * PAGE, PAGE)] if n is node else ["x"]
    # Write-through path: device -> host (fake controller) -> SSD (the backend's v2 call).
    transfer = FakeMambaTransfer(pools, state_host)
    device_slot = int(node.component_data[2].value[0])
    expected = transfer.device_bytes(device_slot).clone()
    staging = state_host.alloc(1)
    transfer.backup(device_slot, int(staging[0]))
    node.component_data[2].host_value = staging.clone()
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=staging,
                                              keys=[node.hash_value[-1]])])[PoolName.MAMBA] == [True]
    _drop(cache, node, EvictLayer.DEVICE)  # sparsified on the device ...
    _drop(cache, node, EvictLayer.HOST)  # ... and the staging slot recycled: only the SSD copy is left
    cache.sanity_check()
    assert cache.histate.checkpoint_tier(node) == "storage"

    probe = tokens[:6 * PAGE] + [1] * PAGE  # a hit inside the request, past the SSD checkpoint
    result = cache.match_prefix(MatchPrefixParams(key=key(probe)))
    assert cache.tree_core.node_by_id(result.best_match_node) is node
    assert result.device_prefix_len == 4 * PAGE  # restored to the device: an ordinary device hit
    restored_slot = int(node.component_data[2].value[0])
    assert torch.equal(transfer.device_bytes(restored_slot), expected)  # byte-exact restore
    assert cache.histate.metrics.totals["ssd_read_bytes_total"] == expected.numel()
    cache.sanity_check()

    # A fault on the next restore is a miss, never a wrong result.
    _drop(cache, node, EvictLayer.DEVICE)
    entry = backend.store._index.get(backend.store_key("mamba", node.hash_value[-1]))
    with open(entry.path, "r+b") as f:  # the index still lists it; its bytes are damaged
        f.seek(entry.header.header_bytes)
        f.write(b"\xff" * 8)
    free_slots = pools.mamba_allocator.available_size()
    result = cache.match_prefix(MatchPrefixParams(key=key(probe)))
    assert cache.tree_core.node_by_id(result.best_match_node) is cache.tree_core.root_node
    assert result.device_prefix_len == 0 and pools.mamba_allocator.available_size() == free_slots
    assert not backend.has_state(node.hash_value[-1])  # the store dropped the corrupt object
    cache.sanity_check()


def test_metrics_are_exported_with_sglang_labels(sglang_plugins):
    from prometheus_client import CollectorRegistry, generate_latest

    from histate.sglang_plugin.metrics import HiStateMetrics

    registry = CollectorRegistry()
    metrics = HiStateMetrics({"tp_rank": "0", "pp_rank": "0"}, export=True, registry=registry)
    metrics.record_match(input_tokens=300, reused_tokens=256, tier="storage")
    metrics.record_match(input_tokens=100, reused_tokens=0, tier=None)
    metrics.record_eviction("bundle", 0)
    metrics.record_ssd_io(read_bytes=4096, written_bytes=8192)
    metrics.set_checkpoints("host", 7)
    text = generate_latest(registry).decode()
    for line in ('sglang:histate_prefix_hits_total{pp_rank="0",tier="storage",tp_rank="0"} 1.0',
                 'sglang:histate_reused_tokens_total{pp_rank="0",tp_rank="0"} 256.0',
                 'sglang:histate_input_tokens_total{pp_rank="0",tp_rank="0"} 400.0',
                 'sglang:histate_evictions_total{pp_rank="0",tier="device",tp_rank="0",unit="bundle"} 1.0',
                 'sglang:histate_ssd_read_bytes_total{pp_rank="0",tp_rank="0"} 4096.0',
                 'sglang:histate_ssd_written_bytes_total{pp_rank="0",tp_rank="0"} 8192.0',
                 'sglang:histate_checkpoints{pp_rank="0",tier="host",tp_rank="0"} 7.0'):
        assert line in text, line
    assert metrics.totals[("prefix_hits_total", "storage")] == 1 and metrics.totals["input_tokens_total"] == 400
