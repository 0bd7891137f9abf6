"""The test that ships with upstream/series 0014 ([storage/mooncake] public object helpers).

Written as it would sit in SGLang's own test tree (no HiState import). A `MooncakeStore` over SGLang's real
host pools (KV and Mamba, on CPU through the test support's stand-ins) talks to a recording stand-in for
Mooncake's distributed store, so what the store *writes* (`batch_set_v1`, `batch_set_v2`) is observed
directly; the public helpers must name exactly those objects, with the same buffers, in the same order.
"""
from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeObjects, MooncakeStore

from sglang_cpu.hicache import HICACHE_ARGS, _cpu_hicache
from sglang_cpu.pools import PAGE, build_cache, build_pools, cache_params, publish_server_args


class RecordingStore:
    """Mooncake's `MooncakeDistributedStore` as `MooncakeStore` calls it: puts recorded, objects held."""

    def __init__(self):
        self.objects, self.puts = {}, []

    def batch_is_exist(self, keys):
        return [1 if key in self.objects else 0 for key in keys]

    def batch_put_from(self, keys, ptrs, sizes, config=None):
        self.puts.append((list(keys), list(ptrs), list(sizes)))
        for key, size in zip(keys, sizes):
            self.objects[key] = size
        return [0] * len(keys)

    def batch_get_into(self, keys, ptrs, sizes):
        return [self.objects.get(key, -704) for key in keys]


def mooncake_store_over_host_pools() -> MooncakeStore:
    """A `MooncakeStore` as its constructor leaves it for one MHA rank (prefix "org-model", rank suffix "0"),
    over SGLang's KV and Mamba host pools, talking to a `RecordingStore`."""
    pools = build_pools(64 * PAGE, 16)
    server_args = publish_server_args(page_size=pools.page_size, chunk_tokens=max(16, pools.page_size),
                                      **{**HICACHE_ARGS, "hicache_ratio": 2.0})
    cache = build_cache("stock", pools)
    with _cpu_hicache():
        cache.init_hicache(server_args, cache_params(pools))
    kv_host, mamba_host = (cache.host_pool_group.get_pool(name) for name in (PoolName.KV, PoolName.MAMBA))
    ms = object.__new__(MooncakeStore)
    ms.store, ms.config_prefix, ms.mha_suffix, ms.mla_suffix = RecordingStore(), "org-model", "0", ""
    ms.is_mla_backend = ms.should_split_heads = ms._use_group_semantics = ms.enable_storage_metrics = False
    ms._supports_session_ids, ms.dcp_size, ms.mem_pool_host = False, 1, kv_host
    ms.registered_pools = {PoolName.MAMBA: mamba_host}
    return ms


@pytest.fixture
def store():
    return mooncake_store_over_host_pools()


def test_page_objects_are_the_objects_batch_set_v1_writes(store):
    keys = ["p0", "p1", "p2"]
    host_indices = torch.arange(3 * store.mem_pool_host.page_size, dtype=torch.int64)
    assert all(store.batch_set_v1(keys, host_indices))
    (written, ptrs, sizes), = store.store.puts
    with_buffers = store.page_objects(keys, host_indices)
    assert isinstance(with_buffers, MooncakeObjects)
    assert (with_buffers.keys, with_buffers.ptrs, with_buffers.sizes) == (written, ptrs, sizes)
    assert with_buffers.per_page * len(keys) == len(written)
    names_only = store.page_objects(keys)
    assert names_only.keys == written and names_only.ptrs is None and names_only.per_page == with_buffers.per_page
    assert all(key.startswith("org-model_") for key in written)  # the config prefix, as the store tags it


def test_pool_objects_are_the_objects_batch_set_v2_writes(store):
    transfer = PoolTransfer(name=PoolName.MAMBA, keys=["s0", "s1"], host_indices=torch.tensor([0, 1]))
    assert all(store.batch_set_v2([transfer])[PoolName.MAMBA])
    (written, ptrs, sizes), = store.store.puts
    objects = store.pool_objects(transfer, with_buffers=True)
    assert (objects.keys, objects.ptrs, objects.sizes) == (written, ptrs, sizes)
    assert store.pool_objects(transfer).keys == written


def test_existence_and_reads_go_to_the_store_per_object(store):
    keys = ["p0"]
    host_indices = torch.arange(store.mem_pool_host.page_size, dtype=torch.int64)
    objects = store.page_objects(keys, host_indices)
    assert store.objects_exist(objects.keys) == [0] * len(objects.keys)
    store.batch_set_v1(keys, host_indices)
    assert store.objects_exist(objects.keys) == [1] * len(objects.keys)
    assert store.get_objects(objects.keys, objects.ptrs, objects.sizes) == objects.sizes
    assert store.get_objects(["org-model_missing"], [0], [1]) == [-704]
