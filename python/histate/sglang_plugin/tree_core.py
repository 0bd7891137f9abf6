"""SGLang's Python tree core plus the change feed HiState's victim heaps need.

Registered as tree-core backend "histate" (`register_tree_core_backend`, SGLang's registry for tree
cores) and selected per cache through `CacheInitParams.tree_core_backend`. It is the stock
`UnifiedTreeCore`; tree semantics are untouched. What HiState does when the tree changes is
`HiStateTreeObserver`:
  * every evictable-leaf-set update (insert, split, lock release, eviction, demote) and every
    duplicate-tracking update (the D->H / H->D acknowledgements that clear DMA marks): the node may have
    become, stopped being or changed eviction unit (`TierVictims.on_change`); a leaf-set update may also
    have made an SSD-homing candidate historical (`SsdTier.on_tree_change`);
  * a state materialised on the device (load-back): a new unit;
  * KV loaded back from the host: a new stay on the device;
  * a node unlinked (`TierVictims.on_removed`, and the SSD tier forgets or orphans its objects);
  * reset;
  * an insert's walk through existing nodes (their KV used now), its commit (a new node or checkpoint
    stamped and its neighbours re-offered), a split (the head inherits the stamps), and a match (the
    cache's `on_prefix_matched`: refresh and learn, `runtime.on_match`).
On a SGLang whose tree core reports its changes (upstream/series 0005, `UnifiedTreeCore.add_observer`)
the observer is registered with it; on stock 0.5.23 `HiStateTreeCore` overrides the six private
mutators that make those changes and calls the same observer. The walk events come from SGLang too under
upstream/series 0007; on stock from MAMBA's insert and split hooks (components.py) and the cache's
`_match_tree` (tree_cache.py).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from sglang.srt.mem_cache.unified_cache import unified_tree_core_interface
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

from histate.core import Tier

from .core_nodes import core_of

BACKEND_NAME = "histate"


OBSERVED_BY_SGLANG = hasattr(UnifiedTreeCore, "add_observer")
"""upstream/series 0005 applied: the tree core calls observers itself (no private override here)."""

WALK_EVENTS_BY_SGLANG = hasattr(getattr(unified_tree_core_interface, "TreeCoreObserver", None), "on_insert_committed")
"""upstream/series 0007 applied: the tree core reports an insert's path, its commit and a split, and the cache
a match (no MAMBA hook or match override here)."""

HOST_VALUE_BY_SGLANG = hasattr(UnifiedTreeCore, "set_component_host_value")
"""upstream/series 0010 applied: the tree core places a restored host value itself (`set_component_host_value`)."""

SESSION_EVENTS_BY_SGLANG = hasattr(getattr(unified_tree_core_interface, "TreeCoreObserver", None),
                                   "on_session_released")
"""upstream/series 0009 applied: FULL's and MAMBA's session-coverage walks report a released node (no
session override here)."""

LEAF_STATE_BACKUP_BY_SGLANG = hasattr(UnifiedTreeCore, "_holds_state_host_lacks")
"""upstream/series 0016 applied: under write_back SGLang backs up a backed-up device leaf's state the host
lacks before it demotes the leaf (no backup asked by HiState's walks here: `HiStateRuntime.use_write_back`)."""


class HiStateTreeObserver:
    """The victim heaps' and the SSD tier's change feed (the methods of SGLang's `TreeCoreObserver`)."""

    def __init__(self, histate: Any, tree_core: Any, on_matched: Optional[Callable[[Any, Any], None]] = None):
        self.histate = histate  # the cache's HiStateRuntime
        self.tree_core = tree_core
        self.on_matched = on_matched  # the cache's match handling (HiStateRadixCache.on_prefix_matched)

    def on_evictable_changed(self, node: Any) -> None:
        core = core_of(node)
        self.histate.victims.on_change(core)
        if self.histate.ssd_tier is not None:
            self.histate.ssd_tier.on_tree_change(core)

    def on_duplicate_tracking_changed(self, node: Any) -> None:
        if node is not self.tree_core.root_node:
            self.histate.victims.on_change(core_of(node))

    def on_component_materialized(self, node: Any, component_type: Any) -> None:
        """An auxiliary component's device value materialised (MAMBA is the only one here: an insert's
        commit on an existing node, or a load-back). A historical state loaded back for a request goes
        back to SSD-only once unused (ssd_tier.py)."""
        core = core_of(node)
        self.histate.victims.on_change(core)
        if self.histate.ssd_tier is not None:
            self.histate.ssd_tier.note_state_copy(core)

    def on_load_back(self, node: Any, loaded_node_ids: Any) -> None:
        """KV loaded back from the host: a new stay on the device (T_KV starts again) and bytes into it
        (Little's law), as the core's `Placement.promote_kv` counts a promotion. A state loaded back is
        the restore of one checkpoint for the request, which the core does not count as an arrival
        either: its node copy goes back to SSD-only once the request moved on (ssd_tier.py)."""
        now_s, kv_bytes_per_token = self.histate.now(), self.histate.core_config.kv_bytes_per_token
        for loaded_id in loaded_node_ids:
            loaded = self.tree_core.node_by_id(loaded_id)
            core_of(loaded).kv_created_s = now_s
            self.histate.bytes_in(Tier.GPU, len(loaded.key) * kv_bytes_per_token)

    def on_node_removed(self, node: Any) -> None:
        self.histate.on_node_removed(core_of(node))

    def on_before_reset(self, nodes: Any) -> None:
        if self.histate.ssd_tier is not None:
            self.histate.ssd_tier.on_tree_reset([core_of(n) for n in nodes])

    def on_reset(self, root: Any) -> None:
        self.histate.victims.reset()
        self.histate.attach_tree(root)  # holds of the old tree went with it

    def on_insert_path_node(self, node: Any) -> None:
        """An insert walked through an existing node: its KV was used now (the core's `_insert_kv`)."""
        core_of(node).kv_access_s = self.histate.now()

    def on_insert_committed(self, node: Any, is_new_leaf: bool, result: Any) -> None:
        """An insert ended at `node` with its state: a new node and a new checkpoint are stamped, counted
        in (Little's law) and their neighbours re-offered; a state already there is refreshed (the core's
        `_add_checkpoint`)."""
        runtime = self.histate
        now_s = runtime.now()
        core = core_of(node)
        if is_new_leaf:
            runtime.new_node(core, now_s)
            runtime.bytes_in(Tier.GPU, len(node.key) * runtime.core_config.kv_bytes_per_token)
        if result.mamba_exist:
            core.ckpt_access_s = now_s
        else:
            runtime.new_checkpoint(core, now_s)
            runtime.bytes_in(Tier.GPU, runtime.core_config.checkpoint_size_bytes)

    def on_node_split(self, new_parent: Any, child: Any) -> None:
        """The split head inherits the KV stamps and KV tiers; the checkpoint stays at the tail's end (the
        core's `RadixTree.split`); a hold covering the tail covers its head."""
        head, tail = core_of(new_parent), core_of(child)
        head.kv_access_s, head.kv_created_s, head.ssd_kv = tail.kv_access_s, tail.kv_created_s, tail.ssd_kv
        head.ckpt_access_s = head.ckpt_created_s = tail.kv_access_s
        head.session_ref = tail.session_ref

    def on_prefix_matched(self, params: Any, result: Any) -> None:
        if self.on_matched is not None:
            self.on_matched(params, result)

    def on_session_released(self, node: Any, component_type: Any) -> None:
        """No session references the node's KV (FULL) or state (MAMBA) any more: re-offer it (a referenced
        unit ranks after every unreferenced one; its heap entry may carry that higher key)."""
        self.histate.victims.touch(core_of(node))


class HiStateTreeCore(UnifiedTreeCore):
    observer: Any = None  # HiStateTreeObserver, set by HiStateRadixCache after construction

    def attach_observer(self, observer: HiStateTreeObserver) -> None:
        self.observer = observer
        if OBSERVED_BY_SGLANG:
            self.add_observer(observer)

    if not HOST_VALUE_BY_SGLANG:  # stock 0.5.23: upstream/series 0010's primitive, on this core only

        def set_component_host_value(self, node_id: Any, component_type: Any, value: Any) -> None:
            """A state restored from SSD becomes the node's host copy, placed as SGLang's own L3 prefetch
            places one (`MambaComponent.commit_hicache_transfer` PREFETCH, components/mamba.py:1083-1087)."""
            node = self.node_by_id(node_id)
            data = node.component_data[component_type]
            assert data.host_value is None, "the node already holds a host value"
            data.host_value = value
            if data.value is None:
                host_lru = self.host_lru_lists[component_type]
                if not host_lru.in_list(node):
                    host_lru.insert_mru(node)
            self._update_evictable_leaf_sets(node)

    if not OBSERVED_BY_SGLANG:  # stock 0.5.23: the mutators that change the tree, overridden to feed it

        def _update_evictable_leaf_sets(self, node: Any) -> None:
            super()._update_evictable_leaf_sets(node)
            if self.observer is not None:
                self.observer.on_evictable_changed(node)

        def _update_duplicate_tracking(self, node: Any) -> None:
            super()._update_duplicate_tracking(node)
            if self.observer is not None:
                self.observer.on_duplicate_tracking_changed(node)

        def set_component_device_value(self, node_id: Any, component_type: Any, value: Any) -> None:
            super().set_component_device_value(node_id, component_type, value)
            if self.observer is not None:
                self.observer.on_component_materialized(self.node_by_id(node_id), component_type)

        def commit_load_back(self, node_id: Any, device_indices: Any, kv_xfer: Any, comp_xfers: Any) -> Any:
            actions = super().commit_load_back(node_id, device_indices, kv_xfer, comp_xfers)
            if self.observer is not None:
                self.observer.on_load_back(self.node_by_id(node_id), tuple(kv_xfer.nodes_to_load or ()))
            return actions

        def _unregister_node(self, node: Any) -> None:
            super()._unregister_node(node)
            if self.observer is not None:
                self.observer.on_node_removed(node)

        def reset(self) -> None:
            if self.observer is not None:
                self.observer.on_before_reset([n for n in self._node_arena.values() if n is not self.root_node])
            super().reset()
            if self.observer is not None:
                self.observer.on_reset(self.root_node)


def _factory(params: Any, components: Any) -> HiStateTreeCore:
    return HiStateTreeCore(params, components)


def register_tree_core() -> None:
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
        register_tree_core_backend,
        registered_tree_core_backends,
    )

    if BACKEND_NAME not in registered_tree_core_backends():
        register_tree_core_backend(BACKEND_NAME, _factory)
