"""The plugin's L3 writes follow the terminal rule (histate.core.l3_policy): after a request, L3 gets the
KV pages up to the deepest checkpoint HiState holds on the request's path and only that deepest state;
interior checkpoints stay on this server's tiers.

SGLang's real HiCache on CPU (controller, backup thread, L3 prefetch; sglang_cpu.hicache) over
HiState's storage backend, against a real Mooncake master + store service on 127.0.0.1
(histate.l3.services.LoopbackMooncake). What is in L3 is checked on the raw store with stock SGLang's
object names. Skipped with the reason when Mooncake cannot run here.
"""
from __future__ import annotations

import uuid

import pytest
import torch


from .test_l3_mooncake import _histate_server, _keys, _mamba, _probe, _tiered_cache, _use


def _tokens(num_tokens: int) -> list:
    base = 1000 * (uuid.uuid4().int % 100000)  # fresh pages on the module's shared store
    return [base + i for i in range(num_tokens)]


def _path_hashes(cache, tokens: list) -> list:
    """Page hashes of `tokens`' cached path, root to end, as SGLang keys storage objects."""
    from sglang_cpu.pools import PAGE

    hashes, sg, depth = [], cache.tree_core.root_node, 0
    while depth < len(tokens):
        child = next((c for c in sg.children.values()
                      if list(c.key.token_ids[:PAGE]) == tokens[depth:depth + PAGE]), None)
        if child is None:
            break
        hashes += list(child.hash_value or ())
        depth += len(child.key)
        sg = child
    return hashes


class L3View:
    """The raw store under a backend's `MooncakeStore`, asked with stock SGLang's object names:
    `{prefix}_{page_hash}_{tp_rank}_k` / `_v` (KV) and `_temporal` / `_conv_0` (MAMBA), prefix from
    `extra_backend_tag` and the model name (`MooncakeStore.config_prefix`; none without either)."""

    def __init__(self, backend):
        store = backend.l3.store
        self.raw = store.store  # the MooncakeDistributedStore
        self.tag = f"{store.config_prefix}_" if store.config_prefix else ""
        assert str(store.mha_suffix) == "0"  # tp_rank 0

    def _all(self, objects: list) -> bool:
        return all(r == 1 for r in self.raw.batch_is_exist(objects))

    def kv(self, page_hash: str) -> bool:
        return self._all([f"{self.tag}{page_hash}_0_k", f"{self.tag}{page_hash}_0_v"])

    def state(self, page_hash: str) -> bool:
        return self._all([f"{self.tag}{page_hash}_0_temporal", f"{self.tag}{page_hash}_0_conv_0"])



def test_l3_gets_the_terminal_bundle_and_a_fresh_server_restores_it(mooncake, monkeypatch, tmp_path):
    """One prefill plans interior checkpoints at 2 and 5 pages and ends at 8, all three in the tree
    before SGLang's next scheduler step (HiState's in-pass capture: one pass computes them), so the
    backups start with the path complete: every node goes to SSD with its state, L3 gets KV pages
    0..7 and the state at 8 pages alone. A second server with an empty SSD restores 8 pages from L3
    (the interior prefixes 2 and 5 are no resume point there)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from sglang_cpu.hicache import TieredDriver, drain_backups
    from sglang_cpu.pools import PAGE, Driver, build_pools

    _use(mooncake, monkeypatch)
    tokens = _tokens(8 * PAGE)
    pools_a = build_pools(1024, 8)
    cache_a = _tiered_cache(tmp_path, "a", pools_a)
    Driver(cache_a, pools_a).serve(tokens, [2 * PAGE, 5 * PAGE, 8 * PAGE])
    drain_backups(cache_a)
    backend_a = cache_a.histate.ssd_tier.backend
    hashes = _path_hashes(cache_a, tokens)
    assert len(hashes) == 8
    interior, terminal = [hashes[1], hashes[4]], hashes[7]

    # The SSD holds every checkpoint HiState backed up (interior ones included).
    for h in interior + [terminal]:
        assert backend_a.has_state(h, PoolName.MAMBA), h
    # L3: the terminal bundle (KV 0..7 + the state keyed by page 7), no interior state.
    l3 = L3View(backend_a)
    assert [l3.kv(h) for h in hashes] == [True] * 8
    assert l3.state(terminal)
    assert [l3.state(h) for h in interior] == [False, False]
    assert [l3.state(h) for h in hashes] == [False] * 7 + [True]
    assert backend_a.l3_admits_state == cache_a.histate.ssd_tier.l3_admits_state  # the tree cache's hook
    assert not cache_a.histate.ssd_tier.l3_terminal  # the marks go with the acknowledgements
    stats_a = backend_a.histate_stats()
    assert stats_a["l3_errors"] == 0 and stats_a["l3_write_failures"] == 0

    # Server C, empty SSD: over L3 the only resume point is the terminal one (8 pages).
    pools_c = build_pools(1024, 8)
    cache_c = _tiered_cache(tmp_path, "c", pools_c)
    backend_c = cache_c.histate.ssd_tier.backend
    assert not list(backend_c.store.keys())
    result = backend_c.batch_exists_v2(hashes, [_probe()])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (8, [8])
    reused = TieredDriver(cache_c, pools_c).admit(tokens + [1])
    assert reused == 8 * PAGE
    stats_c = backend_c.histate_stats()
    assert (stats_c["l3_hits"], stats_c["l3_misses"], stats_c["l3_errors"]) == (9, 0, 0)  # 8 KV pages + the state
    cache_c.sanity_check()
    cache_c.histate.victims.check_offered()


def test_the_next_turn_writes_its_terminal_state_and_a_moved_session_resumes_there(
        mooncake, monkeypatch, tmp_path):
    """Turn 1 ends at 4 pages (terminal then: in L3). Turn 2 extends the session to 10 pages with an
    interior checkpoint at 7: L3 gets KV 4..9 and the state at 10, not the one at 7; the state at 4,
    interior now, stays in L3 as written (nothing is taken back). The session moves to server C:
    restorable prefixes over L3 are 4 and 10, and C resumes at 10 pages."""
    from sglang_cpu.hicache import TieredDriver, drain_backups
    from sglang_cpu.pools import PAGE, Driver, build_pools

    _use(mooncake, monkeypatch)
    tokens = _tokens(10 * PAGE)
    pools_a = build_pools(1024, 8)
    cache_a = _tiered_cache(tmp_path, "a", pools_a)
    driver = Driver(cache_a, pools_a)
    driver.serve(tokens[:4 * PAGE], [4 * PAGE])
    drain_backups(cache_a)
    l3 = L3View(cache_a.histate.ssd_tier.backend)
    first = _path_hashes(cache_a, tokens[:4 * PAGE])
    assert l3.state(first[3])

    driver.serve(tokens, [7 * PAGE, 10 * PAGE])
    drain_backups(cache_a)
    hashes = _path_hashes(cache_a, tokens)
    assert hashes[:4] == first and len(hashes) == 10
    assert [l3.kv(h) for h in hashes] == [True] * 10
    assert [l3.state(h) for h in hashes] == [False] * 3 + [True] + [False] * 5 + [True]

    pools_c = build_pools(1024, 8)
    cache_c = _tiered_cache(tmp_path, "c", pools_c)
    backend_c = cache_c.histate.ssd_tier.backend
    assert backend_c.batch_exists_v2(hashes, [_probe()]).restorable_prefix_pages == [4, 10]
    assert TieredDriver(cache_c, pools_c).admit(tokens + [1]) == 10 * PAGE
    cache_c.sanity_check()


def test_the_rule_is_decided_when_the_backup_is_queued(mooncake, monkeypatch, tmp_path):
    """A chunked prefill whose backups run between its passes (SGLang's scheduler steps): the state
    at the end of the first chunk (3 pages) is the deepest checkpoint when its backup is queued, so
    it goes to L3; the terminal one (6 pages) too. Nothing is taken back once written."""
    from sglang_cpu.hicache import TieredDriver
    from sglang_cpu.pools import PAGE, build_pools

    _use(mooncake, monkeypatch)
    tokens = _tokens(6 * PAGE)
    pools_a = build_pools(1024, 8)
    cache_a = _tiered_cache(tmp_path, "a", pools_a)
    TieredDriver(cache_a, pools_a).serve(tokens, [3 * PAGE, 6 * PAGE])  # a scheduler step after each pass
    l3 = L3View(cache_a.histate.ssd_tier.backend)
    hashes = _path_hashes(cache_a, tokens)
    assert [l3.kv(h) for h in hashes] == [True] * 6
    assert [l3.state(h) for h in hashes] == [False, False, True, False, False, True]


def test_the_backend_alone_writes_every_state_and_the_hook_filters_states_only(mooncake, monkeypatch, tmp_path):
    """Without a tree cache attached (stock interop) every backed-up state goes to L3; with the hook
    set, states it does not admit stay on the SSD alone while KV pages are written as before."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    _use(mooncake, monkeypatch)
    a, pa = _histate_server(tmp_path)
    l3 = L3View(a)
    keys = _keys(4)
    assert a.l3_admits_state is None
    assert a.batch_set_v1(keys[:2], pa.fill_pages(2, seed=21)) == [True, True]
    assert a.batch_set_v2([_mamba(keys[:2], pa.fill_states(2, seed=22))]) == {PoolName.MAMBA: [True, True]}
    assert [l3.state(k) for k in keys[:2]] == [True, True]

    a.l3_admits_state = lambda page_hash: page_hash == keys[3]
    assert a.batch_set_v1(keys[2:], pa.fill_pages(2, seed=23)) == [True, True]
    assert a.batch_set_v2([_mamba(keys[2:], pa.fill_states(2, seed=24))]) == {PoolName.MAMBA: [True, True]}
    assert [l3.kv(k) for k in keys] == [True] * 4
    assert [l3.state(k) for k in keys[2:]] == [False, True]
    assert all(a.has_state(k, PoolName.MAMBA) for k in keys)  # the SSD keeps every state
    assert a.batch_exists_v2(keys, [_probe()]).restorable_prefix_pages == [1, 2, 3, 4]  # SSD ∪ L3
    a.close()
