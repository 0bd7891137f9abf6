"""HiState's overrides of SGLang's FULL and MAMBA tree components: the device and host walks.

Installed through `CacheInitParams.component_registry_override` (which also selects SGLang's Python
tree core). They keep every SGLang mechanism (ledgers, LRU links, locks, HiCache hooks, the eviction
primitives) and change only which unit goes next, asking the cache's `TierVictims` (eviction.py):
  * device walks (`_evict_device_next_node`): FULL takes bundles (device leaves), MAMBA takes any
    unit that frees a state slot, both ranked together by eq. 7 instead of the `--radix-eviction-policy`
    leaf heap and the state LRU;
  * host walks (`drive_host_eviction`, SGLang's host-pool pressure path): FULL takes host leaves,
    MAMBA host leaves holding a state and host checkpoints, ranked by eq. 7 instead of the leaf heap
    and the host state LRU (unified_cache/components/full.py:250-280, mamba.py:1012-1069);
  * on stock 0.5.23, MAMBA's insert and split hooks report the insert's path, its commit and a split to
    `HiStateTreeObserver` (new nodes and checkpoints stamped, their neighbours re-offered: the core's
    `_add_checkpoint`);
  * with `--enable-session-radix-cache`, on stock 0.5.23, FULL's and MAMBA's session-coverage walks report
    a node whose last session reference went to `HiStateTreeObserver.on_session_released`, which re-offers
    it (eviction.py: a referenced unit ranks after every unreferenced one; once unreferenced its score
    drops below the key its heap entry may carry). SGLang's own session bookkeeping (coverage, tombstones,
    validation) runs unchanged.

On a SGLang with the upstream series applied, SGLang's own walks ask `HiStateRanker` (0006,
`set_eviction_ranker`) and its lock reports the leaf it drops to the tree's observers (0005), and its tree
core reports inserts and splits (0007) and session releases (0009), so the walk mixins, the lock
re-offer and the insert and session event mixins below are not mixed in; the rest stays.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from sglang.srt.mem_cache.unified_cache.components.base import (ComponentType, EvictLayer, InternalStateBackup,
                                                                 LRURefreshPhase)
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import UnifiedTreeCoreInterface

from histate.core import Tier, UnitKind

from .core_nodes import core_of
from .eviction import is_bundle, takes_device_state, takes_host_state, write_back_moves_state
from .tree_core import OBSERVED_BY_SGLANG, SESSION_EVENTS_BY_SGLANG, WALK_EVENTS_BY_SGLANG


RANKED_BY_SGLANG = hasattr(UnifiedTreeCoreInterface, "set_eviction_ranker")
"""upstream/series 0006 applied: SGLang's walks ask an `EvictionRanker` (`HiStateRanker`); the walk mixins
below, which override SGLang's private walk methods on stock 0.5.23, are then not mixed in."""

_TAKES = {(ComponentType.FULL, Tier.GPU): is_bundle, (ComponentType.MAMBA, Tier.GPU): takes_device_state,
          (ComponentType.FULL, Tier.CPU): is_bundle, (ComponentType.MAMBA, Tier.CPU): takes_host_state}
"""What each walk may take: FULL walks bundles (leaves); MAMBA walks any unit that frees a state slot."""


def _next_victim(runtime: Any, tier: Tier, takes: Callable) -> Optional[tuple]:
    """The lowest-ranked unit of `tier` the walk takes, counted as evicted (before SGLang evicts it)."""
    victim = runtime.victims.next_victim(tier, takes)
    if victim is not None:
        runtime.on_evicted(victim[0], victim[1], tier, runtime.now())
        if tier is Tier.GPU:
            runtime.before_device_eviction(*victim)
    return victim


class HiStateRanker:
    """SGLang's `EvictionRanker` (upstream/series 0006), answered by the cache's victim heaps: eq. 7 over the
    KV bundles and checkpoints of a tier, the same units the walk mixins below take on stock SGLang."""

    def __init__(self, histate: Any):
        from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import EvictionUnit

        self.histate = histate  # the cache's HiStateRuntime
        self._units = {UnitKind.BUNDLE: EvictionUnit.LEAF, UnitKind.CHECKPOINT: EvictionUnit.STATE}

    def begin(self, component_type: Any, layer: Any) -> None:
        self.histate.victims.begin_walk()

    def end(self, component_type: Any, layer: Any) -> None:
        self.histate.victims.end_walk()

    def next_victim(self, component_type: Any, layer: Any) -> Optional[tuple]:
        tier = Tier.GPU if layer == EvictLayer.DEVICE else Tier.CPU
        victim = _next_victim(self.histate, tier, _TAKES[(component_type, tier)])
        if victim is None:
            return None
        node, unit = victim
        return node.sg, self._units[unit]


class _HiStateWalks:
    """The walk protocol of SGLang components, answered by the cache's victim heaps (stock 0.5.23)."""

    def _evict_device_start(self, request_cnt: int) -> None:
        self._hs_request_cnt = request_cnt
        self.cache.histate.victims.begin_walk()

    def _evict_device_end(self) -> None:
        self._hs_request_cnt = 0
        self.cache.histate.victims.end_walk()

    def _next_victim(self, tier: Tier) -> Optional[tuple]:
        return _next_victim(self.cache.histate, tier, _TAKES[(self.component_type, tier)])

    def _next_device_victim(self, tracker: dict) -> Optional[tuple]:
        """The device walk's next victim; None once the walk freed what it was asked for."""
        if tracker[self.component_type] >= self._hs_request_cnt:
            return None
        return self._next_victim(Tier.GPU)

    def _tombstone_state(self, node: Any, layer: Any, tracker: dict, device_frees: dict, host_frees: dict,
                         cache_actions: list) -> None:
        """Drop `node`'s state copy on `layer` and keep the node and its KV, with SGLang's own primitives
        (its MAMBA walks' tombstone of an internal state)."""
        core = self.tree_core
        core._evict_component_and_detach_lru(node.sg, self, target=layer, tracker=tracker, device_frees=device_frees,
                                             host_frees=host_frees, cache_actions=cache_actions)
        core._cascade_evict(node.sg, self, tracker, device_frees=device_frees, host_frees=host_frees, target=layer,
                            cache_actions=cache_actions)

    def drive_host_eviction(self, num_tokens: int, tracker: dict, device_frees: dict, host_frees: dict,
                            cache_actions: list) -> None:
        """Free `num_tokens` of this component's host pool, lowest eq. 7 score first."""
        core = self.tree_core
        victims = self.cache.histate.victims
        victims.begin_walk()
        try:
            while tracker[self.component_type] < num_tokens:
                victim = self._next_victim(Tier.CPU)
                if victim is None:
                    return
                node, unit = victim
                if unit is UnitKind.BUNDLE:
                    core._evict_host_leaf(node.sg, tracker, device_frees, host_frees, cache_actions=cache_actions)
                    continue
                # A host checkpoint alone: tombstone the host state, keep everything else.
                self._tombstone_state(node, EvictLayer.HOST, tracker, device_frees, host_frees, cache_actions)
                core._update_evictable_leaf_sets(node.sg)
        finally:
            victims.end_walk()


class _FullWalks(_HiStateWalks):
    def _evict_device_next_node(self, tracker: dict, device_frees: dict, host_frees: dict,
                                cache_actions: list) -> Any:
        victim = self._next_device_victim(tracker)
        return None if victim is None else victim[0].sg.id


class _MambaWalks(_HiStateWalks):
    def _evict_device_next_node(self, tracker: dict, device_frees: dict, host_frees: dict,
                                cache_actions: list) -> Any:
        victim = self._next_device_victim(tracker)
        if victim is None:
            return None
        node, unit = victim
        if unit is UnitKind.BUNDLE:
            return node.sg.id  # SGLang evicts the leaf atomically (KV + terminal checkpoint)
        if write_back_moves_state(self.tree_core, node.sg, unit):
            # --hicache-write-policy write_back: the state has no host copy yet, so SGLang backs it up
            # first and tombstones it after the ack (`finish_mamba_state_eviction`), the request its own
            # walk makes (components/mamba.py:427-437).
            return InternalStateBackup(node_id=node.sg.id, num_tokens=1)
        # A checkpoint alone: tombstone the device state.
        self._tombstone_state(node, EvictLayer.DEVICE, tracker, device_frees, host_frees, cache_actions)
        return None


class _FullLockReoffer:
    """Stock 0.5.23 only: under upstream/series 0005 SGLang's lock reports the leaf it drops to the tree's
    observers (`HiStateTreeObserver.on_evictable_changed` re-offers it), so this mixin is not mixed in."""

    def acquire_component_lock(self, node: Any, result: Any, lock_host: bool = False) -> Any:
        """SGLang's FULL lock drops the locked path's device leaf from `evictable_device_leaves`
        directly (full.py:326), past the leaf-set hook. Re-offer that node so it is ranked as what it
        is now: nothing while locked, or a checkpoint when the request skipped its Mamba lock
        (SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK)."""
        leaf = None if lock_host else self._device_leaf_above(node)
        result = super().acquire_component_lock(node, result, lock_host)
        if leaf is not None:
            self.cache.histate.victims.touch(core_of(leaf))
        return result

    def _device_leaf_above(self, node: Any) -> Any:
        """The first node on the path up from `node` that holds KV on the device, if it is an
        evictable leaf (only it can be one: every node above it has a device child)."""
        core = self.tree_core
        while node is not core.root_node and node.component_data[self.component_type].value is None:
            node = node.parent
        return node if node in core.evictable_device_leaves else None


class _FullSessionRelease:
    """Stock 0.5.23 only: FULL's session-coverage walks report each node whose last session reference
    went to `HiStateTreeObserver.on_session_released` (it is re-offered: a referenced unit ranks after every
    unreferenced one, and once unreferenced its score drops below the key its heap entry may carry). Under
    upstream/series 0009 FULL reports them itself, so this mixin is not mixed in."""

    def _dec_session_coverage(self, session_id: str, leaf: Any) -> None:
        path = self._path_up(leaf, None)
        super()._dec_session_coverage(session_id, leaf)
        self._report_released(path)

    def _recede_session_coverage(self, session_id: str, leaf: Any, fallback: Any) -> None:
        path = self._path_up(leaf, fallback)
        super()._recede_session_coverage(session_id, leaf, fallback)
        self._report_released(path)

    def _path_up(self, leaf: Any, stop: Any) -> list:
        """The nodes FULL's session coverage walks (full.py:68-107): `leaf` up to `stop` or the root;
        each had a reference (SGLang asserts it), so those at 0 after the walk are the ones it released."""
        root, path = self.tree_core.root_node, []
        while leaf is not None and leaf is not stop and leaf is not root:
            path.append(leaf)
            leaf = leaf.parent
        return path

    def _report_released(self, nodes: list) -> None:
        observer = self.tree_core.observer
        for node in nodes:
            if observer is not None and node.component_data[self.component_type].session_ref == 0:
                observer.on_session_released(node, self.component_type)


class _MambaSessionRelease:
    """Stock 0.5.23 only: MAMBA's session release (close, timeout, the session moved on, the node was
    deleted; `_advance` / `_recede` go through `_dec_session_coverage`) reported to the observer. Under
    upstream/series 0009 MAMBA reports it itself."""

    def _dec_session_coverage(self, session_id: str, leaf: Any) -> None:
        super()._dec_session_coverage(session_id, leaf)
        observer = self.tree_core.observer
        if observer is not None and leaf.component_data[self.component_type].session_ref == 0:
            observer.on_session_released(leaf, self.component_type)


class _MambaInsertEvents:
    """Stock 0.5.23 only: the insert walk, its commit and a split, reported to `HiStateTreeObserver` from the
    MAMBA component's hooks on them. Under upstream/series 0007 the tree core reports them itself
    (`on_insert_path_node`, `on_insert_committed`, `on_node_split`), so this mixin is not mixed in."""

    def refresh_lru(self, phase: LRURefreshPhase, node: Any, root_node: Any) -> None:
        super().refresh_lru(phase, node, root_node)  # keeps SGLang's state LRU links consistent
        observer = self.tree_core.observer
        if observer is not None and phase is LRURefreshPhase.WALKDOWN and node is not root_node:
            observer.on_insert_path_node(node)

    def commit_insert_component_data(self, node: Any, is_new_leaf: bool, params: Any, result: Any,
                                     cache_actions: list) -> None:
        super().commit_insert_component_data(node, is_new_leaf, params, result, cache_actions)
        if self.tree_core.observer is not None:
            self.tree_core.observer.on_insert_committed(node, is_new_leaf, result)

    def redistribute_on_node_split(self, new_parent: Any, child: Any) -> None:
        super().redistribute_on_node_split(new_parent, child)
        if self.tree_core.observer is not None:
            self.tree_core.observer.on_node_split(new_parent, child)


_FULL_BASES = (*(() if OBSERVED_BY_SGLANG else (_FullLockReoffer,)), *(() if RANKED_BY_SGLANG else (_FullWalks,)),
               *(() if SESSION_EVENTS_BY_SGLANG else (_FullSessionRelease,)), FullComponent)
_MAMBA_BASES = (*(() if WALK_EVENTS_BY_SGLANG else (_MambaInsertEvents,)), *(() if RANKED_BY_SGLANG else (_MambaWalks,)),
                *(() if SESSION_EVENTS_BY_SGLANG else (_MambaSessionRelease,)), MambaComponent)


class HiStateFullComponent(*_FULL_BASES):
    """SGLang's FULL component; on stock 0.5.23 with the mixins above."""


class HiStateMambaComponent(*_MAMBA_BASES):
    def prepare_for_caching_req(self, req: Any, insert_params: Any, token_ids_len: int,
                                is_finished: bool) -> Optional[int]:
        """An extra checkpoint of a pass (capture.py) is inserted with its own slot and length; the
        request's own slots and tracked lengths are SGLang's business and stay untouched."""
        capture = self.cache._hs_inserting
        if capture is None:
            return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
        insert_params.mamba_value = capture.slot
        return capture.position

    def cleanup_after_caching_req(self, req: Any, is_finished: bool, insert_result: Any = None,
                                  insert_params: Any = None) -> None:
        capture = self.cache._hs_inserting
        if capture is None:
            super().cleanup_after_caching_req(req, is_finished, insert_result, insert_params)
        elif insert_result is None or insert_result.mamba_exist:  # not inserted, or the tree had that state
            self.cache.req_to_token_pool.mamba_allocator.free(capture.slot)

    def build_hicache_transfers(self, node: Any, phase: Any, **kwargs: Any) -> Any:
        """Under write_back a node's host backup carries its device state too (`_execute_and_commit_kv_backup`,
        unified_radix_cache.py:1685-1710), also when the device evicts a leaf. A state already on the SSD
        (state_writes.py) needs no host copy: it would take one of the host's few state slots, whose walk
        takes a host leaf whole, KV too. So the backup copies its KV alone, as the simulator's
        `histate-writeback` places it (checkpoints on the device and the SSD, never the host)."""
        from sglang.srt.mem_cache.unified_cache.components.base import CacheTransferPhase

        if phase == CacheTransferPhase.BACKUP_HOST and self.tree_core.is_write_back and core_of(node).ssd_state:
            return None
        return super().build_hicache_transfers(node, phase, **kwargs)

