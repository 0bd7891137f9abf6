"""HiState's overrides of SGLang's FULL and MAMBA tree components.

Installed through `CacheInitParams.component_registry_override` (which also selects SGLang's
Python tree core). They keep every SGLang mechanism (ledgers, LRU links, locks, HiCache hooks)
and change only the decisions:
  * MAMBA: refresh-all on a checkpoint hit comes from the cache's match (policy-driven); a new
    checkpoint stamps its time and re-offers its neighbours to the ranker; the device eviction
    walk asks the unified ranker (interior checkpoints and bundles together) instead of walking
    the state LRU; the match validator also accepts a checkpoint whose only copy is on SSD.
  * FULL: the device eviction walk takes bundles from the unified ranker instead of the
    `--radix-eviction-policy` leaf heap.
The ranker and all policy state live on `cache.histate` (runtime.HiStateRuntime).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer, LRURefreshPhase
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

from histate.core import UnitKind


class _UnifiedWalk:
    """The device-eviction walk protocol of SGLang components, answered by the ranker."""

    wants_state = False

    def _evict_device_start(self, request_cnt: int) -> None:
        self._hs_request_cnt = request_cnt
        self.cache.histate.ranker.begin_walk()

    def _evict_device_end(self) -> None:
        self._hs_request_cnt = 0

    def _next_victim(self, tracker: dict) -> Optional[tuple]:
        if tracker[self.component_type] >= self._hs_request_cnt:
            return None
        runtime = self.cache.histate
        victim = runtime.ranker.next_victim(want_state=self.wants_state)
        if victim is not None:
            runtime.on_evicted(victim[0], victim[1], runtime.now())
        return victim


class HiStateFullComponent(_UnifiedWalk, FullComponent):
    def acquire_component_lock(self, node: Any, result: Any, lock_host: bool = False) -> Any:
        """SGLang's FULL lock drops the locked path's device leaf from `evictable_device_leaves`
        directly (full.py:326), past the leaf-set hook the ranker listens to. Re-offer that node so
        it is ranked as what it is now: nothing while locked, or an interior-style checkpoint when
        the request skipped its Mamba lock (SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK)."""
        leaf = None if lock_host else self._device_leaf_above(node)
        result = super().acquire_component_lock(node, result, lock_host)
        if leaf is not None:
            self.cache.histate.ranker.touch(leaf)
        return result

    def _device_leaf_above(self, node: Any) -> Any:
        """The first node on the path up from `node` that holds KV on the device, if it is an
        evictable leaf (only it can be one: every node above it has a device child)."""
        core = self.tree_core
        while node is not core.root_node and node.component_data[self.component_type].value is None:
            node = node.parent
        return node if node in core.evictable_device_leaves else None

    def _evict_device_next_node(self, tracker: dict, device_frees: dict, host_frees: dict,
                                cache_actions: list) -> Any:
        victim = self._next_victim(tracker)
        return None if victim is None else victim[0].id


class HiStateMambaComponent(_UnifiedWalk, MambaComponent):
    wants_state = True

    def _evict_device_next_node(self, tracker: dict, device_frees: dict, host_frees: dict,
                                cache_actions: list) -> Any:
        victim = self._next_victim(tracker)
        if victim is None:
            return None
        node, unit = victim
        if unit is UnitKind.BUNDLE:
            return node.id  # SGLang evicts the leaf atomically (KV + terminal checkpoint)
        # An interior checkpoint: tombstone the state only, with SGLang's own primitives.
        self.tree_core._evict_component_and_detach_lru(
            node, self, target=EvictLayer.DEVICE, tracker=tracker, device_frees=device_frees,
            host_frees=host_frees, cache_actions=cache_actions)
        self.tree_core._cascade_evict(node, self, tracker, device_frees=device_frees,
                                      host_frees=host_frees, cache_actions=cache_actions)
        return None

    def create_match_validator(self, match_device_only: bool = False) -> Callable[[Any], bool]:
        base = super().create_match_validator(match_device_only)
        runtime = self.cache.histate
        if match_device_only or runtime.ssd is None:
            return base
        return lambda node: base(node) or runtime.state_on_ssd(node)

    def refresh_lru(self, phase: LRURefreshPhase, node: Any, root_node: Any) -> None:
        super().refresh_lru(phase, node, root_node)  # keeps SGLang's state LRU links consistent
        if phase is LRURefreshPhase.WALKDOWN and node is not root_node:
            self.cache.histate.stamp_kv(node, self.cache.histate.now())

    def commit_insert_component_data(self, node: Any, is_new_leaf: bool, params: Any, result: Any,
                                     cache_actions: list) -> None:
        super().commit_insert_component_data(node, is_new_leaf, params, result, cache_actions)
        runtime = self.cache.histate
        now_s = runtime.now()
        if result.mamba_exist:
            node._hs_ckpt_access_s = now_s  # the state was already there: a refresh (core _add_checkpoint)
            runtime.stamp_kv(node, now_s)
        else:
            runtime.stamp_new_checkpoint(node, now_s, is_new_leaf)

    def redistribute_on_node_split(self, new_parent: Any, child: Any) -> None:
        super().redistribute_on_node_split(new_parent, child)
        for stamp in ("_hs_kv_access_s", "_hs_kv_created_s"):
            if hasattr(child, stamp):
                setattr(new_parent, stamp, getattr(child, stamp))
