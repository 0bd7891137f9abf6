"""HiState under SGLang's `--hicache-write-policy write_back` (issue 28, item 1: the host holds what the
device evicted instead of a mirror of the device).

Under write_back SGLang copies nothing to the host at insert (unified_tree_core.py:1108-1109, 1432-1433);
a node reaches the host when the device evicts it, its KV and its unbacked states together
(`_evict_components`' deferred demote, unified_radix_cache.py:1030-1055; the MAMBA walk's internal-state
backup, `backup_node_for_write_back`, :884-889 and :1647-1663), and the storage write-through after that
backup's ack puts its state on HiState's SSD (:1805-1818). HiState changes only which unit goes next, so
its MAMBA walk must ask for that backup where SGLang's own walk does (components.py `_MambaWalks`;
upstream/series 0006 keeps SGLang's rule in `_evict_device_state`); otherwise a checkpoint leaves the device
with no copy anywhere.

The stream is test_differential.py's (4 interleaved agent sessions, 24 requests, the GDN rig: SGLang's
PrefillAdder, ScheduleBatch, GDN backend, real HiCache host pools and storage threads with HiState's SSD
backend; only the D<->H copy engine is a CPU stand-in), on a device pool that holds about one session, so
every later turn comes back from the host or the SSD. After every request:
  * every device state on the request's path, and the one it resumed from, equals a cold prefill of the
    GDN layers to that position (`_ColdStates`: no SGLang code, no pool, no capture);
  * SGLang's `sanity_check` and HiState's H4 (every evictable unit is offered);
and over the run: no state leaves the device without a host or SSD copy while the host had room, KV and
states were written back and then served from the host (load-back) and from the SSD (restores). Two
ways of losing a state are driven: a checkpoint inside a backed-up node (SGLang's MAMBA walk rule; the
run loses 2 states with it) and a backed-up device leaf that gained its state after the backup (SGLang
demotes it as it is; 1 state lost without `leaf_state_needs_backup`).
"""
from __future__ import annotations

import pytest

from histate.sglang_plugin.core_nodes import MAMBA, core_of

from .test_differential import TRACE, _ColdStates, _plugin_serve, _stream, _Tokens
from sglang_cpu import gdn_kernels
from sglang_cpu.gdn_rig import GRID, GdnRig


def _rig(tmp_path, clock, hicache_ratio: float = 4.0) -> GdnRig:
    from histate.sglang_plugin.config import resolve_config

    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file",
                             "ssd_size_bytes": "256MiB", "intervals_tokens": "192"}, {})
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
    _plugin_serve(rig, req, lambda: states.check(req.rid, tokens, seen))
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
        self.lost: list = []
        backup, tombstone = cache._execute_and_commit_kv_backup, cache.tree_core._evict_component_and_detach_lru
        load_back = cache.load_back

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
    for i, request in enumerate(_stream(TRACE)):
        clock[0] = float(i)
        req = serve_checked(rig, f"r{i}", tokens_of(request), states)
        if i == 0:
            # write_back: the insert copied nothing to the host, so nothing reached the SSD either
            assert recorder.write_backs == 0 and not store.keys()
            assert not any(n.backuped for n in cache.tree_core._node_arena.values())
        resumed += bool(req._hs_admitted[0])
    restores = cache.histate.metrics.totals.get(("ssd_restores_total", "ok"), 0)
    print(f"write_back: {recorder.write_backs} backups, {recorder.device_tombstones} device state tombstones, "
          f"{resumed} resumed, {recorder.load_backs} host load-backs, {restores} SSD restores, "
          f"{len(states.checked)} distinct states compared, max |diff| {states.max_diff:.3g}")
    assert recorder.lost == [], f"states tombstoned with no host or SSD copy: {recorder.lost}"
    # The stream exercises what it checks (this seeded run: 59 write-back backups, 67 device state
    # tombstones, 22 requests resumed, 8 host load-backs, 4 SSD restores, 80 distinct states compared).
    assert recorder.write_backs >= 40 and recorder.device_tombstones >= 40
    assert resumed >= 15 and recorder.load_backs >= 4 and restores >= 2
    assert len(states.checked) >= 70  # 80
    assert any(core_of(n).ssd_state for n in cache.tree_core._node_arena.values())
