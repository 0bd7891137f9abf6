"""HiState's shared L3 (`--histate-l3 mooncake`) against a real Mooncake master + store service on
127.0.0.1 (histate.l3.services.LoopbackMooncake), with SGLang's real host pools on CPU.

Server A is HiState's storage backend (SSD in tmp_path + L3 through SGLang's `MooncakeStore`);
server B is a stock SGLang `MooncakeStore` with host pools of its own. Every byte comparison is on
the host pools' own tensors. Skipped with the reason when Mooncake cannot run here.
"""
from __future__ import annotations

import time
import uuid

import pytest
import torch


from sglang_cpu.hicache import build_hicache
from sglang_cpu.pools import build_pools

MODEL = "org/model"
PREFIX = "org-model"  # MooncakeStore's config prefix: the model name with '/' -> '-'


def _use(mc, monkeypatch):
    for name, value in mc.env.items():
        monkeypatch.setenv(name, value)  # SGLang's envs read os.environ


class Pools:
    """SGLang's host pools of one server (KV: MHA page-first; MAMBA)."""

    def __init__(self):
        from sglang.srt.mem_cache.hicache_storage import PoolName

        cache = build_hicache("stock", build_pools(512, 8))
        self.kv = cache.host_pool_group.get_pool(PoolName.KV)
        self.state = cache.host_pool_group.get_pool(PoolName.MAMBA)
        self.page = self.kv.page_size

    def fill_pages(self, n: int, seed: int) -> torch.Tensor:
        indices = self.kv.alloc(n * self.page)
        gen = torch.Generator().manual_seed(seed)
        for i in range(n):
            page = self.kv.get_data_page(int(indices[i * self.page]), flat=False)
            page.copy_(torch.randn(page.shape, generator=gen).to(page.dtype))
        return indices

    def fill_states(self, n: int, seed: int) -> torch.Tensor:
        slots = self.state.alloc(n)
        gen = torch.Generator().manual_seed(seed)
        for slot in slots.tolist():
            for tensor in self.state._iter_page_tensors(slot):
                tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
        return slots

    def page_bytes(self, indices: torch.Tensor, i: int) -> bytes:
        return self.kv.get_data_page(int(indices[i * self.page])).view(torch.uint8).numpy().tobytes()

    def state_bytes(self, slots: torch.Tensor, i: int) -> bytes:
        return self.state.get_data_page(int(slots[i]), flat=True).view(torch.uint8).numpy().tobytes()


def _storage_config(extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=MODEL, extra_config=extra)


def _histate_server(tmp_path, name="a"):
    """Server A: HiState's backend (SSD + L3), registered on its own host pools."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from histate.sglang_plugin.config import resolve_config
    from histate.sglang_plugin.server_settings import storage_extra_config
    from histate.sglang_plugin.storage_backend import HiStateStorageBackend

    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / f"ssd-{name}")], "ssd_backend": "file",
                             "ssd_size_bytes": "64MiB", "l3": "mooncake"}, {})
    extra = storage_extra_config(None, config)
    assert extra["interface_v1"] == 1 and extra["histate"]["l3"] == "mooncake"
    pools = Pools()
    backend = HiStateStorageBackend(_storage_config(extra), {})
    backend.register_mem_pool_host(pools.kv)
    backend.register_mem_host_pool_v2(pools.state, PoolName.MAMBA)
    return backend, pools


def _stock_server():
    """Server B: stock SGLang MooncakeStore on host pools of its own."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    pools = Pools()
    store = MooncakeStore(_storage_config({}), pools.kv)
    store.register_mem_pool_host(pools.kv)
    store.register_mem_host_pool_v2(pools.state, PoolName.MAMBA)
    return store, pools


def _mamba(keys, host_indices=None):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return PoolTransfer(name=PoolName.MAMBA, keys=list(keys), host_indices=host_indices)


def _probe():
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)


def _keys(n):
    tag = uuid.uuid4().hex[:10]
    return [f"{tag}p{i}" for i in range(n)]


def _state_objects(key):
    return [f"{PREFIX}_{key}_0_temporal", f"{PREFIX}_{key}_0_conv_0"]


def _kv_objects(key):
    return [f"{PREFIX}_{key}_0_k", f"{PREFIX}_{key}_0_v"]


def _ssd_only(backend):
    """Context: writes through `backend` reach its SSD alone (L3 detached meanwhile)."""
    class _Detach:
        def __enter__(self):
            self.l3, backend.l3 = backend.l3, None

        def __exit__(self, *exc):
            backend.l3 = self.l3

    return _Detach()


# --- interop with stock SGLang -----------------------------------------------------------------------

def test_stock_mooncake_reads_what_histate_wrote_byte_exact(mooncake, monkeypatch, tmp_path):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    _use(mooncake, monkeypatch)
    a, pa = _histate_server(tmp_path)
    b, pb = _stock_server()
    keys = _keys(3)
    idx_a, slots_a = pa.fill_pages(3, seed=1), pa.fill_states(1, seed=2)
    assert a.batch_set_v1(keys, idx_a) == [True] * 3
    assert a.batch_set_v2([_mamba(keys[2:], slots_a)]) == {PoolName.MAMBA: [True]}
    # Stock keys: {prefix}_{hash}_{tp_rank}_k/_v and _temporal/_conv_i.
    assert b.store.batch_is_exist([o for k in keys for o in _kv_objects(k)] + _state_objects(keys[2])) == [1] * 8

    assert b.batch_exists_v2(keys, [_probe()]).restorable_prefix_pages == [3]
    idx_b, slots_b = pb.kv.alloc(3 * pb.page), pb.state.alloc(1)
    assert b.batch_get_v1(keys, idx_b) == [True] * 3
    assert b.batch_get_v2([_mamba(keys[2:], slots_b)]) == {PoolName.MAMBA: [True]}
    for i in range(3):
        assert pb.page_bytes(idx_b, i) == pa.page_bytes(idx_a, i)
    assert pb.state_bytes(slots_b, 0) == pa.state_bytes(slots_a, 0)
    stats = a.histate_stats()
    assert stats["l3_written_bytes"] > 0 and stats["l3_errors"] == 0
    a.close()


def test_histate_restores_what_stock_mooncake_wrote_byte_exact(mooncake, monkeypatch, tmp_path):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from histate.sglang_plugin.metrics import HiStateMetrics

    _use(mooncake, monkeypatch)
    b, pb = _stock_server()
    a, pa = _histate_server(tmp_path)
    a.metrics = HiStateMetrics()
    keys = _keys(4)
    idx_b, slots_b = pb.fill_pages(3, seed=3), pb.fill_states(1, seed=4)
    assert b.batch_set_v1(keys[:3], idx_b) == [True] * 3
    assert b.batch_set_v2([_mamba(keys[2:3], slots_b)]) == {PoolName.MAMBA: [True]}

    # A's SSD is empty: everything comes from L3. Page 3 is nowhere.
    result = a.batch_exists_v2(keys, [_probe()])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (3, [3])
    assert a.batch_exists(keys) == 3
    idx_a, slots_a = pa.kv.alloc(4 * pa.page), pa.state.alloc(1)
    assert a.batch_get_v1(keys, idx_a) == [True, True, True, False]
    assert a.batch_get_v2([_mamba(keys[2:3], slots_a)]) == {PoolName.MAMBA: [True]}
    for i in range(3):
        assert pa.page_bytes(idx_a, i) == pb.page_bytes(idx_b, i)
    assert pa.state_bytes(slots_a, 0) == pb.state_bytes(slots_b, 0)
    stats = a.histate_stats()
    assert (stats["l3_hits"], stats["l3_misses"]) == (4, 1)
    page_bytes = len(pa.page_bytes(idx_a, 0))
    assert stats["l3_read_bytes"] == 3 * page_bytes + len(pa.state_bytes(slots_a, 0))
    assert a.metrics.totals[("l3_pages_total", "hit")] == 4
    assert a.metrics.totals["l3_read_bytes_total"] == stats["l3_read_bytes"]
    a.close()


# --- the restorable prefix over SSD and L3 (TRAILING_PAGES) --------------------------------------------

def test_restorable_prefix_needs_the_trailing_state_in_ssd_or_l3(mooncake, monkeypatch, tmp_path):
    _use(mooncake, monkeypatch)
    b, pb = _stock_server()
    a, pa = _histate_server(tmp_path)
    keys = _keys(7)  # p6 is nowhere
    # L3 (written by stock B): KV p0..p5, states keyed by p2 (prefix 3) and p5 (prefix 6).
    assert b.batch_set_v1(keys[:6], pb.fill_pages(6, seed=5)) == [True] * 6
    slots = pb.fill_states(2, seed=6)
    b.batch_set_v2([_mamba([keys[2], keys[5]], slots)])
    # A's SSD alone: KV p0, p1 and the state keyed by p1 (prefix 2).
    with _ssd_only(a):
        assert a.batch_set_v1(keys[:2], pa.fill_pages(2, seed=7)) == [True, True]
        a.batch_set_v2([_mamba(keys[1:2], pa.fill_states(1, seed=8))])

    def restorable():
        result = a.batch_exists_v2(keys, [_probe()])
        return result.kv_hit_pages, result.restorable_prefix_pages

    assert restorable() == (6, [2, 3, 6])
    # The state at prefix 6 leaves L3 (evicted): its KV is still there, but 6 is no resume point.
    assert all(b.store.remove(o, force=True) == 0 for o in _state_objects(keys[5]))
    assert restorable() == (3, [2, 3])
    assert a.batch_exists(keys) == 6  # the KV pages alone are all there
    # KV p2 leaves L3: prefix 3 loses a page; only the SSD's prefix 2 (its state on SSD) is left.
    assert all(b.store.remove(o, force=True) == 0 for o in _kv_objects(keys[2]))
    assert restorable() == (2, [2])
    a.close()


# --- faults: foreign objects, a dead store service ---------------------------------------------------

def test_an_l3_object_of_another_size_is_a_miss(mooncake, monkeypatch, tmp_path):
    _use(mooncake, monkeypatch)
    a, pa = _histate_server(tmp_path)
    keys = _keys(1)
    idx = pa.fill_pages(1, seed=9)
    page_half = len(pa.page_bytes(idx, 0)) // 2  # one object: K or V of a page
    store = a.l3.store.store  # the MooncakeDistributedStore under SGLang's MooncakeStore
    for obj in _kv_objects(keys[0]):  # a foreign writer's objects of the wrong size
        assert store.put(obj, b"\x01" * (page_half // 2)) == 0
    assert a.batch_exists(keys) == 1  # presence cannot see sizes (stock's rule too)
    # A miss (stock batch_get_v1 would report it loaded: it only checks > 0).
    assert a.batch_get_v1(keys, pa.kv.alloc(pa.page)) == [False]
    a.close()


def test_same_size_garbage_over_a_histate_page_fails_its_digest_and_is_a_miss(mooncake, monkeypatch, tmp_path):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from histate.l3.digests import DIGEST_SUFFIX

    _use(mooncake, monkeypatch)
    a, pa = _histate_server(tmp_path)
    c, pc = _histate_server(tmp_path, name="c")  # another HiState server: empty SSD, reads from L3
    keys = _keys(2)
    idx, slots = pa.fill_pages(2, seed=21), pa.fill_states(1, seed=22)
    assert a.batch_set_v1(keys, idx) == [True, True]
    assert a.batch_set_v2([_mamba(keys[1:], slots)]) == {PoolName.MAMBA: [True]}
    store = a.l3.store.store
    digest_objects = [o + DIGEST_SUFFIX for k in keys for o in _kv_objects(k)] + \
        [o + DIGEST_SUFFIX for o in _state_objects(keys[1])]
    assert store.batch_is_exist(digest_objects) == [1] * 6  # one digest per object written
    # Same size, other bytes, written over page 1's V object and the state's temporal object.
    for obj in (_kv_objects(keys[1])[1], _state_objects(keys[1])[0]):
        blob = store.get(obj)
        assert store.upsert(obj, bytes(b ^ 0xFF for b in blob)) == 0
        assert len(store.get(obj)) == len(blob)  # the injection took
    dest, dest_slots = pc.kv.alloc(2 * pc.page), pc.state.alloc(1)
    assert c.batch_get_v1(keys, dest) == [True, False]
    assert c.batch_get_v2([_mamba(keys[1:], dest_slots)]) == {PoolName.MAMBA: [False]}
    assert pc.page_bytes(dest, 0) == pa.page_bytes(idx, 0)  # the intact page is exactly A's
    stats = c.histate_stats()
    assert stats["l3_digest_mismatches"] == 2 and stats["l3_unverified"] == 0
    a.close()
    c.close()


def test_stock_written_objects_have_no_digest_and_are_read_unverified_unless_required(
        mooncake, monkeypatch, tmp_path):
    _use(mooncake, monkeypatch)
    b, pb = _stock_server()
    a, pa = _histate_server(tmp_path)
    keys = _keys(1)
    idx_b = pb.fill_pages(1, seed=23)
    assert b.batch_set_v1(keys, idx_b) == [True]
    dest = pa.kv.alloc(pa.page)
    assert a.batch_get_v1(keys, dest) == [True]
    assert pa.page_bytes(dest, 0) == pb.page_bytes(idx_b, 0)
    assert a.histate_stats()["l3_unverified"] == 2  # its K and V objects
    a.l3.require_digests = True  # a HiState-only fleet
    assert a.batch_get_v1(keys, pa.kv.alloc(pa.page)) == [False]
    a.close()


def test_a_killed_store_service_is_a_miss_and_ssd_still_serves_then_writes_resume(
        own_mooncake, monkeypatch, tmp_path):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    import histate.sglang_plugin.l3_tier as l3_tier

    monkeypatch.setattr(l3_tier, "RETRY_AFTER_S", 1.0)
    _use(own_mooncake, monkeypatch)
    a, pa = _histate_server(tmp_path)
    b, pb = _stock_server()
    keys = _keys(5)
    # SSD and L3: p0, p1 and the state at prefix 2 (A's backup). L3 alone: p2..p4, state at prefix 5.
    idx_a = pa.fill_pages(2, seed=10)
    assert a.batch_set_v1(keys[:2], idx_a) == [True, True]
    a.batch_set_v2([_mamba(keys[1:2], pa.fill_states(1, seed=11))])
    assert b.batch_set_v1(keys[2:5], pb.fill_pages(3, seed=12)) == [True] * 3
    b.batch_set_v2([_mamba(keys[4:5], pb.fill_states(1, seed=13))])
    assert a.batch_exists_v2(keys, [_probe()]).restorable_prefix_pages == [2, 5]

    own_mooncake.kill_store()
    started = time.monotonic()
    dest = pa.kv.alloc(5 * pa.page)
    before = dest.clone()
    loaded = a.batch_get_v1(keys, dest)
    assert loaded == [True, True, False, False, False]  # SSD pages load; L3 pages are misses, no raise
    assert a.batch_get_v2([_mamba(keys[4:5], pa.state.alloc(1))]) == {PoolName.MAMBA: [False]}
    assert a.batch_exists(keys) == 2  # what the SSD has (the master still lists the dead objects)
    result = a.batch_exists_v2(keys, [_probe()])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (2, [2])
    assert time.monotonic() - started < 10.0, "a dead store must fail fast"
    assert torch.equal(dest, before)
    # Writes during the outage report the SSD's result; nothing raises.
    more = _keys(1)
    assert a.batch_set_v1(more, pa.fill_pages(1, seed=14)) == [True]

    own_mooncake.start_store()
    fresh = _keys(2)
    idx_new = pa.fill_pages(2, seed=15)
    deadline = time.monotonic() + 15.0
    while True:  # the master learns of the new segment within a heartbeat
        a.l3._written_kv.difference_update(fresh)  # a put that failed is tried again on the next backup
        a.batch_set_v1(fresh, idx_new)
        if b.store.batch_is_exist([o for k in fresh for o in _kv_objects(k)]) == [1] * 4 \
                or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert b.store.batch_is_exist([o for k in fresh for o in _kv_objects(k)]) == [1] * 4
    time.sleep(1.1)  # L3 counts as down for RETRY_AFTER_S after the failed reads
    dest_b = pb.kv.alloc(2 * pb.page)
    assert b.batch_get_v1(fresh, dest_b) == [True, True]
    assert [pb.page_bytes(dest_b, i) for i in range(2)] == [pa.page_bytes(idx_new, i) for i in range(2)]
    assert a.l3.down_events >= 1 and a.histate_stats()["l3_errors"] == 0
    a.close()


# --- end to end through SGLang's HiCache (controller, backup thread, prefetch) -----------------------

def _tiered_cache(tmp_path, name, pools):
    from histate.sglang_plugin.config import resolve_config
    from histate.sglang_plugin.server_settings import storage_extra_config

    from sglang_cpu.hicache import build_hicache as build
    from sglang_cpu.pools import PAGE, ManualClock

    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / f"ssd-{name}")], "ssd_backend": "file",
                             "ssd_size_bytes": "64MiB", "l3": "mooncake"}, {})
    extra = storage_extra_config(None, config)
    extra["prefetch_threshold"] = PAGE  # SGLang's default (256 tokens) is longer than these prompts
    return build("histate", pools, histate_config=config, storage_extra=extra, clock=ManualClock(1.0))


def test_sglang_backs_up_to_l3_and_a_fresh_server_restores_from_it(mooncake, monkeypatch, tmp_path):
    """Server A serves a prompt: SGLang's backup thread calls HiState's batch_set_v1 / batch_set_v2
    (interface_v1), which write the SSD and L3. Server C, empty SSD, same prompt: SGLang's prefetch
    asks batch_exists_v2 and reads through batch_get_v1 / batch_get_v2 from L3."""
    from sglang_cpu.hicache import TieredDriver, drain_backups
    from sglang_cpu.pools import PAGE, Driver

    _use(mooncake, monkeypatch)
    tokens = [7000 + i + 1000 * (uuid.uuid4().int % 1000) for i in range(8 * PAGE)]
    pools_a = build_pools(1024, 8)
    cache_a = _tiered_cache(tmp_path, "a", pools_a)
    Driver(cache_a, pools_a).serve(tokens, [4 * PAGE, 8 * PAGE])
    drain_backups(cache_a)
    backend_a = cache_a.histate.ssd_tier.backend
    stats_a = backend_a.histate_stats()
    assert stats_a["l3_written_bytes"] > 0 and stats_a["l3_errors"] == 0

    pools_c = build_pools(1024, 8)
    cache_c = _tiered_cache(tmp_path, "c", pools_c)
    backend_c = cache_c.histate.ssd_tier.backend
    assert not list(backend_c.store.keys())  # C's SSD is empty
    reused = TieredDriver(cache_c, pools_c).admit(tokens + [1])  # a new token after the 8 cached pages
    stats_c = backend_c.histate_stats()
    assert (stats_c["l3_hits"], stats_c["l3_misses"], stats_c["l3_errors"]) == (9, 0, 0)  # 8 KV pages + the state
    assert reused == 8 * PAGE
    cache_c.sanity_check()
    cache_c.histate.victims.check_offered()


def test_l3_metrics_are_exported_with_sglang_labels(sglang_plugins):
    from prometheus_client import CollectorRegistry, generate_latest

    from histate.sglang_plugin.metrics import HiStateMetrics

    registry = CollectorRegistry()
    metrics = HiStateMetrics({"tp_rank": "0"}, export=True, registry=registry)
    metrics.record_l3_io(hits=3, misses=1, read_bytes=4096, written_bytes=8192)
    text = generate_latest(registry).decode()
    for line in ('sglang:histate_l3_pages_total{result="hit",tp_rank="0"} 3.0',
                 'sglang:histate_l3_pages_total{result="miss",tp_rank="0"} 1.0',
                 'sglang:histate_l3_read_bytes_total{tp_rank="0"} 4096.0',
                 'sglang:histate_l3_written_bytes_total{tp_rank="0"} 8192.0'):
        assert line in text, line
