"""SGLang's Python tree core plus the change feed HiState's victim heaps need.

Registered as tree-core backend "histate" (`register_tree_core_backend`, SGLang's registry for tree
cores) and selected per cache through `CacheInitParams.tree_core_backend`. It is the stock
`UnifiedTreeCore` plus notifications to the cache's `HiStateRuntime`; tree semantics are untouched:
  * every evictable-leaf-set update (insert, split, lock release, eviction, demote) and every
    duplicate-tracking update (the D->H / H->D acknowledgements that clear DMA marks): the node may have
    become, stopped being or changed eviction unit (`TierVictims.on_change`); a leaf-set update may also
    have made an SSD-homing candidate historical (`SsdTier.on_tree_change`);
  * a state materialised on the device (load-back): a new unit;
  * a node unlinked (`TierVictims.on_removed`, and the SSD tier forgets or orphans its objects);
  * reset.
"""
from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

from histate.core import Tier

from .core_nodes import core_of

BACKEND_NAME = "histate"


class HiStateTreeCore(UnifiedTreeCore):
    histate: Any = None  # the cache's HiStateRuntime, set by HiStateRadixCache after construction

    def _update_evictable_leaf_sets(self, node: Any) -> None:
        super()._update_evictable_leaf_sets(node)
        if self.histate is not None:
            core = core_of(node)
            self.histate.victims.on_change(core)
            if self.histate.ssd_tier is not None:
                self.histate.ssd_tier.on_tree_change(core)

    def _update_duplicate_tracking(self, node: Any) -> None:
        super()._update_duplicate_tracking(node)
        if self.histate is not None and node is not self.root_node:
            self.histate.victims.on_change(core_of(node))

    def set_component_device_value(self, node_id: Any, component_type: Any, value: Any) -> None:
        """An auxiliary component's device value materialised (MAMBA is the only one here: an insert's
        commit on an existing node, or a load-back). A historical state loaded back for a request goes
        back to SSD-only once unused (ssd_tier.py)."""
        super().set_component_device_value(node_id, component_type, value)
        if self.histate is not None:
            node = core_of(self.node_by_id(node_id))
            self.histate.victims.on_change(node)
            if self.histate.ssd_tier is not None:
                self.histate.ssd_tier.note_state_copy(node)

    def commit_load_back(self, node_id: Any, device_indices: Any, kv_xfer: Any, comp_xfers: Any) -> Any:
        """KV loaded back from the host: a new stay on the device (T_KV starts again) and bytes into it
        (Little's law), as the core's `Placement.promote_kv` counts a promotion. A state loaded back is
        the restore of one checkpoint for the request, which the core does not count as an arrival
        either: its node copy goes back to SSD-only once the request moved on (ssd_tier.py)."""
        actions = super().commit_load_back(node_id, device_indices, kv_xfer, comp_xfers)
        if self.histate is not None:
            now_s, kv_bytes_per_token = self.histate.now(), self.histate.core_config.kv_bytes_per_token
            for loaded_id in kv_xfer.nodes_to_load or ():
                node = self.node_by_id(loaded_id)
                core_of(node).kv_created_s = now_s
                self.histate.bytes_in(Tier.GPU, len(node.key) * kv_bytes_per_token)
        return actions

    def attach_host_state(self, node: Any, host_slot: Any) -> None:
        """A state restored from SSD becomes the node's host copy, placed as SGLang's own L3 prefetch
        places one (`MambaComponent.commit_hicache_transfer` PREFETCH, components/mamba.py:1000-1004)."""
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        data = node.component_data[ComponentType.MAMBA]
        data.host_value = host_slot.clone()
        if data.value is None:
            host_lru = self.host_lru_lists[ComponentType.MAMBA]
            if not host_lru.in_list(node):
                host_lru.insert_mru(node)
        self._update_evictable_leaf_sets(node)

    def _unregister_node(self, node: Any) -> None:
        super()._unregister_node(node)
        if self.histate is not None:
            self.histate.on_node_removed(core_of(node))

    def reset(self) -> None:
        if self.histate is not None and self.histate.ssd_tier is not None:
            self.histate.ssd_tier.on_tree_reset([core_of(n) for n in self._node_arena.values() if n is not self.root_node])
        super().reset()
        if self.histate is not None:
            self.histate.victims.reset()
            self.histate.attach_tree(self.root_node)  # holds of the old tree went with it


def _factory(params: Any, components: Any) -> HiStateTreeCore:
    return HiStateTreeCore(params, components)


def register_tree_core() -> None:
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
        register_tree_core_backend,
        registered_tree_core_backends,
    )

    if BACKEND_NAME not in registered_tree_core_backends():
        register_tree_core_backend(BACKEND_NAME, _factory)
