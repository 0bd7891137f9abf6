"""HiState under SGLang's `--hicache-write-policy write_back` (issue 28, item 1: the host holds what the
device evicted instead of a mirror of the device).

Under write_back SGLang copies nothing to the host at insert (unified_tree_core.py:1108-1109, 1432-1433);
a node's KV reaches the host when the device evicts it (`_evict_components`' deferred demote,
unified_radix_cache.py:1030-1055). SGLang writes a state to storage only with its node's host backup, so
HiState writes each new checkpoint to the SSD at creation itself, through a host staging slot
(sglang_plugin/state_writes.py); a node whose state is on the SSD is backed up with its KV alone, and its
MAMBA walk tombstones such a state without a backup. A state the SSD does not hold (no SSD tier, a failed
write) takes SGLang's host path: the MAMBA walk asks for the node's backup where SGLang's own walk does, and
before tombstoning a state inside a backed-up node too (components.py `_MambaWalks`; upstream/series 0006
keeps SGLang's rule in `_evict_device_state`); otherwise a checkpoint leaves the device with no copy anywhere.

The stream is test_differential.py's (4 interleaved agent sessions, 24 requests, the GDN rig: SGLang's
PrefillAdder, ScheduleBatch, GDN backend, real HiCache host pools and storage threads with HiState's SSD
backend; only the D<->H copy engine is a CPU stand-in), on a device pool that holds about one session, so
every later turn comes back from the host or the SSD. After every request:
  * every device state on the request's path, and the one it resumed from, equals a cold prefill of the
    GDN layers to that position (`_ColdStates`: no SGLang code, no pool, no capture);
  * SGLang's `sanity_check` and HiState's H4 (every evictable unit is offered);
and over the run: every checkpoint of the first request is on the SSD, and the store holds nothing else,
before anything is evicted; no state leaves the device without a host or SSD copy; no state the SSD holds
is copied to the host with its node's KV; the SSD tier's S1 and S4 hold while writes are in flight; KV was
written back and then served from the host (load-back), states from the SSD (restores).
"""
from __future__ import annotations

import pytest

from histate.sglang_plugin.core_nodes import MAMBA, core_of

from ._scheduler_round import serve_request
from .test_differential import CHUNK, TRACE, _ColdStates, _stream, _Tokens
from sglang_cpu import gdn_kernels
from sglang_cpu.gdn_rig import GRID, GdnRig


def _rig(tmp_path, clock, hicache_ratio: float = 4.0, ssd: bool = True) -> GdnRig:
    from histate.sglang_plugin.config import resolve_config

    storage = {"ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file", "ssd_size_bytes": "256MiB"} if ssd else {}
    config = resolve_config({"enable": True, **storage, "intervals_tokens": "192"}, {})
    # 6,144 device KV tokens and 24 state slots: one session's context (up to ~4,200 tokens) plus a pass.
    # One interval (192 tokens, three grid steps), so the checkpoints do not depend on eq. 5's pricing:
    # under write_back it prices a checkpoint by its stay on this small device and plans few (PolicyState).
    # Off the 128-token grid of the planner's other intervals, so checkpoints land inside nodes already
    # backed up, on interior nodes and on leaves: both write_back paths that lost states are driven.
    return GdnRig("fp32", config, mamba_slots=24, kv_tokens=6144, hicache_ratio=hicache_ratio, clock=lambda: clock[0],
                  kv_heads=4, kv_head_dim=32, write_policy="write_back")


def serve_checked(rig: GdnRig, name: str, tokens, states: _ColdStates):
    """Serve one request on the rig and check it: every state it planned and the one it resumed from
    equal a cold prefill, SGLang's `sanity_check` and HiState's H4 hold. Returns the request."""
    cache = rig.cache
    req = rig.request(name, tokens)
    seen: set = set()
    serve_request(rig, req, CHUNK, lambda: states.check(req.rid, tokens, seen))
    rig.forget(req.rid)
    assert set(req._hs_plan) <= seen, (name, sorted(set(req._hs_plan) - seen))
    if req._hs_admitted[0]:
        assert req._hs_admitted[0] in seen, (name, req._hs_admitted)
    cache.sanity_check()
    cache.histate.victims.check_offered()
    return req


class _Recorder:
    """Counts SGLang's write-back backups and every device state tombstone, noting a tombstone that
    leaves the state with no host or SSD copy (a lost checkpoint)."""

    def __init__(self, cache):
        from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

        self.write_backs = self.device_tombstones = self.load_backs = 0
        self.kv_only_backups_of_ssd_states = 0  # host backups of a node whose state is on SSD: KV alone
        self.ssd_states_copied_to_host: list = []  # ... that copied the state too (state_writes.py: never)
        self.lost: list = []
        backup, tombstone = cache._execute_and_commit_kv_backup, cache.tree_core._evict_component_and_detach_lru
        load_back, commit_backup = cache.load_back, cache.tree_core.commit_backup

        def checked_commit_backup(node_id, host_indices, comp_xfers):
            if core_of(cache.tree_core.node_by_id(node_id)).ssd_state:
                if MAMBA in comp_xfers:
                    self.ssd_states_copied_to_host.append(node_id)
                else:
                    self.kv_only_backups_of_ssd_states += 1
            return commit_backup(node_id, host_indices, comp_xfers)

        def counted_load_back(node_id, *args, **kwargs):
            loaded = load_back(node_id, *args, **kwargs)
            self.load_backs += bool(loaded)
            return loaded

        def counted_backup(action, write_back=False):
            self.write_backs += bool(write_back)
            return backup(action, write_back=write_back)

        def checked_tombstone(node, component, *args, target=EvictLayer.DEVICE, **kwargs):
            if target == EvictLayer.DEVICE and component.component_type == MAMBA and \
                    node.component_data[MAMBA].value is not None:
                self.device_tombstones += 1
                if node.component_data[MAMBA].host_value is None and not core_of(node).ssd_state:
                    self.lost.append(node.id)
            return tombstone(node, component, *args, target=target, **kwargs)

        cache._execute_and_commit_kv_backup = counted_backup
        cache.tree_core.commit_backup = checked_commit_backup
        cache.load_back = counted_load_back
        cache.tree_core._evict_component_and_detach_lru = checked_tombstone


def test_write_back_serves_every_state_exactly_and_loses_none(sglang_plugins, monkeypatch, tmp_path):
    gdn_kernels.install(monkeypatch)
    clock = [0.0]
    rig = _rig(tmp_path, clock)
    cache = rig.cache
    assert cache.is_write_back and cache.cache_controller.write_policy == "write_back"
    recorder = _Recorder(cache)
    store = cache.histate.ssd_tier.backend.store
    tokens_of, states = _Tokens(), _ColdStates(rig)
    resumed = 0
    writes, checked_in_flight = cache.histate.ssd_tier.state_writes, []
    start = writes.start

    def start_and_check():  # S1 and S4 while state writes are in flight (docs/invariants.md)
        started = start()
        if writes.writes:
            cache.histate.ssd_tier.check_invariants()
            checked_in_flight.append(len(writes.writes))
        return started

    writes.start = start_and_check
    for i, request in enumerate(_stream(TRACE)):
        clock[0] = float(i)
        req = serve_checked(rig, f"r{i}", tokens_of(request), states)
        if i == 0:
            # write_back: the insert copied nothing to the host; each checkpoint went to the SSD alone
            # (state_writes.py), through a staging slot that is free again
            nodes = [n for n in cache.tree_core._node_arena.values() if n.parent is not None]
            assert recorder.write_backs == 0 and not any(n.backuped for n in nodes)
            # every checkpoint is on the SSD, the store holds nothing else, and the historical ones
            # (their node has a child) live there alone (asymmetric tiering)
            with_state = [n for n in nodes if core_of(n).ckpt_mask]
            assert len(with_state) >= 3 and all(core_of(n).ssd_state for n in with_state)
            assert sorted(store.keys()) == sorted(cache.histate.ssd_tier.state_key(n.hash_value[-1]) for n in with_state)
            assert all(n.component_data[MAMBA].value is None for n in with_state if n.children)
            assert cache.histate.ssd_tier.state_writes.host_pool.available_size() == \
                cache.histate.ssd_tier.state_writes.host_pool.size
        resumed += bool(req._hs_admitted[0])
    restores = cache.histate.metrics.totals.get(("ssd_restores_total", "ok"), 0)
    print(f"write_back: {recorder.write_backs} backups, {recorder.device_tombstones} device state tombstones, "
          f"{resumed} resumed, {recorder.load_backs} host load-backs, {restores} SSD restores, "
          f"{len(states.checked)} distinct states compared, max |diff| {states.max_diff:.3g}")
    assert recorder.lost == [], f"states tombstoned with no host or SSD copy: {recorder.lost}"
    # a state on the SSD is not copied to the host when its node's KV is backed up (components.py)
    assert recorder.ssd_states_copied_to_host == [] and recorder.kv_only_backups_of_ssd_states >= 5
    # The stream exercises what it checks (this seeded run: 50 write-back backups, 119 device state
    # tombstones, 22 requests resumed, 17 host load-backs, 17 SSD restores, 109 distinct states compared;
    # before the state-only writes: 59, 67, 22, 8, 4 and 80).
    assert recorder.write_backs >= 40 and recorder.device_tombstones >= 80
    assert resumed >= 15 and recorder.load_backs >= 8 and restores >= 10
    assert len(states.checked) >= 100  # 109
    assert len(checked_in_flight) >= 20 and max(checked_in_flight) == writes.max_in_flight
    print(f"state-only writes: {writes.num_started} started, {writes.num_stored} stored, {writes.num_failed} failed; "
          f"{recorder.kv_only_backups_of_ssd_states} KV-only backups of nodes whose state is on SSD")
    assert writes.num_stored == writes.num_started >= 50 and writes.num_failed == 0
    assert any(core_of(n).ssd_state for n in cache.tree_core._node_arena.values())


def test_the_host_path_without_an_ssd_tier_loses_no_state(sglang_plugins, monkeypatch, tmp_path):
    """No SSD tier: every state takes SGLang's host path (a write the SSD refused takes it too). Two ways
    of losing a state there are driven: a checkpoint inside a backed-up node (SGLang's MAMBA walk rule,
    components/mamba.py:427-437) and a backed-up device leaf that gained its state after the backup
    (SGLang demotes it as it is); `eviction.write_back_moves_state` and `leaf_state_needs_backup` keep both."""
    gdn_kernels.install(monkeypatch)
    clock = [0.0]
    rig = _rig(tmp_path, clock, ssd=False)
    cache = rig.cache
    assert cache.histate.ssd_tier is None
    recorder = _Recorder(cache)
    tokens_of, states = _Tokens(), _ColdStates(rig)
    for i, request in enumerate(_stream(TRACE)):
        clock[0] = float(i)
        serve_checked(rig, f"r{i}", tokens_of(request), states)
    print(f"write_back, host path only: {recorder.write_backs} backups, {recorder.device_tombstones} device state "
          f"tombstones, {recorder.load_backs} load-backs, {len(states.checked)} distinct states compared")
    assert recorder.lost == [], f"states tombstoned with no host copy: {recorder.lost}"
    assert recorder.write_backs >= 40 and recorder.load_backs >= 4 and len(states.checked) >= 60


def test_a_state_write_claims_the_orphan_under_its_key_from_the_start(sglang_plugins, tmp_path):
    """A flush turns every SSD object into an orphan; the same prompt served again writes its states under
    the same keys. Each write claims the orphan under its key when it starts, not only when it is agreed:
    until then the trim (or the store's capacity callback on SGLang's backup thread) could delete the object
    the write will count as stored (the store already holds it, so the write does not write it again)."""
    from histate.sglang_plugin.config import resolve_config
    from histate.sglang_plugin.server_settings import storage_extra_config
    from sglang_cpu.hicache import TieredDriver, build_hicache
    from sglang_cpu.pools import PAGE, Driver, ManualClock, build_pools

    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file",
                             "ssd_size_bytes": "64MiB"}, {})
    pools = build_pools(1024, 32)
    cache = build_hicache("histate", pools, histate_config=config, storage_extra=storage_extra_config(None, config),
                          clock=ManualClock(1.0), write_policy="write_back")
    tier, prompt = cache.histate.ssd_tier, list(range(1, 16 * PAGE + 1))
    TieredDriver(cache, pools).serve(prompt, [4 * PAGE, 8 * PAGE, 16 * PAGE])
    keys = sorted(tier.backend.store.keys())
    assert len(keys) == 3 and not any(key in tier.orphans for key in keys)
    cache.reset()  # flush_cache: the three objects are orphans now
    assert all(key in tier.orphans for key in keys)
    Driver(cache, pools).serve(prompt, [4 * PAGE, 8 * PAGE, 16 * PAGE])  # inserted, no scheduler step yet
    cache.check_hicache_events()  # a step: the three writes start
    assert len(tier.state_writes.writes) == 3
    assert not any(key in tier.orphans for key in keys), "a started write left its key to the trim"
    for job in tier.state_writes.writes:  # the I/O thread's writes end (the store held them already)
        job.write.result()
    cache.check_hicache_events()  # agreed: stored
    assert tier.state_writes.num_stored == 6 and sorted(tier.backend.store.keys()) == keys
    tier.check_invariants()
