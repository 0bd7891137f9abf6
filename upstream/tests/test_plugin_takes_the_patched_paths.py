"""With the series applied, the plugin uses the public paths the patches add instead of its own
workarounds: each test here fails if the plugin silently kept its workaround."""
from __future__ import annotations

import sys
import types
from collections import defaultdict

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry

from histate.sglang_plugin import hook_points, hooks


@pytest.fixture
def probe_group(monkeypatch):
    """An isolated registry and group record, and a probe target outside the hook table."""
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(hooks, "_installed", set())
    monkeypatch.setattr(hooks, "_failed", {})
    monkeypatch.setattr(hooks, "_check_listed", lambda group, group_hooks: None)
    monkeypatch.setattr(hooks, "registry_hook", lambda target: hook_points.HookPoint(
        target, "probe", "probe", "probe", hook_points.parameter_names(hooks.resolve_target(target)), "probe"))
    monkeypatch.setattr(hooks, "_forget", lambda *a: pytest.fail("0001 applied: the private cleanup must not run"))

    class Probe:
        @staticmethod
        def helper(x):
            return x - 1

    module = types.ModuleType("upstream_hook_probe")
    module.Probe = Probe
    monkeypatch.setitem(sys.modules, module.__name__, module)


def _after(result, *args, **kwargs):
    return result * 10


def test_0001_a_group_that_fails_to_apply_is_refused_through_the_registrys_strict_mode(probe_group, monkeypatch):
    assert hooks._has_strict_apply(HookRegistry)

    def boom(cls, target, hook_list):
        raise TypeError("cannot patch")

    monkeypatch.setattr(HookRegistry, "_apply_target", classmethod(boom))
    with pytest.raises(RuntimeError, match=r"upstream_hook_probe\.Probe\.helper not patched \(HookRegistry: "
                                           r"TypeError: cannot patch\)"):
        hooks.install_once("probe", [("upstream_hook_probe.Probe.helper", _after, "AFTER")])
    assert "upstream_hook_probe.Probe.helper" not in HookRegistry._hooks  # SGLang dropped it, not the plugin


def test_0002_cuts_come_from_the_caches_grid_not_from_hooks():
    """The chunking hooks are not installed; SGLang's PrefillAdder reads the cache's grid."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    from histate.sglang_plugin import chunking

    assert chunking.upstream_cut_grid()
    chunking.install_chunk_planning()
    assert not hooks.is_installed("chunking")
    assert not any(t.startswith("sglang.srt.managers.schedule_policy.PrefillAdder") and HookRegistry.is_patched(t)
                   for t in HookRegistry._hooks)
    assert "cache_cut_grid" in PrefillAdder.__init__.__code__.co_names


def test_0003_histate_flags_are_declared_to_sglang_not_hooked_onto_server_args():
    """register() puts HiState's spec in SGLang's plugin-argument registry and patches no ServerArgs method."""
    from sglang.srt.arg_groups.plugin_args import plugin_config, registered_plugin_args
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    from histate.sglang_plugin import cli_hooks

    load_plugins()
    assert [spec.name for spec in registered_plugin_args()] == [cli_hooks.PLUGIN_ARGS_NAME]
    assert not hooks.is_installed("server_args")
    assert not any(t.startswith("sglang.srt.server_args.ServerArgs.") for t in HookRegistry._hooks)
    assert not hasattr(ServerArgs.from_cli_args, "__wrapped__")
    record = prepare_server_args(["--model-path", "dummy", "--enable-histate", "--histate-tau", "90"])
    config = plugin_config(record, cli_hooks.PLUGIN_ARGS_NAME)
    assert config.enable and config.tau_s == 90.0
    assert not hasattr(record, "_histate_config")  # the plugin's own stash is not used
    assert record.radix_cache_backend == "histate"  # implied settings written through the spec's apply


def test_0003_a_declaration_sglang_refuses_fails_closed(monkeypatch, capsys):
    """Another spec already owns the name: a process that asks for HiState exits in one line (as on
    stock when the ServerArgs hooks cannot be installed), and nothing else is registered."""
    from sglang.srt.arg_groups import plugin_args
    from sglang.srt.arg_groups.plugin_args import PluginArgs, register_plugin_args
    from sglang.srt.mem_cache import registry

    from histate.sglang_plugin import cli_hooks, plugin

    monkeypatch.setattr(plugin_args, "_REGISTRY", {})
    register_plugin_args(PluginArgs(name=cli_hooks.PLUGIN_ARGS_NAME, title="someone else's",
                                    add_arguments=lambda group: None, parse=lambda namespace: None))
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(sys, "argv", ["sglang.launch_server", "--model-path", "m", "--enable-histate"])
    backends_before = set(registry.registered_radix_cache_backends())
    with pytest.raises(SystemExit) as exit_info:
        plugin.register()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "sglang serve: error: --enable-histate: plugin arguments 'histate' are already registered by another spec")
    assert set(registry.registered_radix_cache_backends()) == backends_before


def test_0004_histate_series_are_made_by_sglangs_cache_collector(monkeypatch):
    """With `add_counter` / `add_gauge`, every HiState series comes from the collector SGLang built for the
    cache; the plugin's own prometheus_client path is not taken."""
    import prometheus_client
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector
    from sglang.srt.runtime_context import get_parallel

    from histate.sglang_plugin import metrics
    from sglang_cpu.pools import build_cache, build_pools, publish_server_args
    from sglang.srt.plugins import load_plugins
    from test.sglang.test_metrics_export import FakeFamily

    load_plugins()
    FakeFamily.made = {}
    for attr in ("_counter_cls", "_gauge_cls", "_histogram_cls"):
        monkeypatch.setattr(RadixCacheMetricsCollector, attr, FakeFamily)
    made_by_collector = []
    add_counter, add_gauge = RadixCacheMetricsCollector.add_counter, RadixCacheMetricsCollector.add_gauge
    monkeypatch.setattr(RadixCacheMetricsCollector, "add_counter",
                        lambda self, name, *a, **k: made_by_collector.append(name) or add_counter(self, name, *a, **k))
    monkeypatch.setattr(RadixCacheMetricsCollector, "add_gauge",
                        lambda self, name, *a, **k: made_by_collector.append(name) or add_gauge(self, name, *a, **k))
    monkeypatch.setattr(prometheus_client, "Counter", lambda *a, **k: pytest.fail("the plugin's own Counter"))
    monkeypatch.setattr(prometheus_client, "Gauge", lambda *a, **k: pytest.fail("the plugin's own Gauge"))
    monkeypatch.setattr(metrics, "_shared", {})
    assert metrics.upstream_cache_series()
    publish_server_args()
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        cache = build_cache("histate", build_pools(kv_tokens=512, mamba_slots=8), params_fields={"enable_metrics": True})
    ours = sorted(name for name in FakeFamily.made if name.startswith("sglang:histate_"))
    assert ours and sorted(f"sglang:{name}" for name in made_by_collector) == ours
    assert cache.histate.metrics.labels == cache.metrics_collector.labels


def test_0005_the_change_feed_comes_from_sglangs_tree_core_observers():
    """HiState's tree core overrides none of SGLang's private mutators; its observer is registered with the
    core, and the victim heaps still hear an insert (a leaf the eviction walk can pop)."""
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    from histate.sglang_plugin import tree_core
    from sglang_cpu.pools import build_cache, build_pools, publish_server_args

    assert tree_core.OBSERVED_BY_SGLANG
    overridden = {name for name, value in vars(tree_core.HiStateTreeCore).items()
                  if callable(value) and name in vars(UnifiedTreeCore)}
    assert overridden == set(), overridden
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent

    from histate.sglang_plugin.components import HiStateFullComponent

    # the lock's dropped leaf reaches the observer: no re-offer override on FULL's lock
    assert HiStateFullComponent.acquire_component_lock is FullComponent.acquire_component_lock
    publish_server_args()
    cache = build_cache("histate", build_pools(kv_tokens=512, mamba_slots=8))
    observers = cache.tree_core._observers
    assert [type(o) for o in observers] == [tree_core.HiStateTreeObserver]
    assert observers[0].histate is cache.histate


def test_0006_sglangs_walks_ask_histates_ranker_and_no_walk_is_overridden():
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    from histate.sglang_plugin import components
    from sglang_cpu.pools import build_cache, build_pools, publish_server_args

    assert components.RANKED_BY_SGLANG
    walks = {"_evict_device_start", "_evict_device_next_node", "_evict_device_end", "drive_host_eviction"}
    for ours, theirs in ((components.HiStateFullComponent, FullComponent),
                         (components.HiStateMambaComponent, MambaComponent)):
        resolved = {name for name in walks if getattr(ours, name) is not getattr(theirs, name)}
        assert resolved == set(), (ours.__name__, resolved)
    publish_server_args()
    cache = build_cache("histate", build_pools(kv_tokens=512, mamba_slots=8))
    assert type(cache.tree_core.eviction_ranker) is components.HiStateRanker
    assert cache.tree_core.eviction_ranker.histate is cache.histate


def test_0007_inserts_splits_and_matches_reach_histate_from_sglangs_events():
    """No MAMBA insert/split hook and no match override: the plugin's observer hears them from SGLang, and
    what it does with them still happens (a new leaf stamped and offered, a match learned from)."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from histate.sglang_plugin import components, tree_cache, tree_core
    from histate.sglang_plugin.core_nodes import core_of
    from sglang_cpu.pools import PAGE, Driver, build_cache, build_pools, publish_server_args

    assert tree_core.WALK_EVENTS_BY_SGLANG
    for name in ("commit_insert_component_data", "redistribute_on_node_split", "refresh_lru"):
        assert getattr(components.HiStateMambaComponent, name) is getattr(MambaComponent, name), name
    assert tree_cache.HiStateRadixCache._match_tree is UnifiedRadixCache._match_tree
    publish_server_args()
    pools = build_pools(kv_tokens=512, mamba_slots=8)
    cache = build_cache("histate", pools)
    tokens = list(range(1, 4 * PAGE + 1))
    calls = []
    for name in ("new_node", "new_checkpoint", "on_match"):  # what HiState does on each event, spied on
        inner = getattr(cache.histate, name)
        setattr(cache.histate, name, lambda *args, _name=name, _inner=inner, **kwargs: calls.append(
            (_name, args[1] if _name == "on_match" else None)) or _inner(*args, **kwargs))
    Driver(cache, pools).serve(tokens, checkpoints=[4 * PAGE])
    assert ("new_node", None) in calls and ("new_checkpoint", None) in calls  # the insert's commit
    matches = [tokens for name, tokens in calls if name == "on_match"]
    assert matches[0] == 0 and matches[-1] == 4 * PAGE  # the first match found nothing, the last all of it


def test_0008_hicaches_storage_path_asks_histates_policy_and_nothing_is_overridden(tmp_path):
    """None of the six HiCache methods is overridden; the cache's `StorageTierPolicy` is HiState's, through a
    flush too, and a request's state still reaches the SSD, acknowledged and confirmed by HiState's tier
    (its write-through filter, acks and per-step work now run from SGLang's calls)."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from histate.sglang_plugin import hook_points, storage_policy, tree_cache
    from histate.sglang_plugin.config import resolve_config
    from histate.sglang_plugin.server_settings import storage_extra_config
    from sglang_cpu.hicache import TieredDriver, build_hicache, drain_backups
    from sglang_cpu.pools import PAGE, ManualClock, build_pools

    assert storage_policy.STORAGE_POLICY_BY_SGLANG
    for _, target in hook_points.RETIRED_BY_PATCH["0008-hicache-storage-tier-policy"]:
        name = target.rsplit(".", 1)[-1]
        assert getattr(tree_cache.HiStateRadixCache, name) is getattr(UnifiedRadixCache, name), name
    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file",
                             "ssd_size_bytes": "64MiB"}, {})
    pools = build_pools(1024, 32)
    cache = build_hicache("histate", pools, histate_config=config, storage_extra=storage_extra_config(None, config),
                          clock=ManualClock(1.0))
    assert type(cache.storage_tier_policy) is storage_policy.HiStateStoragePolicy
    steps = []
    on_step = cache.storage_tier_policy.on_step
    cache.storage_tier_policy.on_step = lambda: steps.append(1) or on_step()
    TieredDriver(cache, pools).serve(list(range(1, 16 * PAGE + 1)), [16 * PAGE])
    drain_backups(cache)
    tier = cache.histate.ssd_tier
    assert tier.backend.num_states == 1 and not tier.backups  # written through, acknowledged, confirmed
    assert steps  # the SSD tier's per-step work ran from SGLang's step
    policy = cache.storage_tier_policy
    cache.reset()
    assert cache.storage_tier_policy is policy


def test_0009_session_releases_reach_histate_from_sglangs_events():
    """FULL's and MAMBA's session-coverage walks are SGLang's own, and closing a session re-offers the nodes
    it held (HiState's victim heaps, spied on), as the stock mixins did."""
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    from histate.sglang_plugin import components, tree_core
    from histate.sglang_plugin.core_nodes import core_of
    from test.sglang.test_session_radix import SessionRig

    assert tree_core.SESSION_EVENTS_BY_SGLANG
    for ours, theirs, names in ((components.HiStateFullComponent, FullComponent,
                                 ("_dec_session_coverage", "_recede_session_coverage")),
                                (components.HiStateMambaComponent, MambaComponent, ("_dec_session_coverage",))):
        for name in names:
            assert getattr(ours, name) is getattr(theirs, name), (ours.__name__, name)
    rig = SessionRig("histate")
    tokens = list(range(1, 33))
    assert rig.turn(tokens, "s1")
    core = rig.cache.tree_core
    held = {core_of(n) for n in core._node_arena.values() if n is not core.root_node}
    touched = []
    touch = rig.cache.histate.victims.touch
    rig.cache.histate.victims.touch = lambda node: touched.append(node) or touch(node)
    rig.cache.release_radix_session("s1")
    assert held and held <= set(touched)
    rig.check()


def test_0010_the_restore_hold_and_the_restored_state_go_through_sglangs_api(tmp_path):
    """No admission or abort override, no host-value primitive of HiState's own; an SSD-only checkpoint is
    still restored before its request is admitted (held by the policy, placed by SGLang's primitive)."""
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from histate.sglang_plugin import storage_policy, tree_cache, tree_core

    assert storage_policy.RESTORE_HOLD_BY_SGLANG and tree_core.HOST_VALUE_BY_SGLANG
    for name in ("check_prefetch_progress", "release_aborted_request"):
        assert getattr(tree_cache.HiStateRadixCache, name) is getattr(UnifiedRadixCache, name), name
    assert tree_core.HiStateTreeCore.set_component_host_value is UnifiedTreeCore.set_component_host_value
    import time

    from sglang_cpu.pools import PAGE, ManualClock, build_pools
    from test.sglang.test_hicache_tiers import _request, _ssd_only_checkpoint

    placed = []
    original = UnifiedTreeCore.set_component_host_value

    def spy(self, node_id, component_type, value):
        placed.append(node_id)
        return original(self, node_id, component_type, value)

    UnifiedTreeCore.set_component_host_value = spy
    try:
        cache, tokens, node, _ = _ssd_only_checkpoint(tmp_path, build_pools(1024, 8), ManualClock(1.0))
        req = _request(tokens[:6 * PAGE] + [1] * PAGE)
        req.init_next_round_input(cache)  # the waiting request's match: its checkpoint is on SSD only
        handle = req.cache_request_handle
        rounds = 0
        while not cache.check_prefetch_progress(handle):  # held by HiState's policy while the read runs
            rounds += 1
            assert rounds < 5000, "the restore never completed"
            time.sleep(0.002)
            cache.check_hicache_events()
    finally:
        UnifiedTreeCore.set_component_host_value = original
    assert rounds >= 1 and placed == [node.id]  # held, then placed through SGLang's primitive
    assert node.component_data[2].host_value is not None
    cache.sanity_check()


def test_0011_sglang_asks_histate_for_its_host_sizes_and_nothing_is_hooked():
    """No stack strategy of HiState's and no host-pool builder hook; the HiState cache's host pools have
    HiState's KV-first split (its staging slots of states, the rest KV), answered through
    `host_pool_sizes`."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler
    from sglang.srt.plugins.hook_registry import HookRegistry

    from histate.sglang_plugin import host_stack
    from sglang_cpu.hicache import build_hicache
    from sglang_cpu.pools import build_pools

    assert host_stack.SIZED_BY_SGLANG
    host_stack.install_host_policy()
    assert not any(type(s).__name__ == "HiStateMambaStackStrategy" for s in assembler._STRATEGIES)
    hooked = {target for target, entries in HookRegistry._hooks.items()
              if any(getattr(entry[1], "__module__", "").startswith("histate.") for entry in entries)}
    assert not hooked & {f"{assembler.__name__}.{name}" for name in ("build_kv_host_pool", "build_mamba_host_pool")}
    cache = build_hicache("histate", build_pools(1024, 32))
    split = cache.histate_host_split
    mamba = cache.host_pool_group.get_pool(PoolName.MAMBA)
    assert split.state_slots <= mamba.size <= split.state_slots + mamba.page_size  # the staging slots only
    kv = cache.host_pool_group.get_pool(PoolName.KV)
    assert kv.size * kv.size_per_token <= split.kv_bytes + kv.page_size * kv.size_per_token


def test_0012_sglang_asks_histates_cache_for_the_chunk_cap_and_nothing_is_hooked():
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang.srt.plugins.hook_registry import HookRegistry

    from histate.sglang_plugin import short_prefill
    from histate.sglang_plugin.config import resolve_config
    from sglang_cpu.pools import build_cache, build_pools, publish_server_args

    assert short_prefill.LIMITED_BY_SGLANG
    short_prefill.install_short_prefill_first()
    target = "sglang.srt.managers.schedule_policy.SchedulePolicy.shortest_prefill_chunk_limit"
    assert not any(getattr(entry[1], "__module__", "").startswith("histate.")
                   for entry in HookRegistry._hooks.get(target, ()))
    assert not hasattr(SchedulePolicy.shortest_prefill_chunk_limit, "__wrapped__")
    publish_server_args()
    off = build_cache("histate", build_pools(kv_tokens=512, mamba_slots=8))
    on = build_cache("histate", build_pools(kv_tokens=512, mamba_slots=8),
                     histate_config=resolve_config({"enable": True, "short_prefill_first": True}, {}))
    assert off.continuing_chunk_limiter() is None and callable(on.continuing_chunk_limiter())


def test_0013_hints_are_validated_and_miss_reasons_declared_through_sglangs_registries():
    from sglang.srt.managers import tokenizer_manager
    from sglang.srt.managers.scheduler_components import output_streamer
    from sglang.srt.plugins.hook_registry import HookRegistry

    from histate.sglang_plugin import checkpoint_hints, miss_tracker

    checkpoint_hints.install()
    miss_tracker.install_meta_info_hook()
    for point in hook_points.RETIRED_BY_PATCH["0013-plugins-request-validators-and-info-keys"]:
        assert not any(getattr(entry[1], "__module__", "").startswith("histate.")
                       for entry in HookRegistry._hooks.get(point[1], ())), point
    assert checkpoint_hints.validate_request in tokenizer_manager._REQUEST_VALIDATORS
    assert miss_tracker.META_INFO_KEY in output_streamer._REQUEST_LEVEL_INFO_KEYS
    checkpoint_hints.install()  # once per process
    assert tokenizer_manager._REQUEST_VALIDATORS.count(checkpoint_hints.validate_request) == 1
    with pytest.raises(ValueError, match="histate_checkpoints"):
        checkpoint_hints.validate_request(types.SimpleNamespace(
            sampling_params={"custom_params": {"histate_checkpoints": [5000]}}), list(range(100)))


def test_0014_the_l3_tier_names_and_reads_objects_through_the_stores_public_helpers(monkeypatch):
    """HiState's L3 tier over a `MooncakeStore` asks it for its objects (`page_objects`, `pool_objects`,
    `objects_exist`, `get_objects`) instead of calling its private key and buffer builders; what it finds is
    what the store wrote."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from histate.sglang_plugin import l3_tier
    from test_mooncake_public_objects import mooncake_store_over_host_pools

    ms = mooncake_store_over_host_pools()
    called = []
    for name in ("page_objects", "pool_objects", "objects_exist", "get_objects"):
        method = getattr(ms, name)
        setattr(ms, name, lambda *a, _n=name, _m=method, **k: called.append(_n) or _m(*a, **k))
    # the stand-in store copies no bytes, so HiState's digest check is told the reads are whole
    monkeypatch.setattr(l3_tier.digests, "verify", lambda store, objects, ptrs, sizes, exact, require: (exact, 0, 0))
    tier = l3_tier.L3Tier(None, store=ms)
    page = ms.mem_pool_host.page_size
    ms.batch_set_v1(["p0", "p1"], torch.arange(2 * page, dtype=torch.int64))
    assert tier.kv_present(["p0", "p1", "p2"]) == [True, True, False]
    assert tier.get_kv(["p0", "p2"], torch.arange(2 * page, dtype=torch.int64)) == [True, False]
    ms.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=["s0"], host_indices=torch.tensor([0]))])
    assert tier.pool_present(["s0", "s1"], PoolName.MAMBA) == [True, False]
    assert {"page_objects", "pool_objects", "objects_exist", "get_objects"} <= set(called)


def test_0017_write_back_state_writes_copy_through_sglangs_pool_slot_backup(tmp_path, monkeypatch):
    """Under write_back the state writes stage each checkpoint with SGLang's `backup_pool_slots` (the writer
    checks no private controller part), and the states reach the SSD as on stock."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    from histate.sglang_plugin import state_writes
    from histate.sglang_plugin.config import resolve_config
    from histate.sglang_plugin.server_settings import storage_extra_config
    from sglang_cpu.hicache import TieredDriver, build_hicache
    from sglang_cpu.pools import PAGE, ManualClock, build_pools

    assert state_writes.POOL_SLOT_BACKUP_BY_SGLANG and state_writes._CONTROLLER_API == {}
    calls = []
    backup = HybridCacheController.backup_pool_slots
    monkeypatch.setattr(HybridCacheController, "backup_pool_slots",
                        lambda self, *args: calls.append(args[0]) or backup(self, *args))
    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file",
                             "ssd_size_bytes": "64MiB"}, {})
    pools = build_pools(1024, 32)
    cache = build_hicache("histate", pools, histate_config=config, storage_extra=storage_extra_config(None, config),
                          clock=ManualClock(1.0), write_policy="write_back")
    TieredDriver(cache, pools).serve(list(range(1, 16 * PAGE + 1)), [4 * PAGE, 8 * PAGE, 16 * PAGE])
    writes = cache.histate.ssd_tier.state_writes
    assert (writes.num_started, writes.num_stored) == (3, 3) and len(calls) == 3
