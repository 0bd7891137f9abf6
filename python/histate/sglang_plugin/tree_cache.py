"""HiState's tree cache for SGLang: `UnifiedRadixCache` with HiState's decisions, and its factory.

`histate_cache_factory` is the radix-cache backend "histate" (`register_radix_cache_backend`,
selected by `--radix-cache-backend histate`, which `--enable-histate` sets). It keeps SGLang's
construction path (`create_unified_radix_cache`: component setup, HiCache attach) and swaps in:
  * `HiStateRadixCache` -- the cache class: a `HiStateRuntime` (runtime.py: the core's PolicyState
    and victim heaps over SGLang's nodes), the tree core "histate" (tree_core.py), the FULL/MAMBA
    component overrides (components.py), a match that refreshes and learns per HiState's policy, the
    agreed clock (clock.py) and the SSD tier (ssd_tier.py);
  * HiState's host sizing (host_stack.py) for the HiCache host pools it attaches.
The cache's observable contract (match/insert/evict/lock, `sanity_check`) is SGLang's.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Optional, Sequence

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from histate.core import Tier

from .components import RANKED_BY_SGLANG, HiStateFullComponent, HiStateMambaComponent, HiStateRanker
from .config import HiStateConfig, HiStateConfigError, resolve_config
from .hook_points import check_overrides
from .host_stack import (current_build_config, histate_build_scope, host_pool_sizes, install_host_policy, log_split,
                         mamba_slot_bytes, plan_for_stack)
from .clock import AgreedClock
from .metrics import HiStateMetrics, radix_cache_labels, shared_metrics, upstream_cache_series
from .runtime import HiStateRuntime
from .short_prefill import cache_chunk_limit
from .storage_backend import histate_backend
from .storage_policy import RESTORE_HOLD_BY_SGLANG, STORAGE_POLICY_BY_SGLANG, HiStateStoragePolicy
from .tree_core import BACKEND_NAME as TREE_CORE_BACKEND
from .tree_core import LEAF_STATE_BACKUP_BY_SGLANG, WALK_EVENTS_BY_SGLANG, HiStateTreeObserver, register_tree_core
from .write_policy import choose_write_policy

logger = logging.getLogger(__name__)


def kv_bytes_per_token(kvcache: Any) -> int:
    """Device KV bytes of one token over every full-attention layer: one row of each layer's K and V
    view. Not `get_kv_size_bytes()`: SGLang's unified sub-pools report 0 there on purpose (the unified
    pool logs the total; unified_memory_pool.py:870-871, 1010-1011, 1973-1974), which made this 1 byte
    on HiState's default device pool, priced a checkpoint at ~1,000x its KV worth in eq. 5 and so
    planned no interval checkpoint (found on SGLang's own server, issue 27)."""
    pool = getattr(kvcache, "full_kv_pool", kvcache)
    views = [*(getattr(pool, "k_buffer", None) or ()), *(getattr(pool, "v_buffer", None) or ())]
    if not views:
        raise TypeError(f"HiState: no per-layer K/V views on {type(pool).__name__} to size a KV token by")
    return sum(view[0].numel() * view.element_size() for view in views)


def device_bytes(params: Any, kv_bytes_per_token: int, state_bytes: int) -> int:
    """Device bytes of the KV and state pools the tree caches into (the GPU capacity of Little's law)."""
    kv_tokens = params.token_to_kv_pool_allocator.size
    state_slots = params.req_to_token_pool.mamba_pool.size
    return max(1, kv_tokens * kv_bytes_per_token + state_slots * state_bytes)


class HiStateRadixCache(UnifiedRadixCache):
    """SGLang's unified radix cache making HiState's decisions (see module docstring)."""

    def __init__(self, params: Any, *, histate_config: Optional[HiStateConfig] = None, policy: Any = None,
                 clock: Optional[Callable[[], float]] = None, metrics: Optional[HiStateMetrics] = None,
                 local_clock: Callable[[], float] = time.monotonic):
        """`clock`: a logical clock for tests (no agreement); by default an `AgreedClock` over
        `local_clock`, this rank's wall clock."""
        from sglang.srt.runtime_context import mamba_checkpoint_grid

        config = histate_config or current_build_config() or resolve_config({"enable": True}, {})
        check_overrides()  # fail closed: an overridden SGLang method that changed would be dead code
        register_tree_core()
        params.component_registry_override = {
            **(params.component_registry_override or {}),
            ComponentType.FULL: HiStateFullComponent,
            ComponentType.MAMBA: HiStateMambaComponent,
        }
        params.tree_core_backend = TREE_CORE_BACKEND
        export_through_collector = False
        if metrics is None:
            # Under upstream/series 0004 the series are made through the collector SGLang builds for this
            # cache in super().__init__ (its labels and metric backend); before it, through our own.
            export_through_collector = bool(params.enable_metrics) and upstream_cache_series()
            metrics = (shared_metrics(radix_cache_labels(type(self).__name__), export=True)
                       if params.enable_metrics and not export_through_collector else HiStateMetrics())
        self.agreed_clock = AgreedClock(local_clock) if clock is None else None
        kv_bytes = kv_bytes_per_token(params.token_to_kv_pool_allocator.get_kvcache())
        state_bytes = mamba_slot_bytes(params.req_to_token_pool.mamba_pool)
        self.histate = HiStateRuntime(
            config, grid_tokens=mamba_checkpoint_grid(params.page_size), kv_bytes_per_token=kv_bytes,
            checkpoint_bytes=state_bytes, device_bytes=device_bytes(params, kv_bytes, state_bytes),
            clock=clock or self.agreed_clock, policy=policy, metrics=metrics)
        self._hs_agreeing = False  # stock 0.5.23: the next all-reduce is the per-step one (storage_policy.py)
        self._hs_storage_policy = HiStateStoragePolicy(self)
        self._hs_inserting = None  # the capture.Capture `checkpoint` is inserting (components.py reads it)
        super().__init__(params)
        if export_through_collector and self.metrics_collector is not None:
            metrics.export_through(self.metrics_collector)
        self.tree_core.attach_observer(HiStateTreeObserver(self.histate, self.tree_core, self.on_prefix_matched))
        if RANKED_BY_SGLANG:  # upstream/series 0006: SGLang's walks ask eq. 7's heaps (no walk override)
            self.tree_core.set_eviction_ranker(HiStateRanker(self.histate))
        if STORAGE_POLICY_BY_SGLANG:  # upstream/series 0008: HiCache's storage path asks the SSD tier itself
            self.set_storage_tier_policy(self._hs_storage_policy)
        self.histate.victims.tree_core = self.tree_core
        self.histate.attach_tree(self.tree_core.root_node)
        self._agree_sizes()

    def _agree_sizes(self) -> None:
        """Make the sizes HiState scores by rank-invariant: each rank measured its own pools (KV bytes
        per token, state slot bytes, device bytes), and eq. 7 and Little's law must rank alike on every
        rank, or their evictions diverge. The MAX over the ranks, through SGLang's TP/PP all-reduce
        (`_all_reduce`, unified_radix_cache.py:376-387), keeps the per-rank unit the per-rank
        capacities are in (equal TP shards: each rank's own value)."""
        import torch

        config = self.histate.core_config
        sizes = torch.tensor([config.kv_bytes_per_token, config.checkpoint_size_bytes,
                              config.capacity_bytes[Tier.GPU]], dtype=torch.int64)
        self._all_reduce(sizes, torch.distributed.ReduceOp.MAX)
        self.histate.adopt_agreed_sizes(*(int(v) for v in sizes.tolist()))

    # --- questions SGLang asks the cache (upstream/series 0011, 0012; stock 0.5.23 asks neither) ---------

    def continuing_chunk_limiter(self) -> Optional[Callable[..., Optional[int]]]:
        """HiState's bounded short-prefill-first cap with aging (short_prefill.py) while
        `--histate-short-prefill-first` is on, else SGLang's own; asked by `SchedulePolicy.
        shortest_prefill_chunk_limit` under upstream/series 0012 (stock 0.5.23 never calls it: short_prefill.py
        hooks that method with the same rule there)."""
        if not self.histate.config.short_prefill_first:
            return None
        return functools.partial(cache_chunk_limit, self)

    def host_pool_sizes(self, kv_pool: Any, state_pool: Any) -> tuple:
        """HiState's host split (host_stack.py: the same budget as SGLang's rule, KV first, a few state
        slots for staging); SGLang's hybrid Mamba stack asks this under upstream/series 0011 (stock
        0.5.23 never calls it: `HiStateMambaStackStrategy` applies the same split there)."""
        split = plan_for_stack(kv_pool, state_pool, self.req_to_token_pool.size, self.histate.config)
        self.histate_host_split = split
        log_split(split)
        return host_pool_sizes(split)

    # --- HiCache attach: bind the SSD tier ---------------------------------------------------------

    def init_hicache(self, server_args: Any, params: Any) -> None:
        super().init_hicache(server_args, params)
        chosen = choose_write_policy(self, server_args)  # write_back on a short host when the operator chose none
        self.histate.metrics.set_host_write_policy(self.cache_controller.write_policy,
                                                   "operator" if chosen is None else "histate")
        self.histate.use_write_back(self.cache_controller.write_policy == "write_back",
                                    None if LEAF_STATE_BACKUP_BY_SGLANG else self._hs_back_up_state)
        self.histate.victims.enable_tier(Tier.CPU)
        self.histate.add_tier(Tier.CPU)
        self.attach_ssd(histate_backend(self.cache_controller))

    def _hs_back_up_state(self, sg: Any) -> None:
        """Copy `sg`'s device state to the host now (write_back): SGLang 0.5.23 demotes a backed-up device
        leaf as it is (`evict_device_leaf`, unified_tree_core.py:1788-1825; upstream/series 0016 backs the
        state up itself), so a state the leaf gained after its backup would go with no copy. The same synchronous backup, with the same host-slot room, as SGLang's
        MAMBA walk makes before tombstoning an internal state (unified_radix_cache.py:885-890); if the host
        cannot take it, the state goes as before (a miss later, never a wrong state)."""
        from sglang.srt.mem_cache.unified_radix_cache import PoolName

        pool = self.host_pool_group.get_pool(PoolName.MAMBA)
        if pool is not None and pool.available_size() < 1:
            self.evict_host(1, ComponentType.MAMBA)
        self.backup_node_for_write_back(sg.id)

    def attach_ssd(self, backend: Any) -> None:
        """Use `backend` (a HiStateStorageBackend) as the SSD tier (ssd_tier.py)."""
        from .ssd_tier import SsdTier
        from .storage_backend import HiStateStorageBackend

        if not isinstance(backend, HiStateStorageBackend):
            return
        backend.metrics = self.histate.metrics
        tier = SsdTier(self, backend)  # agrees the budget and the objects found at attach over the ranks
        if Tier.SSD not in self.histate.core_config.capacity_bytes:
            self.histate.add_tier(Tier.SSD, tier.capacity_bytes)
        self.histate.ssd_tier = tier

    def detach_storage_backend(self) -> tuple[bool, str]:
        """SGLang's runtime detach closes the backend: stop using it first (restores end, SSD bits go)."""
        self._detach_ssd()
        return super().detach_storage_backend()

    def attach_storage_backend(self, *args: Any, **kwargs: Any) -> tuple[bool, str]:
        self._detach_ssd()
        ok, message = super().attach_storage_backend(*args, **kwargs)
        if ok:
            self.attach_ssd(histate_backend(self.cache_controller))
        return ok, message

    def _detach_ssd(self) -> None:
        tier, self.histate.ssd_tier = self.histate.ssd_tier, None
        if tier is not None:
            tier.close()

    # --- HiCache's storage path: the SSD tier's policy and the agreed step (storage_policy.py) ----------

    if not STORAGE_POLICY_BY_SGLANG:  # stock 0.5.23: the six methods that call the policy, overridden

        def _sync_hicache_ready_counts(self) -> Any:
            self._hs_agreeing = True
            try:
                return super()._sync_hicache_ready_counts()
            finally:
                self._hs_agreeing = False

        def _all_reduce(self, data: Any, tp_reduce_op: Any) -> None:
            """The first all-reduce inside `_sync_hicache_ready_counts` (SGLang's per-step MIN of the
            HiCache ready counts) also carries the policy's step values."""
            if not self._hs_agreeing:
                super()._all_reduce(data, tp_reduce_op)
                return
            import torch

            self._hs_agreeing = False
            values = self._hs_storage_policy.step_sync_values()
            extended = torch.cat([data, torch.tensor(values, dtype=data.dtype)])
            super()._all_reduce(extended, tp_reduce_op)
            data.copy_(extended[:len(data)])
            self._hs_storage_policy.adopt_step_sync([int(x) for x in extended[len(data):].tolist()])

        def write_backup_storage(self, node_id: Any) -> None:
            policy = self._hs_storage_policy
            token = policy.begin_backup(node_id)
            if token is None:
                return
            started, operation_id = set(self.ongoing_backup), None
            try:
                super().write_backup_storage(node_id)
                operation_id = next(iter(set(self.ongoing_backup) - started), None)  # at most one queued
            finally:
                policy.end_backup(token, operation_id)

        def _drain_storage_control_queues_impl(self, n_storage_hit: Any, n_ack_prefetch: Any, n_backup: Any,
                                               *args: Any, **kwargs: Any) -> None:
            pending = set(self.ongoing_backup)
            super()._drain_storage_control_queues_impl(n_storage_hit, n_ack_prefetch, n_backup, *args, **kwargs)
            acked = pending - set(self.ongoing_backup)
            if acked:
                self._hs_storage_policy.on_backups_acked(sorted(acked), agreed=n_backup is not None)

        def _handle_prefetch_result(self, operation: Any) -> None:
            """Reported whether or not SGLang committed the prefetch (stock cannot tell here):
            `SsdTier.on_prefetched` takes only the pages the tree holds below the anchor."""
            entry = self.ongoing_prefetch.get(operation.handle)
            super()._handle_prefetch_result(operation)
            if entry is not None and operation.completed_tokens > 0:
                self._hs_storage_policy.on_prefetch_committed(
                    entry.anchor_node_id, operation.hash_value[: operation.completed_tokens // self.page_size])

        def check_hicache_events(self) -> None:
            super().check_hicache_events()
            self._hs_storage_policy.on_step()

    def retire_state_copies(self, sg: Any) -> Optional[int]:
        """Drop the device and host copies of `sg`'s state, keeping the node, its KV and its SSD copy
        (asymmetric tiering, ssd_tier.py), with the MAMBA component's own eviction primitive (the walk's
        tombstone of an internal state, components/mamba.py:334-371). None while something holds a copy
        (a lock, a transfer in flight); else the number of copies dropped."""
        from collections import defaultdict

        from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

        data = sg.component_data[ComponentType.MAMBA]
        if sg.write_through_pending_id is not None or sg.load_back_pending_id is not None:
            return None
        layers = []
        if data.value is not None:
            if data.lock_ref:
                return None
            layers.append(EvictLayer.DEVICE)
        if data.host_value is not None:
            if data.host_lock_ref:
                return None
            layers.append(EvictLayer.HOST)
        core = self.tree_core
        component = core.components_by_type[ComponentType.MAMBA]
        device_frees, host_frees, actions = defaultdict(list), defaultdict(list), []
        for layer in layers:
            core._evict_component_and_detach_lru(sg, component, device_frees=device_frees, host_frees=host_frees,
                                                 cache_actions=actions, target=layer)
        if layers:
            core._update_evictable_leaf_sets(sg)
            self._free_values(device_frees, host_frees)
            self._apply_cache_actions(actions)
        return len(layers)

    if not RESTORE_HOLD_BY_SGLANG:  # stock 0.5.23 (and 0008 alone): the admission hold, overridden

        def check_prefetch_progress(self, request: Any) -> bool:
            return super().check_prefetch_progress(request) and self._hs_storage_policy.admission_ready(request)

        def release_aborted_request(self, request: Any) -> None:
            super().release_aborted_request(request)
            self._hs_storage_policy.on_request_released(request)

    # --- matching ----------------------------------------------------------------------------------

    if not WALK_EVENTS_BY_SGLANG:  # stock 0.5.23: the match, overridden to report it (upstream/series 0007)

        def _match_tree(self, params: MatchPrefixParams) -> MatchResult:
            if self.disable:
                return self.tree_core.empty_match_result
            result = self.tree_core.match_prefix(params)
            self._apply_cache_actions(result.cache_actions)
            self.on_prefix_matched(params, result)
            return self._finalize_match_result(params, result)

    def on_prefix_matched(self, params: MatchPrefixParams, result: MatchResult) -> None:
        """A match walked the tree (its actions applied, not yet finalized): refresh and learn per HiState's
        policy (`runtime.on_match`), remember an SSD checkpoint to restore, update the gauges."""
        runtime = self.histate
        visited = result.last_visited_node_id
        last = self.tree_core.node_by_id(visited if visited is not None else result.best_match_node)
        ckpt_node = runtime.on_match(last, result.full_kv_hit_length, params.req, len(params.key), runtime.now(),
                                     key=params.key if runtime.misses is not None else None)
        if params.req is not None and runtime.ssd_tier is not None and hasattr(params.req, "cache_request_handle"):
            runtime.ssd_tier.note_match(params.req.cache_request_handle, ckpt_node)
        if params.req is not None:
            self._update_checkpoint_gauges()

    def _update_checkpoint_gauges(self) -> None:
        """Checkpoints resident per tier, from O(1) sources (ledger, host pool, SSD counter)."""
        from sglang.srt.mem_cache.hicache_storage import PoolName

        metrics, core = self.histate.metrics, self.tree_core
        metrics.set_checkpoints("device", core.component_evictable_size_[ComponentType.MAMBA]
                                + core.component_protected_size_[ComponentType.MAMBA])
        host_pool = self.host_pool_group.get_pool(PoolName.MAMBA) if self.host_pool_group else None
        if host_pool is not None:
            metrics.set_checkpoints("host", host_pool.size - host_pool.available_size())
        if self.histate.ssd_tier is not None:
            metrics.set_checkpoints("storage", self.histate.ssd_tier.backend.num_states)

    # --- adaptive interval control and in-pass capture (capture.py) -----------------------------------

    def prefill_cut_grid(self) -> int:
        """Where chunked-prefill cuts should land (upstream/series 0002, `BasePrefixCache.prefill_cut_grid`):
        the state grid with `--histate-chunk-align grid`, else 1 (SGLang's cuts). Stock 0.5.23 never
        calls it; chunking.py's hooks apply the same rule there."""
        return self.histate.grid_tokens if self.histate.config.chunk_align == "grid" else 1

    def on_prefill_cut_floored(self) -> None:
        self.histate.metrics.record_chunk_cut("grid")

    def plan_checkpoints(self, reused_tokens: int, input_tokens: int,
                         kv_match_tokens: Optional[int] = None, hint_tokens: Sequence[int] = ()) -> list[int]:
        return self.histate.plan_checkpoints(reused_tokens, input_tokens, kv_match_tokens, hint_tokens)

    def alloc_capture_slot(self) -> Any:
        """A mamba slot for one extra checkpoint of a pass, evicting like SGLang's own state allocation
        (`MambaComponent._alloc_mamba_slot`); None when eviction cannot free one (the capture is dropped)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        allocator = self.req_to_token_pool.mamba_allocator
        slot = allocator.alloc(1)
        if slot is None:
            self.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=1))
            slot = allocator.alloc(1)
        return slot

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """SGLang's insert after a pass (`checkpoint_kv_cache`, `release_kv_cache`), preceded by the
        pass's extra checkpoints, shallowest first: each is inserted exactly like SGLang's own tracked
        state (`checkpoint_into_tree`: the tree takes the KV up to it, the request's lock and protected
        prefix move down), with its capture slot as the state."""
        from .capture import pending

        captures = pending(req)
        while captures and captures[0].position <= up_to:
            capture = captures.pop(0)
            if capture.position <= req.kv.cache_protected_len:  # already in the tree below this request
                self.req_to_token_pool.mamba_allocator.free(capture.slot)
                continue
            if not capture.filled(self.req_to_token_pool.mamba_map):  # the forward did not write it all
                self.req_to_token_pool.mamba_allocator.free(capture.slot)
                self.histate.metrics.record_captures("unfilled", 1)
                logger.warning("HiState: the forward did not fill the capture at %d tokens of %s (conv layers %s, "
                               "ssm layers %s); dropped, not inserted", capture.position, req.rid,
                               sorted(capture.conv_layers), sorted(capture.ssm_layers))
                continue
            self._hs_inserting = capture
            try:
                self.checkpoint_into_tree(req, up_to=capture.position)
            finally:
                self._hs_inserting = None
        super().checkpoint(req, up_to=up_to, **kwargs)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        """The request left: captures it did not insert give their slots back."""
        from .capture import release_captures

        release_captures(self, req)
        self.histate.commit_misses(req)
        if self.histate.holds is not None and _finished_not_aborted(req):
            # tool-wait residency: its turn ended where its insert did (SGLang's own session leaf,
            # `checkpoint_into_tree`: req.last_node, the id of a node the request still locks)
            try:
                tail = self.tree_core.node_by_id(req.last_node)
            except (AttributeError, KeyError):
                tail = None
            self.histate.on_turn_end(req, tail, self.histate.now())
        super().on_release(req, checkpointed=checkpointed)


def _finished_not_aborted(req: Any) -> bool:
    """What SGLang registers a session leaf for (unified_radix_cache.py:1329-1335): a finished request
    whose finish is not an abort."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return bool(req.finished()) and not isinstance(getattr(req, "finished_reason", None), FINISH_ABORT)


def histate_cache_factory(ctx: Any) -> Any:
    """Radix-cache backend "histate": SGLang's unified cache construction with HiState's parts."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    from .cli_hooks import config_of

    config = config_of(ctx.server_args)
    if not ctx.is_hybrid_ssm:
        raise HiStateConfigError(
            "--enable-histate (--radix-cache-backend histate) needs a hybrid model with recurrent "
            "(Mamba / Gated-DeltaNet) layers; this model has none. Drop --enable-histate.")
    if ctx.is_hybrid_swa:
        raise HiStateConfigError("--enable-histate does not support models with sliding-window layers yet.")
    install_host_policy()
    from .capture import install_scheduler_hooks
    from .capture_forward import install_forward_hooks
    from .chunking import install_chunk_planning
    from .short_prefill import install_short_prefill_first

    install_chunk_planning()
    install_short_prefill_first()
    if config.miss_reasons:
        from .miss_tracker import install_meta_info_hook

        install_meta_info_hook()
    install_scheduler_hooks()
    install_forward_hooks()
    if config.has_ssd:
        from .restore_recheck import install_restore_recheck

        install_restore_recheck()
    with histate_build_scope(config):
        cache = create_unified_radix_cache(ctx, cache_class=HiStateRadixCache)
    logger.info("HiState tree cache ready: %s", config.describe())
    return cache
