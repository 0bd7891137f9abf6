"""HiState under `--hicache-write-policy write_back` with a host that runs short: SGLang's duplicate reclaim.

Under write_back a segment loaded back from the host keeps its host copy while the device holds it. When
the host pool is short, SGLang 0.5.23 frees those copies first (`UnifiedTreeCore.drive_host_eviction` ->
`_reclaim_full_host_duplicates`, unified_tree_core.py:1941-2035), before the component walk that HiState
ranks (components.py `drive_host_eviction`, eq. 7) evicts any sole host copy. The simulator's
`histate-writeback-via-host` models the plugin with that rule (core/eviction.py `reclaim_host_duplicates`,
test/core/test_host_duplicates.py), and on a host-bound row it is most of write_back's gain
(docs/results.md, "write_back and SGLang's host duplicate reclaim"). This checks the rule on the server's
side: test_write_back.py's stream and rig (SGLang's PrefillAdder, ScheduleBatch, GDN backend, real HiCache
host pools and storage threads with HiState's SSD backend; only the D<->H copy engine is a CPU stand-in)
with a host KV pool 0.6x the device's (`hicache_ratio` 0.6) and no SSD tier, so the host evicts both
duplicates and sole copies. (With an SSD tier each checkpoint goes to the SSD at creation, state_writes.py,
so the MAMBA walk no longer backs up a node's KV to tombstone its state, and this stream leaves the host 3
duplicates to reclaim instead of 19.) Over the run:
  * SGLang reclaimed host duplicates, and in every host eviction it freed duplicates before HiState's walk
    took any sole host copy, taking a sole copy only once no reclaimable duplicate was left;
  * every device state on each request's path, and the one it resumed from, equals a cold prefill of the
    GDN layers (test_differential.py's `_ColdStates`), no state is tombstoned without a host or SSD copy,
    SGLang's `sanity_check` and HiState's H4 (every evictable unit offered) hold after every request:
    the reclaim SGLang does behind HiState's ranking leaves its view of the tiers right (it reads the
    device and host bits through, core_nodes.py).
"""
from __future__ import annotations

from histate.sglang_plugin.core_nodes import FULL

from .test_differential import TRACE, _ColdStates, _stream, _Tokens
from .test_write_back import _Recorder, _rig, serve_checked
from sglang_cpu import gdn_kernels


class _HostEvictions:
    """What each `drive_host_eviction` of the KV (FULL) pool freed, in order: ("duplicate", id) for a host
    copy of device-held KV, ("sole", id) for a host leaf HiState's walk evicted. SGLang reclaims duplicates
    for the KV pool only; a short state pool evicts through HiState's MAMBA walk alone (counted apart)."""

    def __init__(self, monkeypatch, tree_core) -> None:
        from sglang.srt.mem_cache.unified_cache import unified_tree_core as core_module

        self.calls: list = []  # the KV (FULL) pool's
        self.state_pool_calls = 0
        self.duplicates_left_after_sole: list = []
        core_class = core_module.UnifiedTreeCore
        release, evict_leaf, drive = (core_class._release_full_host_duplicate, core_class._evict_host_leaf,
                                      core_class.drive_host_eviction)
        current: list = []

        def released(core, node, *args, **kwargs):
            current.append(("duplicate", node.id))
            return release(core, node, *args, **kwargs)

        def evicted_leaf(core, node, *args, **kwargs):
            current.append(("sole", node.id))
            return evict_leaf(core, node, *args, **kwargs)

        def driven(core, component_type, num_tokens):
            current.clear()
            result = drive(core, component_type, num_tokens)
            if component_type != FULL:
                self.state_pool_calls += bool(current)  # the state pool's walk: no duplicate reclaim there
            elif current:
                self.calls.append(list(current))
                if any(kind == "sole" for kind, _ in current):
                    self.duplicates_left_after_sole += [
                        n.id for n in core._node_arena.values() if core._can_reclaim_full_host_duplicate(n)]
            return result

        monkeypatch.setattr(core_class, "_release_full_host_duplicate", released)
        monkeypatch.setattr(core_class, "_evict_host_leaf", evicted_leaf)
        monkeypatch.setattr(core_class, "drive_host_eviction", driven)


def test_write_back_host_pressure_reclaims_duplicates_before_sole_copies(sglang_plugins, monkeypatch, tmp_path):
    gdn_kernels.install(monkeypatch)
    clock = [0.0]
    # test_write_back.py's rig with a host pool 0.6x the device's 6,144 KV tokens and no SSD tier (at 1x
    # the host never needs a sole copy's room: 8 duplicates reclaimed, no sole copy evicted, the ordering
    # untested)
    rig = _rig(tmp_path, clock, hicache_ratio=0.6, ssd=False)
    cache = rig.cache
    host_evictions = _HostEvictions(monkeypatch, cache.tree_core)
    recorder = _Recorder(cache)
    tokens_of, states = _Tokens(), _ColdStates(rig)
    for i, request in enumerate(_stream(TRACE)):
        clock[0] = float(i)
        serve_checked(rig, f"r{i}", tokens_of(request), states)
    freed = [event for call in host_evictions.calls for event in call]
    print(f"write_back, host 0.6x the device, no SSD tier: {len(host_evictions.calls)} host evictions, "
          f"{sum(k == 'duplicate' for k, _ in freed)} duplicates reclaimed, "
          f"{sum(k == 'sole' for k, _ in freed)} sole host copies evicted ({host_evictions.state_pool_calls} state-pool "
          f"host evictions apart), {recorder.load_backs} load-backs, "
          f"{len(states.checked)} distinct states compared, max |diff| {states.max_diff:.3g}")
    assert recorder.lost == [], f"states tombstoned with no host or SSD copy: {recorder.lost}"
    for call in host_evictions.calls:  # duplicates first, then (if still short) sole copies
        kinds = [kind for kind, _ in call]
        assert kinds == sorted(kinds), call  # "duplicate" < "sole"
    assert host_evictions.duplicates_left_after_sole == []
    # The stream exercises it (this seeded run: 32 host evictions, 19 duplicates reclaimed, 22 sole copies
    # evicted after them, 8 load-backs, 81 states).
    assert sum(kind == "duplicate" for kind, _ in freed) >= 10 and sum(kind == "sole" for kind, _ in freed) >= 5
    assert recorder.load_backs >= 4 and len(states.checked) >= 60
