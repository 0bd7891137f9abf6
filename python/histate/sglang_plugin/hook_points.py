"""Every place HiState replaces SGLang code, in one table, with the SGLang 0.5.23 file:line it replaces.

Two kinds of hook point:

* `REGISTRY_HOOKS`: functions patched through SGLang's `HookRegistry` (BEFORE/AFTER/AROUND), installed
  in named groups by `hooks.install_once`. `install_once` accepts only targets listed here, in the
  group listed here, so this table cannot fall behind the code.
* `OVERRIDES`: methods of SGLang classes that HiState's subclasses override (`HiStateRadixCache`,
  `HiStateTreeCore`, `HiStateFullComponent`, `HiStateMambaComponent`).

Why a table and a check, not trust: a renamed SGLang method leaves an override dead (SGLang's own
behaviour silently returns) and a changed signature breaks a hook at call time, deep in the scheduler
loop. `parameter_mismatch` compares the installed SGLang with the parameters recorded here;
`install_once` checks its group's targets with it before registering anything, and the cache checks
`OVERRIDES` (`check_overrides`) when it is built, so an SGLang that differs is refused at start with one
line naming the hook point. `test/sglang/test_hook_points.py` also checks the file:line column and
that every override the plugin's classes define is listed. The upstream patch series (issue 29) is to
replace these points with public hooks.

Each entry: the dotted SGLang target, how it is hooked (a HookRegistry kind, or "override"), the hook
group or plugin class, SGLang's file:line (relative to the `sglang` package), the parameter names
HiState was written against, and why HiState hooks it.
"""
from __future__ import annotations

import inspect
import pkgutil
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class HookPoint:
    target: str
    how: str  # "BEFORE" | "AFTER" | "AROUND" (HookRegistry) or "override"
    owner: str  # hook group (install_once) or the plugin class that overrides
    sglang_line: str  # "srt/<file>.py:<line of the def>" in SGLang 0.5.23
    params: tuple
    why: str


REGISTRY_HOOKS: tuple = (
    HookPoint('sglang.srt.server_args.ServerArgs.add_cli_args',
              'AFTER', 'server_args', 'srt/server_args.py:351',
              ('parser',),
              'adds the --histate-* argument group; notes whether --hicache-write-policy was given'),
    HookPoint('sglang.srt.server_args.ServerArgs.from_cli_args',
              'AROUND', 'server_args', 'srt/server_args.py:446',
              ('cls', 'args'),
              'builds HiStateConfig from the CLI; exit 2 on a refused configuration; stashes the write policy choice'),
    HookPoint('sglang.srt.server_args.ServerArgs.resolve_once',
              'BEFORE', 'server_args', 'srt/server_args.py:244',
              ('self',),
              'the same for Engine(**kwargs) and HISTATE_* env vars'),
    HookPoint('sglang.srt.managers.schedule_policy.PrefillAdder._select_prefill_admission',
              'AROUND', 'chunking', 'srt/managers/schedule_policy.py:1592',
              ('self', 'req', 'total_tokens', 'host_hit_length', 'swa_host_hit_length', 'truncation_align_size', 'has_chunked_req'),
              "floors a new request's chunk cut to the state grid"),
    HookPoint('sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req',
              'AROUND', 'chunking', 'srt/managers/schedule_policy.py:1140',
              ('self', 'req'),
              'marks a continuing chunk for floor_chunked_tokens'),
    HookPoint('sglang.srt.managers.schedule_policy.PrefillAdder.floor_chunked_tokens',
              'AROUND', 'chunking', 'srt/managers/schedule_policy.py:863',
              ('self', 'trunc_len', 'remaining'),
              "floors a continuing chunk's cut to the state grid"),
    HookPoint('sglang.srt.managers.schedule_policy.SchedulePolicy.shortest_prefill_chunk_limit',
              'AROUND', 'short_prefill', 'srt/managers/schedule_policy.py:418',
              ('self', 'chunked_req', 'waiting_queue', 'budget', 'page_size'),
              'bounded shortest-prefill-first (--histate-short-prefill-first)'),
    HookPoint('sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.is_request_level_customized_info_key',
              'AROUND', 'miss_reasons', 'srt/managers/scheduler_components/output_streamer.py:252',
              ('self', 'key'),
              "sends meta_info['histate_miss'] once per request, not sliced per token (--histate-miss-reasons)"),
    HookPoint('sglang.srt.managers.scheduler.Scheduler._prefetch_after_device_hit_loss',
              'AROUND', 'restore_recheck', 'srt/managers/scheduler.py:3426',
              ('self', 'req'),
              "skips a request whose admission match found an SSD checkpoint to restore (restore_recheck.py)"),
    HookPoint('sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request',
              'AFTER', 'checkpoint_hints', 'srt/managers/tokenizer_manager.py:1307',
              ('self', 'obj', 'input_ids'),
              "refuses bad custom_params.histate_checkpoints with SGLang's 400 (application-placed checkpoints)"),
    HookPoint('sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend',
              'AROUND', 'capture', 'srt/managers/schedule_batch.py:2847',
              ('self',),
              "starts the batch's capture list; then settles each request's hit and miss reasons to the "
              "prefix its pass runs from"),
    HookPoint('sglang.srt.managers.schedule_batch.ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend',
              'AROUND', 'capture', 'srt/managers/schedule_batch.py:3137',
              ('self', 'req'),
              "starts the batch's capture list"),
    HookPoint('sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new',
              'AFTER', 'capture', 'srt/model_executor/forward_batch_info.py:958',
              ('cls', 'batch', 'model_runner', 'capture_hidden_mode', 'return_hidden_states_before_norm', 'extend_position_info', 'spec_mrope_positions', 'kv_loc_plan', 'write_cols'),
              'carries the captures to the ForwardBatch'),
    HookPoint('sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend.__init__',
              'AFTER', 'capture_forward', 'srt/layers/attention/linear/gdn_backend.py:522',
              ('self', 'model_runner'),
              'refuses extend kernels that give no per-chunk h'),
    HookPoint('sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend.init_forward_metadata',
              'AFTER', 'capture_forward', 'srt/layers/attention/linear/gdn_backend.py:558',
              ('self', 'forward_batch'),
              'builds the capture index tensors'),
    HookPoint('sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend._convolve_prefill',
              'AROUND', 'capture_forward', 'srt/layers/attention/linear/gdn_backend.py:919',
              ('self', 'layer', 'forward_batch', 'mixed_qkv', 'conv_states', 'cache_indices'),
              'copies conv windows into capture slots'),
    HookPoint('sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase._track_mamba_state_extend',
              'AROUND', 'capture_forward', 'srt/layers/attention/hybrid_linear_attn_backend.py:1019',
              ('self', 'forward_batch', 'h', 'ssm_states', 'forward_metadata', 'track_states', 'h_track_buf'),
              'copies h rows into capture slots'),
    HookPoint('sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.build_kv_host_pool',
              'AROUND', 'host_sizing', 'srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py:164',
              ('kv_pool', 'page_size', 'use_mla', 'override_kv_cache_dim', 'host_size', 'mtp_draft_device_pools', 'pool_label'),
              'host KV size from the HiState split'),
    HookPoint('sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.build_mamba_host_pool',
              'AROUND', 'host_sizing', 'srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py:1251',
              ('mamba_pool', 'pool_info', 'host_size', 'layout', 'mtp_draft_device_pools'),
              'host state staging size from the HiState split'),
)

OVERRIDES: tuple = (
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.__init__',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:200',
              ('self', 'params'),
              "selects HiState's components and tree core"),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._all_reduce',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:376',
              ('self', 'data', 'tp_reduce_op'),
              'rides the step clock and SSD use on the first ready-count all-reduce'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._drain_storage_control_queues_impl',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:3010',
              ('self', 'n_storage_hit', 'n_ack_prefetch', 'n_backup', 'n_release', 'extra_release_counts', 'log_metrics'),
              'confirms backups per object (MIN over ranks)'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._handle_prefetch_result',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:2422',
              ('self', 'operation'),
              'marks prefetched nodes SSD-backed'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._match_tree',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:619',
              ('self', 'params'),
              'match callback and checkpoint gauges'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._sync_hicache_ready_counts',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:3412',
              ('self',),
              'flags the all-reduce _all_reduce extends'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.attach_storage_backend',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:3358',
              ('self', 'storage_backend', 'storage_backend_extra_config_json', 'served_model_name', 'hicache_storage_prefetch_policy', 'hicache_write_policy'),
              're-attaches the SSD tier'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.check_hicache_events',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:3651',
              ('self',),
              'per-step homing, demotion, trim, reaping'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.check_prefetch_progress',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:2391',
              ('self', 'request'),
              'holds a request for an SSD state restore'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:1159',
              ('self', 'req', 'up_to', 'kwargs'),
              'inserts the extra captured states'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.detach_storage_backend',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:3381',
              ('self',),
              'closes the SSD tier first'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.init_hicache',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:455',
              ('self', 'server_args', 'params'),
              'host tier on, write policy chosen when none was given, SSD tier attached'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.on_release',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:1152',
              ('self', 'req', 'checkpointed'),
              'frees unused capture slots'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.release_aborted_request',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:2769',
              ('self', 'request'),
              'cancels restores'),
    HookPoint('sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.write_backup_storage',
              'override', 'HiStateRadixCache', 'srt/mem_cache/unified_radix_cache.py:1990',
              ('self', 'node_id'),
              'backs up only what HiState wants on the SSD'),
    HookPoint('sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore._unregister_node',
              'override', 'HiStateTreeCore', 'srt/mem_cache/unified_cache/unified_tree_core.py:726',
              ('self', 'node'),
              'node removal reaches the victim heaps and SSD orphans'),
    HookPoint('sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore._update_duplicate_tracking',
              'override', 'HiStateTreeCore', 'srt/mem_cache/unified_cache/unified_tree_core.py:1604',
              ('self', 'node'),
              'victim heaps hear device/host acks'),
    HookPoint('sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore._update_evictable_leaf_sets',
              'override', 'HiStateTreeCore', 'srt/mem_cache/unified_cache/unified_tree_core.py:1592',
              ('self', 'node'),
              "the victim heaps' change feed; a node gaining a child makes its SSD checkpoint historical"),
    HookPoint('sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore.commit_load_back',
              'override', 'HiStateTreeCore', 'srt/mem_cache/unified_cache/unified_tree_core.py:2694',
              ('self', 'node_id', 'device_indices', 'kv_xfer', 'comp_xfers'),
              'restamps T_KV on load-back'),
    HookPoint('sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore.reset',
              'override', 'HiStateTreeCore', 'srt/mem_cache/unified_cache/unified_tree_core.py:482',
              ('self',),
              'orphans SSD objects, clears heaps'),
    HookPoint('sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore.set_component_device_value',
              'override', 'HiStateTreeCore', 'srt/mem_cache/unified_cache/unified_tree_core.py:2958',
              ('self', 'node_id', 'component_type', 'value'),
              're-offers the node; SSD homing candidate'),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.full.FullComponent._dec_session_coverage',
              'override', 'HiStateFullComponent', 'srt/mem_cache/unified_cache/components/full.py:68',
              ('self', 'session_id', 'leaf'),
              're-offers on session unref'),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.full.FullComponent._evict_device_end',
              'override', 'HiStateFullComponent', 'srt/mem_cache/unified_cache/components/full.py:246',
              ('self',),
              'flushes deferred re-offers'),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.full.FullComponent._evict_device_next_node',
              'override', 'HiStateFullComponent', 'srt/mem_cache/unified_cache/components/full.py:219',
              ('self', 'tracker', 'device_frees', 'host_frees', 'cache_actions'),
              "eq. 7 victim heap instead of SGLang's policy heap"),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.full.FullComponent._evict_device_start',
              'override', 'HiStateFullComponent', 'srt/mem_cache/unified_cache/components/full.py:209',
              ('self', 'request_cnt'),
              "replaces SGLang's victim walk"),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.full.FullComponent._recede_session_coverage',
              'override', 'HiStateFullComponent', 'srt/mem_cache/unified_cache/components/full.py:92',
              ('self', 'session_id', 'leaf', 'fallback'),
              're-offers on session unref'),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.full.FullComponent.acquire_component_lock',
              'override', 'HiStateFullComponent', 'srt/mem_cache/unified_cache/components/full.py:282',
              ('self', 'node', 'result', 'lock_host'),
              're-offers a leaf SGLang drops from its leaf set'),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.full.FullComponent.drive_host_eviction',
              'override', 'HiStateFullComponent', 'srt/mem_cache/unified_cache/components/full.py:250',
              ('self', 'num_tokens', 'tracker', 'device_frees', 'host_frees', 'cache_actions'),
              "host eviction from HiState's CPU heap"),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent._dec_session_coverage',
              'override', 'HiStateMambaComponent', 'srt/mem_cache/unified_cache/components/mamba.py:100',
              ('self', 'session_id', 'leaf'),
              're-offers on session unref'),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent._evict_device_end',
              'override', 'HiStateMambaComponent', 'srt/mem_cache/unified_cache/components/mamba.py:459',
              ('self',),
              'flushes deferred re-offers'),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent._evict_device_next_node',
              'override', 'HiStateMambaComponent', 'srt/mem_cache/unified_cache/components/mamba.py:385',
              ('self', 'tracker', 'device_frees', 'host_frees', 'cache_actions'),
              "eq. 7 victim heap instead of SGLang's policy heap; under write_back it asks for the state's host "
              "backup first, as SGLang's walk does (InternalStateBackup)"),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent._evict_device_start',
              'override', 'HiStateMambaComponent', 'srt/mem_cache/unified_cache/components/mamba.py:373',
              ('self', 'request_cnt'),
              "replaces SGLang's victim walk"),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.build_hicache_transfers',
              'override', 'HiStateMambaComponent', 'srt/mem_cache/unified_cache/components/mamba.py:862',
              ('self', 'node', 'phase', 'mamba_pool_idx', 'host_indices', 'token_ids', 'prefetch_tokens',
               'staging_tokens', 'last_hash'),
              'under write_back a host backup leaves out a state already on the SSD (state_writes.py)'),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.cleanup_after_caching_req',
              'override', 'HiStateMambaComponent', 'srt/mem_cache/unified_cache/components/mamba.py:684',
              ('self', 'req', 'is_finished', 'insert_result', 'insert_params'),
              'frees a duplicate capture slot'),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.commit_insert_component_data',
              'override', 'HiStateMambaComponent', 'srt/mem_cache/unified_cache/components/mamba.py:227',
              ('self', 'node', 'is_new_leaf', 'params', 'result', 'cache_actions'),
              'stamps, bytes in, neighbourhood re-offer'),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.drive_host_eviction',
              'override', 'HiStateMambaComponent', 'srt/mem_cache/unified_cache/components/mamba.py:1012',
              ('self', 'num_tokens', 'tracker', 'device_frees', 'host_frees', 'cache_actions'),
              "host eviction from HiState's CPU heap"),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.prepare_for_caching_req',
              'override', 'HiStateMambaComponent', 'srt/mem_cache/unified_cache/components/mamba.py:604',
              ('self', 'req', 'insert_params', 'token_ids_len', 'is_finished'),
              "inserts a capture slot instead of the request's slot"),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.redistribute_on_node_split',
              'override', 'HiStateMambaComponent', 'srt/mem_cache/unified_cache/components/mamba.py:322',
              ('self', 'new_parent', 'child'),
              'copies stamps to the split head'),
    HookPoint('sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.refresh_lru',
              'override', 'HiStateMambaComponent', 'srt/mem_cache/unified_cache/components/mamba.py:127',
              ('self', 'phase', 'node', 'root_node'),
              'stamps KV access on the insert walk'),
)


_WALKS = ("_evict_device_start", "_evict_device_next_node", "_evict_device_end", "drive_host_eviction")

RETIRED_BY_PATCH: dict = {
    "0002-scheduler-prefill-cut-grid": {("chunking", t) for t in (
        "sglang.srt.managers.schedule_policy.PrefillAdder._select_prefill_admission",
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req",
        "sglang.srt.managers.schedule_policy.PrefillAdder.floor_chunked_tokens")},
    "0003-server-args-plugin-declared-arguments": {("server_args", f"sglang.srt.server_args.ServerArgs.{name}")
                                                   for name in ("add_cli_args", "from_cli_args", "resolve_once")},
    "0005-mem-cache-tree-core-observers": {
        *(("HiStateTreeCore", f"sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore.{name}")
          for name in ("_unregister_node", "_update_duplicate_tracking", "_update_evictable_leaf_sets",
                       "commit_load_back", "reset", "set_component_device_value")),
        ("HiStateFullComponent",
         "sglang.srt.mem_cache.unified_cache.components.full.FullComponent.acquire_component_lock")},
    "0006-mem-cache-eviction-ranker": {
        *(("HiStateFullComponent", f"sglang.srt.mem_cache.unified_cache.components.full.FullComponent.{name}")
          for name in _WALKS),
        *(("HiStateMambaComponent", f"sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.{name}")
          for name in _WALKS)},
    "0007-mem-cache-insert-split-match-events": {
        *(("HiStateMambaComponent", f"sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.{name}")
          for name in ("commit_insert_component_data", "redistribute_on_node_split", "refresh_lru")),
        ("HiStateRadixCache", "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._match_tree")},
    "0008-hicache-storage-tier-policy": {
        ("HiStateRadixCache", f"sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.{name}")
        for name in ("_all_reduce", "_drain_storage_control_queues_impl", "_handle_prefetch_result",
                     "_sync_hicache_ready_counts", "check_hicache_events", "write_backup_storage")},
    "0009-mem-cache-session-release-events": {
        ("HiStateFullComponent", "sglang.srt.mem_cache.unified_cache.components.full.FullComponent._dec_session_coverage"),
        ("HiStateFullComponent",
         "sglang.srt.mem_cache.unified_cache.components.full.FullComponent._recede_session_coverage"),
        ("HiStateMambaComponent",
         "sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent._dec_session_coverage")},
    "0010-hicache-storage-restore-hold": {
        ("HiStateRadixCache", f"sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.{name}")
        for name in ("check_prefetch_progress", "release_aborted_request")},
    "0011-hybrid-pool-host-sizing-policy": {
        ("host_sizing", f"sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.{name}")
        for name in ("build_kv_host_pool", "build_mamba_host_pool")},
    "0012-scheduler-cache-chunk-limit": {
        ("short_prefill", "sglang.srt.managers.schedule_policy.SchedulePolicy.shortest_prefill_chunk_limit")},
    "0013-plugins-request-validators-and-info-keys": {
        ("miss_reasons", "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer."
                         "is_request_level_customized_info_key"),
        ("checkpoint_hints", "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request")},
}
"""Which patch of upstream/series retires which hook point, as (owner, target): with that patch applied the
plugin takes the public path it adds and installs or overrides nothing there (docs/upstream.md). 0001 and
0004 retire no listed point (0001 changes how hooks fail; 0004 replaces plain prometheus_client calls)."""


def registry_hook(target: str) -> HookPoint:
    """The listed registry hook for `target` (KeyError: not listed, so not allowed)."""
    return _BY_TARGET[target]


def resolve_target(target: str) -> Any:
    """The object `target` ("module.Class.attr" or "module.attr") names now, as HookRegistry sees it:
    looked up without binding (a classmethod's or staticmethod's function, not a fresh bound method)."""
    owner_path, _, attr = target.rpartition(".")
    if not owner_path:
        raise ValueError(f"not a dotted path to an attribute: {target!r}")
    owner = pkgutil.resolve_name(owner_path)
    value = inspect.getattr_static(owner, attr)
    return value.__func__ if isinstance(value, (classmethod, staticmethod)) else value


def parameter_names(function) -> tuple:
    """The parameter names of `function` as SGLang defines it (through decorators such as
    `@rank_consensus`, which wrap with functools.wraps)."""
    return tuple(inspect.signature(inspect.unwrap(function)).parameters)


def parameter_mismatch(point: HookPoint, function) -> str | None:
    """Why `function` (what `point.target` names in the installed SGLang) no longer fits `point`, or None."""
    found = parameter_names(function)
    if found == point.params:
        return None
    return f"takes {found}, HiState's hook was written for {point.params}"


def signature_problems(points: Iterable[HookPoint]) -> list:
    """One line per hook point whose target is gone from the installed SGLang or whose parameters
    differ from the ones HiState was written against; empty when every point still fits."""
    problems = []
    for point in points:
        try:
            function = resolve_target(point.target)
        except Exception as error:  # ImportError, AttributeError, ValueError: the name is gone
            problems.append(f"{point.target} ({point.sglang_line} in 0.5.23) not found: "
                            f"{type(error).__name__}: {error}".splitlines()[0])
            continue
        mismatch = parameter_mismatch(point, function)
        if mismatch:
            problems.append(f"{point.target} ({point.sglang_line} in 0.5.23) {mismatch}")
    return problems


_overrides_checked = False


def check_overrides() -> None:
    """Refuse, with one RuntimeError naming every mismatch, an SGLang whose overridden methods are gone
    or changed (checked once per process, when the first HiState cache is built)."""
    global _overrides_checked
    if _overrides_checked:
        return
    problems = signature_problems(OVERRIDES)
    if problems:
        raise RuntimeError("HiState cannot run on this SGLang: methods it overrides differ from SGLang 0.5.23: "
                           + "; ".join(problems))
    _overrides_checked = True


_BY_TARGET = {point.target: point for point in REGISTRY_HOOKS}
