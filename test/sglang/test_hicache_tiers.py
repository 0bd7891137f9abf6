"""Host and SSD tiers: HiState's host sizing, the `dynamic` storage backend, SSD checkpoint restores.

SGLang's HiCache runs for real on CPU (sglang_cpu/hicache.py): host pools, controller, acks, the
storage backup thread, HiState's backend. Only the D<->H data plane is a stand-in
(`FakeL2TransferEngine`: transfers complete at once, states are copied with torch, KV is not).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from histate.core import CPU_BIT, GPU_BIT, SSD_BIT, Tier
from histate.sglang_plugin.config import resolve_config
from histate.sglang_plugin.core_nodes import core_of
from histate.sglang_plugin.host_stack import GB, histate_host_split, stock_host_split
from histate.sglang_plugin.server_settings import storage_extra_config

from sglang_cpu.hicache import build_hicache, drain_backups, request
from sglang_cpu.pools import PAGE, Driver, ManualClock, build_pools, key


def _with_host_tier(kind, pools, **kwargs):
    return build_hicache(kind, pools, write_through_threshold=1 << 30, **kwargs)  # no automatic D->H backups


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


# --- SSD-only checkpoints: restored off the scheduler thread, for requests about to be admitted ------

def _ssd_cache(tmp_path, pools, clock):
    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file",
                             "ssd_size_bytes": "64MiB"}, {})
    return build_hicache("histate", pools, histate_config=config, storage_extra=storage_extra_config(None, config),
                         clock=clock)


def _drop_state(cache, node, layer):
    """Remove one copy of `node`'s state with SGLang's own primitive (what a walk does)."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import BaseEvictionResult

    result = BaseEvictionResult()
    cache.tree_core._evict_component_and_detach_lru(
        node, cache.components[ComponentType.MAMBA], result.device_frees, result.host_frees,
        result.cache_actions, target=layer)
    cache._apply_eviction_result(result)
    cache.tree_core._update_evictable_leaf_sets(node)


def _state_bytes(tensors):
    return torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in tensors])


def _request(tokens):
    return request(f"r{tokens[-1]}", tokens)


def _node_at(cache, tokens):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    return cache.tree_core.node_by_id(cache.match_prefix(MatchPrefixParams(key=key(tokens))).last_device_node)


def _ssd_only_checkpoint(tmp_path, pools, clock):
    """A 16-page prompt with states at 4, 8 and 16 pages, written through device -> host -> SSD. Once
    the SSD copies are acknowledged, the historical states (4 and 8 pages) live on SSD alone (asymmetric
    tiering); the terminal one keeps its device copy. Returns (cache, tokens, the node at 4 pages, its
    state's bytes as the forward pass left them)."""
    cache = _ssd_cache(tmp_path, pools, clock)
    tokens = list(range(500, 500 + 16 * PAGE))
    Driver(cache, pools).serve(tokens, [4 * PAGE, 8 * PAGE, 16 * PAGE], state_fill=lambda pos: pos / 8)
    node, middle, terminal = (_node_at(cache, tokens[:n * PAGE]) for n in (4, 8, 16))
    device_slot = int(node.component_data[2].value[0])
    state = pools.mamba_pool.mamba_cache
    expected = _state_bytes([state.temporal[:, device_slot], *(c[:, device_slot] for c in state.conv)]).clone()
    drain_backups(cache)
    cache.sanity_check()
    assert core_of(node).ckpt_mask == core_of(middle).ckpt_mask == SSD_BIT
    assert core_of(terminal).ckpt_mask & (GPU_BIT | SSD_BIT) == GPU_BIT | SSD_BIT
    assert cache.histate.metrics.totals["checkpoints_homed_total"] == 4  # device + host copies of 2 states
    return cache, tokens, node, expected


def test_a_terminal_checkpoint_is_homed_once_the_next_turn_extends_it(sglang_plugins, tmp_path):
    """A terminal checkpoint keeps its device copy; it waits, without being looked at every step, for
    the tree event that makes it historical (a later turn's insert gives its node a child), and is
    homed to SSD alone the step after. Before, `home_historical` looked at every terminal checkpoint on
    SSD on every scheduler step."""
    pools = build_pools(1024, 8)
    cache = _ssd_cache(tmp_path, pools, ManualClock(1.0))
    tier, driver = cache.histate.ssd_tier, Driver(cache, pools)
    tokens = list(range(500, 500 + 16 * PAGE))
    driver.serve(tokens[:8 * PAGE], [4 * PAGE, 8 * PAGE])
    drain_backups(cache)
    terminal = _node_at(cache, tokens[:8 * PAGE])
    assert core_of(terminal).ckpt_mask & (GPU_BIT | SSD_BIT) == GPU_BIT | SSD_BIT
    assert id(core_of(terminal)) in tier.homing
    looked_at = []
    retire = cache.retire_state_copies
    cache.retire_state_copies = lambda sg: (looked_at.append(sg.id), retire(sg))[1]

    class Walked(dict):
        """The candidates, counting every walk over all of them (the per-step scan this replaced)."""
        walks = 0

        def items(self):
            Walked.walks += 1
            return super().items()

        def values(self):
            Walked.walks += 1
            return super().values()

        def __iter__(self):
            Walked.walks += 1
            return super().__iter__()

    tier.homing = Walked(tier.homing)
    cache.check_hicache_events()  # idle steps: nothing is due
    cache.check_hicache_events()
    # (a historical state still held by its backup's DMA may be looked at again: that is the retry)
    assert Walked.walks == 0 and id(core_of(terminal)) in tier.homing
    assert id(core_of(terminal)) not in tier._homing_due and terminal.id not in looked_at
    driver.serve(tokens, [16 * PAGE])  # the next turn extends it: its node gets a child
    drain_backups(cache)
    cache.check_hicache_events()
    assert core_of(terminal).ckpt_mask == SSD_BIT and terminal.id in looked_at
    assert id(core_of(terminal)) not in tier.homing
    cache.sanity_check()
    cache.histate.victims.check_offered()


def test_ssd_only_checkpoint_is_restored_off_the_scheduler_thread(sglang_plugins, tmp_path):
    """Matches (every waiting request, every round) never touch the disk; the scheduler's admission
    check (`check_prefetch_progress`) starts one read on an I/O thread and holds the request until it
    landed in a host slot; the next match is a host hit that SGLang's load-back brings to the device."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pools = build_pools(1024, 8)
    cache, tokens, node, expected = _ssd_only_checkpoint(tmp_path, pools, ManualClock(1.0))
    state, config = cache.histate.state, cache.histate.core_config
    gpu_in = 16 * PAGE * config.kv_bytes_per_token + 3 * config.checkpoint_size_bytes  # the prompt, 3 states
    assert state.state_home_tier is Tier.SSD  # Little's law: inflows to the device and to SSD, home of states
    # The SSD takes the states only: its KV is the host's victims, and the host did not run short.
    assert state.controller.kv_flow.bytes_in == gpu_in
    assert state.controller.state_flow.bytes_in == 3 * config.checkpoint_size_bytes
    backend = cache.histate.ssd_tier.backend
    readers = []
    read_state = backend.read_state
    backend.read_state = lambda *a, **k: (readers.append(threading.current_thread().name), read_state(*a, **k))[1]

    req = _request(tokens[:6 * PAGE] + [1] * PAGE)  # a hit inside the request, past the SSD checkpoint
    for _ in range(3):  # waiting-queue rounds: matches only
        req.init_next_round_input(cache)
        assert req.prefix_len == 0 and req.host_hit_length == 0
    assert readers == []
    rounds = 0
    while not cache.check_prefetch_progress(req.cache_request_handle):  # held while the read runs
        rounds += 1
        time.sleep(0.002)
        cache.check_hicache_events()  # the scheduler's next step agrees the read (one all-reduce)
    assert rounds >= 1 and readers == ["histate-ssd-restore_0"]
    host_pool = cache.host_pool_group.get_pool(PoolName.MAMBA)
    host_slot = int(node.component_data[2].host_value[0])
    restored = _state_bytes([host_pool.temporal_buffer[host_slot][:, 0], *(c[host_slot][:, 0] for c in host_pool.conv_buffer)])
    assert torch.equal(restored, expected)  # byte-exact SSD -> host
    assert cache.histate.metrics.totals[("ssd_restores_total", "ok")] == 1

    req.init_next_round_input(cache)  # admission: an ordinary host hit of SGLang's
    assert cache.tree_core.node_by_id(req.best_match_node) is node and req.mamba_host_hit_length >= 1
    loaded = cache.init_load_back(InitLoadBackParams(best_match_node=req.best_match_node,
                                                     host_hit_length=req.host_hit_length, req=req))
    lock = cache.lock(node.id)  # PrefillAdder._commit_prefill_admission: the admitted request holds its prefix
    cache.ready_to_load_host_cache()  # the scheduler starts the batch's H->D loads (layer by layer)
    cache.check_hicache_events()
    assert loaded is not None and node.component_data[2].value is not None  # on the device again
    device_slot = int(node.component_data[2].value[0])
    state = pools.mamba_pool.mamba_cache
    assert torch.equal(_state_bytes([state.temporal[:, device_slot], *(c[:, device_slot] for c in state.conv)]), expected)
    cache.sanity_check()
    cache.histate.victims.check_offered()
    cache.unlock(lock)  # the request moved on: the historical state goes back to SSD alone
    cache.check_hicache_events()
    assert core_of(node).ckpt_mask == SSD_BIT
    cache.sanity_check()
    cache.histate.victims.check_offered()


def test_a_restore_is_agreed_by_the_per_step_all_reduce_alone(sglang_plugins, tmp_path, monkeypatch):
    """A restore's (done, ok) rides on SGLang's per-step MIN all-reduce (as the clock does): polling a
    waiting request issues no collective, and a step with a restore in flight issues as many as a step
    without one. Before, every poll of every waiting request issued its own all-reduce."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    pools = build_pools(1024, 8)
    cache, tokens, node, _ = _ssd_only_checkpoint(tmp_path, pools, ManualClock(1.0))
    sizes, base = [], UnifiedRadixCache._all_reduce
    monkeypatch.setattr(UnifiedRadixCache, "_all_reduce", lambda self, data, op: (sizes.append(len(data)), base(self, data, op))[1])
    cache.check_hicache_events()
    idle_step, sizes[:] = list(sizes), []
    backend = cache.histate.ssd_tier.backend
    gate, read_state = threading.Event(), backend.read_state
    backend.read_state = lambda *a, **k: (gate.wait(10), read_state(*a, **k))[1]
    req = _request(tokens[:6 * PAGE] + [1] * PAGE)
    req.init_next_round_input(cache)
    for _ in range(5):  # the admission loop polls; the read is held
        assert not cache.check_prefetch_progress(req.cache_request_handle)
    assert sizes == []  # no collective per poll
    cache.check_hicache_events()
    assert len(sizes) == len(idle_step)  # one step, the same collectives (the one with the clock is 2 longer)
    assert not cache.check_prefetch_progress(req.cache_request_handle)  # agreed: not read yet
    gate.set()
    cache.histate.ssd_tier._reader.submit(lambda: None).result()  # the read ended
    assert not cache.check_prefetch_progress(req.cache_request_handle)  # ... but is agreed only at a step
    cache.check_hicache_events()
    assert cache.check_prefetch_progress(req.cache_request_handle)
    assert cache.histate.metrics.totals[("ssd_restores_total", "ok")] == 1
    cache.sanity_check()


def test_a_faulty_ssd_checkpoint_is_a_miss_and_leaves_the_tier(sglang_plugins, tmp_path):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pools = build_pools(1024, 8)
    cache, tokens, node, _ = _ssd_only_checkpoint(tmp_path, pools, ManualClock(1.0))
    backend = cache.histate.ssd_tier.backend
    entry = backend.store._index.get(backend.store_key("mamba", node.hash_value[-1]))
    with open(entry.path, "r+b") as f:  # the index still lists it; its bytes are damaged
        f.seek(entry.header.header_bytes)
        f.write(b"\xff" * 8)
    host_pool = cache.host_pool_group.get_pool(PoolName.MAMBA)
    free_slots = host_pool.available_size()
    req = _request(tokens[:6 * PAGE] + [1] * PAGE)
    req.init_next_round_input(cache)
    while not cache.check_prefetch_progress(req.cache_request_handle):
        time.sleep(0.002)
        cache.check_hicache_events()
    assert core_of(node).ckpt_mask == 0 and host_pool.available_size() == free_slots  # a miss; nothing leaked
    assert cache.histate.metrics.totals[("ssd_restores_total", "miss")] == 1
    req.init_next_round_input(cache)
    assert req.prefix_len == 0 and req.host_hit_length == 0  # the request recomputes: never a wrong state
    cache.sanity_check()
    cache.histate.victims.check_offered()


def test_an_aborted_request_releases_its_restore(sglang_plugins, tmp_path):
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pools = build_pools(1024, 8)
    cache, tokens, node, _ = _ssd_only_checkpoint(tmp_path, pools, ManualClock(1.0))
    host_pool = cache.host_pool_group.get_pool(PoolName.MAMBA)
    free_slots = host_pool.available_size()
    req = _request(tokens[:6 * PAGE] + [1] * PAGE)
    req.init_next_round_input(cache)
    assert not cache.check_prefetch_progress(req.cache_request_handle)
    cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)  # the scheduler's abort path
    cache.histate.ssd_tier._reader.submit(lambda: None).result()  # the read has ended, on this rank
    cache.histate.ssd_tier.reap()
    # ... but its slot goes back only once every rank's read has ended (the step's all-reduce): a slot freed
    # at each rank's own moment would leave the host pools' free room different between ranks
    assert host_pool.available_size() == free_slots - 1
    cache.check_hicache_events()
    assert host_pool.available_size() == free_slots and core_of(node).ckpt_mask == SSD_BIT
    assert all(data.lock_ref == 0 for data in node.component_data)
    cache.sanity_check()


def test_runtime_detach_stops_using_the_store(sglang_plugins, tmp_path):
    """SGLang's runtime detach (`/detach_hicache_storage_backend`) closes the backend; HiState drops
    its SSD tier first, so nothing reads or scores a closed store afterwards."""
    pools = build_pools(1024, 8)
    cache, tokens, node, _ = _ssd_only_checkpoint(tmp_path, pools, ManualClock(1.0))
    ok, message = cache.detach_storage_backend()
    assert ok, message
    assert cache.histate.ssd_tier is None and core_of(node).ckpt_mask == 0
    req = _request(tokens[:6 * PAGE] + [1] * PAGE)
    req.init_next_round_input(cache)
    assert cache.check_prefetch_progress(req.cache_request_handle)  # nothing to wait for
    Driver(cache, pools).serve(list(range(7000, 7000 + 8 * PAGE)), [8 * PAGE])
    cache.check_hicache_events()
    cache.sanity_check()
    cache.histate.victims.check_offered()


def test_metrics_are_exported_with_sglang_labels(sglang_plugins):
    from prometheus_client import CollectorRegistry, generate_latest

    from histate.sglang_plugin.metrics import HiStateMetrics

    registry = CollectorRegistry()
    metrics = HiStateMetrics({"tp_rank": "0", "pp_rank": "0"}, export=True, registry=registry)
    metrics.record_lookup(300)
    metrics.record_hit(256, "storage")
    metrics.record_lookup(100)
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


# --- restarts and flushes: the SSD tier keeps its budget, a pending restore survives a flush -------

def _small_ssd_cache(tmp_path, pools, monkeypatch, size="1MiB", hicache_ratio=1.5, clock=None):
    """A 1 MiB SSD below small device and host pools (`_fill`): both run short, so the host's
    lowest-ranked KV is demoted to the SSD (its victim tier) and the SSD fills."""
    import histate.sglang_plugin.config as plugin_config
    import histate.sglang_plugin.storage_backend as plugin_storage

    for module in (plugin_config, plugin_storage):  # the 64 MiB floor is one Qwen3.5 checkpoint; these are small
        monkeypatch.setattr(module, "MIN_SSD_SIZE_BYTES", 1 << 20)
    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file",
                             "ssd_size_bytes": size}, {})
    return build_hicache("histate", pools, histate_config=config, storage_extra=storage_extra_config(None, config),
                         clock=clock or ManualClock(1.0), hicache_ratio=hicache_ratio)


def _fill(cache, pools, first_token, num_prompts, until_used_share=None):
    """Serve distinct prompts (`num_prompts`, or until the SSD holds `until_used_share` of its budget);
    returns how many were served."""
    driver = Driver(cache, pools)
    store = cache.histate.ssd_tier.backend.store
    for i in range(num_prompts):
        if until_used_share is not None and store.used_bytes > until_used_share * store.config.capacity_bytes:
            return i
        start = first_token + 10_000 * i
        driver.serve(list(range(start, start + 16 * PAGE)), [8 * PAGE, 16 * PAGE])
        drain_backups(cache)
    return num_prompts


def test_objects_from_before_a_restart_are_reclaimable(sglang_plugins, tmp_path, monkeypatch):
    """A restarted server finds the store's old objects; no node knows them, so they are orphans the
    trim reclaims first. Before the fix they were never tracked: the budget stayed full and every new
    write failed with NO_CAPACITY."""
    pools = build_pools(1024, 32)
    first = _small_ssd_cache(tmp_path, pools, monkeypatch)
    served = _fill(first, pools, 100_000, 100, until_used_share=0.8)
    store = first.histate.ssd_tier.backend.store
    written = store.stats_snapshot()["num_objects"]
    assert written > 0 and store.used_bytes > 0.8 * store.config.capacity_bytes  # nearly full
    first.histate.ssd_tier.backend.close()

    pools = build_pools(1024, 32)
    second = _small_ssd_cache(tmp_path, pools, monkeypatch)
    tier = second.histate.ssd_tier
    assert len(tier.orphans) == written  # found at attach
    _fill(second, pools, 900_000, served)  # as much again: only room the orphans give back can take it
    stats = tier.backend.store.stats_snapshot()
    assert stats["put_failures"] == {} and stats["evictions"] > 0
    second.sanity_check()


def test_the_store_is_never_handed_orphans_already_gone(sglang_plugins, tmp_path, monkeypatch):
    """The store's capacity callback runs on SGLang's backup thread. Objects an earlier capacity round
    removed stay in the orphans until the trim drops their group; handed those, the store freed nothing
    and the write failed no_capacity with orphans left (1 in ~7 runs of the restart test above, when
    the callback read a per-step snapshot)."""
    pools = build_pools(1024, 32)
    first = _small_ssd_cache(tmp_path, pools, monkeypatch)
    _fill(first, pools, 100_000, 100, until_used_share=0.8)
    first.histate.ssd_tier.backend.close()
    second = _small_ssd_cache(tmp_path, build_pools(1024, 32), monkeypatch)
    tier = second.histate.ssd_tier
    store = tier.backend.store
    first_four = tier.orphans.in_order()[:4]
    need = sum(size_bytes for _, size_bytes in first_four)
    stale = tier.pick_ssd_victims(need)  # what the first round takes ...
    assert stale == [key for key, _ in first_four]
    for key in stale:
        store.delete(key)  # ... and removes; the orphans still list them
    assert set(stale) <= tier.orphans.keys()
    sizes = dict(tier.orphans.in_order())
    picked = tier.pick_ssd_victims(need)
    assert picked and not set(picked) & set(stale) and all(store.exists(key) for key in picked)
    assert sum(sizes[key] for key in picked) >= need


def test_a_flush_turns_every_ssd_object_into_an_orphan(sglang_plugins, tmp_path, monkeypatch):
    pools = build_pools(1024, 32)
    cache = _small_ssd_cache(tmp_path, pools, monkeypatch)
    _fill(cache, pools, 100_000, 10)
    store_keys = set(cache.histate.ssd_tier.backend.store.keys())
    orphaned = cache.histate.ssd_tier.orphans.keys()  # KV the host evicted after demoting it
    assert orphaned and store_keys - orphaned  # live nodes' objects too
    cache.reset()  # SGLang's flush_cache (scheduler.py:5523-5526), with the pools it clears
    pools.req_to_token_pool.clear()
    pools.allocator.clear()
    assert cache.histate.ssd_tier.orphans.keys() == store_keys
    _fill(cache, pools, 700_000, 1)  # the cache keeps working on the same store
    cache.sanity_check()


def test_a_flush_while_a_request_waits_for_its_restore(sglang_plugins, tmp_path):
    """Pause, flush, resume while a request is held for an SSD restore: before the fix the resumed
    scheduler polled the restore of a node the flush had deleted (KeyError in the tree core)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pools = build_pools(1024, 8)
    cache, tokens, node, _ = _ssd_only_checkpoint(tmp_path, pools, ManualClock(1.0))
    backend = cache.histate.ssd_tier.backend
    gate, read_state = threading.Event(), backend.read_state
    backend.read_state = lambda *a, **k: (gate.wait(), read_state(*a, **k))[1]  # the read is slow
    req = _request(tokens[:6 * PAGE] + [1] * PAGE)
    req.init_next_round_input(cache)
    assert not cache.check_prefetch_progress(req.cache_request_handle)  # held: the read runs
    threading.Timer(0.05, gate.set).start()
    cache.reset()  # flush_cache while paused: waits for the read, forgets the restore
    deadline = time.monotonic() + 2.0
    while not cache.check_prefetch_progress(req.cache_request_handle):  # resumed: polls its admission hold
        assert time.monotonic() < deadline, "the request waits for a restore of a flushed tree"
        time.sleep(0.002)
        cache.check_hicache_events()
    req.init_next_round_input(cache)
    assert req.prefix_len == 0  # the flushed tree reuses nothing
    host_pool = cache.host_pool_group.get_pool(PoolName.MAMBA)
    assert host_pool.available_size() == host_pool.size  # the flush gave every host slot back, once
    Driver(cache, pools).serve(list(range(7000, 7000 + 8 * PAGE)), [8 * PAGE])
    drain_backups(cache)
    cache.sanity_check()


def _kv_keys(store):
    return {k for k in store.keys() if k.startswith("kv/")}


def _path_hashes(cache, tokens):
    """SGLang's page hashes along `tokens`' path in the tree (its storage keys)."""
    node, pos, hashes = cache.tree_core.root_node, 0, []
    while pos < len(tokens):
        child = next((c for c in node.children.values()
                      if list(c.key.token_ids[:len(c.key)]) == tokens[pos:pos + len(c.key)]), None)
        if child is None:
            break
        hashes += list(child.hash_value)
        node, pos = child, pos + len(child.key)
    return hashes


def _check_ssd_ledger(cache):
    """Every node marked SSD-backed has each KV page in the store, and every stored KV page belongs to
    such a node or is an orphan (nothing on SSD escapes the trim, nothing marked is missing)."""
    tier = cache.histate.ssd_tier
    backend, store = tier.backend, tier.backend.store
    marked = set()
    for sg in cache.tree_core._node_arena.values():
        if sg.parent is not None and core_of(sg).ssd_kv:
            keys = {backend.store_key("kv", h) for h in sg.hash_value}
            assert keys <= set(store.keys()), f"node {sg.id} is marked SSD-backed, its pages are not stored"
            marked |= keys
    assert _kv_keys(store) <= marked | tier.orphans.keys()


def _first_prompt_only_on_ssd(tmp_path, monkeypatch):
    """A 16-page prompt with states at 8 and 16 pages, served, then pushed off the host by other prompts
    until SGLang deleted its nodes: its KV pages and states are SSD orphans. Returns (cache, driver,
    the prompt, its KV store keys)."""
    from sglang_cpu.hicache import TieredDriver

    pools = build_pools(1024, 32)
    cache = _small_ssd_cache(tmp_path, pools, monkeypatch, size="16MiB")
    tier, store = cache.histate.ssd_tier, cache.histate.ssd_tier.backend.store
    driver = TieredDriver(cache, pools)
    first = list(range(50_000, 50_000 + 16 * PAGE))
    driver.serve(first, [8 * PAGE, 16 * PAGE])
    assert not _kv_keys(store) and len(store.keys()) == 2  # the two states only
    first_keys = {tier.backend.store_key("kv", h) for h in _path_hashes(cache, first)}
    assert len(first_keys) == 16
    others = 0
    while _path_hashes(cache, first):  # until SGLang deleted the prompt's nodes
        others += 1
        assert others < 40, "the first prompt never left the host"
        start = 100_000 + 10_000 * others
        driver.serve(list(range(start, start + 16 * PAGE)), [8 * PAGE, 16 * PAGE])
        _check_ssd_ledger(cache)
    assert tier.demoting == {} and tier.admitted == frozenset()  # every write ahead acknowledged
    assert first_keys <= _kv_keys(store) and first_keys <= tier.orphans.keys()
    demoted_tokens = cache.histate.metrics.totals["kv_demoted_tokens_total"]
    assert demoted_tokens == PAGE * len(_kv_keys(store))  # each write ahead counted once, in tokens
    assert len(_kv_keys(store)) < 16 * (others + 1)  # not every page of every prompt: only the host's victims
    return cache, driver, first, first_keys


def test_the_ssd_takes_the_kv_the_host_evicts_and_serves_it_back(sglang_plugins, tmp_path, monkeypatch):
    """The SSD is the host's victim tier for KV (docs/policies.md "Tiering"): SGLang's write-through
    stores a prompt's state but not its KV; once the host runs short its lowest-ranked KV is written
    ahead of eviction, so what the host evicts is still on SSD (as orphans), and SGLang's own L3 prefetch
    brings the whole prompt back, its pages then SSD-backed again. An inclusive write-through (every
    page stored at once) or a host eviction without the write ahead fails this."""
    cache, driver, first, first_keys = _first_prompt_only_on_ssd(tmp_path, monkeypatch)
    tier = cache.histate.ssd_tier
    reused = driver.admit(first + [7] * PAGE)  # SGLang's L3 prefetch, then an ordinary host hit
    driver.cache.unlock(driver.admission_lock)
    driver.admission_lock = None
    assert reused == 16 * PAGE
    assert not first_keys & tier.orphans.keys()  # claimed by the nodes the prefetch inserted
    _check_ssd_ledger(cache)
    cache.sanity_check()


def test_a_prefetch_sglang_discards_leaves_its_ssd_objects_orphaned(sglang_plugins, tmp_path, monkeypatch):
    """A hybrid prefetch is all-or-nothing (unified_radix_cache.py:2575-2582 in 0.5.23): when the state
    pool's read fails, SGLang discards the KV it read too and inserts nothing. Those SSD objects belong
    to no node and must stay orphans (which the trim may delete); claiming them, as the plugin did for
    every prefetch with pages, left objects no node owns and no trim could take."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cache, driver, first, first_keys = _first_prompt_only_on_ssd(tmp_path, monkeypatch)
    tier, backend = cache.histate.ssd_tier, cache.histate.ssd_tier.backend
    failed = []
    batch_get_v2 = backend.batch_get_v2

    def state_reads_fail(transfers, extra_info=None):  # the fault: every state page read fails
        results = batch_get_v2(transfers, extra_info)
        for name in results:
            if name != PoolName.KV and any(results[name]):
                failed.append(name)
                results[name] = [False] * len(results[name])
        return results

    monkeypatch.setattr(backend, "batch_get_v2", state_reads_fail)
    reused = driver.admit(first + [7] * PAGE)
    driver.cache.unlock(driver.admission_lock)
    driver.admission_lock = None
    assert failed, "the fault never fired: no state was read from the SSD"
    assert reused == 0 and not _path_hashes(cache, first)  # SGLang discarded the prefetch
    assert first_keys <= tier.orphans.keys()  # still orphans: no node holds them
    _check_ssd_ledger(cache)
    cache.sanity_check()


def test_demotion_does_not_walk_a_full_host_again_while_nothing_changed(sglang_plugins, tmp_path, monkeypatch):
    """While the host stays full, `demote` (once per scheduler step) chose the same bundles from the
    host heap every step, all of them already demoting or SSD-backed. It now walks only after the
    host heap, the pools' free room or the running demotions changed."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from histate.sglang_plugin.ssd_tier import DEMOTE_MARGIN
    from sglang_cpu.hicache import TieredDriver

    pools = build_pools(1024, 32)
    cache = _small_ssd_cache(tmp_path, pools, monkeypatch, size="16MiB")
    driver = TieredDriver(cache, pools)
    for i in range(8):
        start = 100_000 + 10_000 * i
        driver.serve(list(range(start, start + 16 * PAGE)), [8 * PAGE, 16 * PAGE])
    drain_backups(cache)
    kv_pool = cache.host_pool_group.get_pool(PoolName.KV)
    assert kv_pool.available_size() <= DEMOTE_MARGIN * kv_pool.size  # full: every step would walk
    walks, peek = [], cache.histate.victims.peek
    monkeypatch.setattr(cache.histate.victims, "peek", lambda *a, **k: (walks.append(1), peek(*a, **k))[1])
    for _ in range(3):  # the last demotions finish
        drain_backups(cache)
    settled = len(walks)
    for _ in range(20):
        cache.check_hicache_events()
    assert len(walks) == settled  # idle steps: no walk
    driver.serve(list(range(900_000, 900_000 + 16 * PAGE)), [8 * PAGE, 16 * PAGE])
    cache.check_hicache_events()
    assert len(walks) > settled  # a new prompt changed the host heap: walked again
    drain_backups(cache)
    _check_ssd_ledger(cache)
    cache.sanity_check()


def test_the_trim_takes_orphans_and_live_units_lowest_score_first(sglang_plugins, tmp_path, monkeypatch):
    """Orphans keep the eq. 7 score their node had; the trim deletes, among them and the live SSD
    units, the lowest first: everything it took ranks at or below everything it left."""
    from histate.sglang_plugin import eviction

    pools = build_pools(1024, 32)
    cache = _small_ssd_cache(tmp_path, pools, monkeypatch, size="16MiB")
    clock = cache.histate.clock  # the ManualClock `_small_ssd_cache` gave it
    driver = Driver(cache, pools)
    for i in range(14):  # distinct prompts at distinct times: scores differ by recency too
        clock.now = 1.0 + i
        start = 100_000 + 10_000 * i
        driver.serve(list(range(start, start + 16 * PAGE)), [8 * PAGE, 16 * PAGE])
        drain_backups(cache)
    tier, state = cache.histate.ssd_tier, cache.histate.state

    def live_scores():
        return [state.score(core_of(sg), unit, SSD_BIT) for sg in cache.tree_core._node_arena.values()
                for unit in eviction.tier_units(core_of(sg), cache.tree_core, Tier.SSD)]

    assert len(tier.orphans) > 0 and live_scores()
    taken, pop_lowest, on_evicted = [], tier.orphans.pop_lowest, cache.histate.on_evicted

    def recording_pop():
        taken.append(("orphan", tier.orphans.lowest_score()))
        return pop_lowest()

    def recording_evicted(node, unit, t, now_s):
        taken.append(("live", state.score(node, unit, SSD_BIT)))
        return on_evicted(node, unit, t, now_s)

    monkeypatch.setattr(tier.orphans, "pop_lowest", recording_pop)
    monkeypatch.setattr(cache.histate, "on_evicted", recording_evicted)
    import histate.sglang_plugin.ssd_tier as ssd_tier

    # The trim counts nominal sizes (KV bytes per token, checkpoint bytes), which every rank computes alike.
    config = cache.histate.core_config
    nominal = sum(size for _, size in tier.orphans.in_order()) + sum(
        core_of(sg).ssd_kv * len(sg.key) * config.kv_bytes_per_token + core_of(sg).ssd_state * tier.checkpoint_bytes
        for sg in cache.tree_core._node_arena.values() if sg.parent is not None)
    capacity = tier.backend.store.config.capacity_bytes
    monkeypatch.setattr(ssd_tier, "HIGH_WATERMARK", 0.0)
    monkeypatch.setattr(ssd_tier, "LOW_WATERMARK", nominal / 2 / capacity)  # free half of it
    tier.adopt_agreed_usage(nominal)
    freed = tier.trim()
    assert nominal / 2 <= freed < nominal and taken
    remaining = live_scores() + ([tier.orphans.lowest_score()] if len(tier.orphans) else [])
    assert max(score for _, score in taken) <= min(remaining) + 1e-9
    assert {kind for kind, _ in taken} == {"orphan", "live"}  # both kinds compete in this run
    _check_ssd_ledger(cache)


def test_host_bundles_the_state_slots_evict_are_on_the_ssd_first(sglang_plugins, tmp_path, monkeypatch):
    """Issue 27, R2. The host's state slots are a small staging pool (the host budget goes to KV), so
    they run short long before the host KV pool does, and their walk takes whole host leaves (SGLang
    keeps no KV tail without its state). The SSD took host KV only when the KV pool ran short, so
    those leaves' KV left the host and never reached the SSD: on SGLang's server, a 2,048-token device
    pool and 16 prompts left nothing to serve after a flush or a restart. Now the bundles the state-slot
    walk takes next are written ahead too: with a host KV pool that never runs short, the first prompt's
    whole KV comes back from the SSD (SGLang's L3 prefetch) with its terminal state."""
    from sglang_cpu.hicache import TieredDriver
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    import histate.sglang_plugin.ssd_tier as ssd_tier

    pools = build_pools(1024, 32)
    clock = ManualClock(1.0)  # one second per request: distinct recency, so the ranking has no ties
    cache = _small_ssd_cache(tmp_path, pools, monkeypatch, size="16MiB", hicache_ratio=8.0, clock=clock)
    host_kv = _host_pools(cache)[0]
    driver = TieredDriver(cache, pools)
    prompts = [list(range(start, start + 16 * PAGE)) for start in range(200_000, 200_000 + 24 * 10_000, 10_000)]
    assert len(prompts) * 16 * PAGE < (1 - ssd_tier.DEMOTE_MARGIN) * host_kv.size  # the KV pool never runs short
    for prompt in prompts:
        clock.now += 1.0
        driver.serve(prompt, [8 * PAGE, 16 * PAGE])
    leaf = cache.tree_core.node_by_id(cache.tree_core.root_node.id)
    for child in cache.tree_core.root_node.children.values():
        if list(child.key.token_ids[:PAGE]) == prompts[0][:PAGE]:
            leaf = child
    while leaf.children:
        leaf = next(iter(leaf.children.values()))
    assert core_of(leaf).ckpt_mask == SSD_BIT, \
        "the first prompt's terminal state is still on the host: the state slots never ran short"
    assert cache.histate.metrics.totals["kv_demoted_tokens_total"] > 0
    clock.now += 1.0
    reused = driver.admit(prompts[0] + [7] * PAGE)
    driver.cache.unlock(driver.admission_lock)
    driver.admission_lock = None
    assert reused == 16 * PAGE
    _check_ssd_ledger(cache)
    cache.sanity_check()


def test_the_host_budget_counts_the_unified_pools_kv():
    """SGLang's unified pool records the attention KV's bytes on the hybrid pool's `full_kv_pool`
    (`host_capacity_bytes`, unified_memory_pool.py:1773-1777) and reports 0 from the hybrid pool's
    `get_kv_size_bytes()` on purpose; SGLang's own host sizing reads the former. A stand-in of that pool
    shape: the device bytes HiState's host budget is taken from are the full pool's. Read from the hybrid
    pool alone (before), a unified server with 1,024 KV tokens and 8 states got 768 host KV tokens where stock
    SGLang's split gave 1,600; now 2,304 (KV first; docs/results.md)."""
    from types import SimpleNamespace

    from histate.sglang_plugin.host_stack import _device_bytes

    hybrid = SimpleNamespace(full_kv_pool=SimpleNamespace(host_capacity_bytes=1_234_567), host_capacity_bytes=None,
                             get_kv_size_bytes=lambda: 0)
    assert _device_bytes(hybrid) == 1_234_567
    static = SimpleNamespace(get_kv_size_bytes=lambda: (100, 200))  # a static pool: K and V bytes
    assert _device_bytes(static) == 300
