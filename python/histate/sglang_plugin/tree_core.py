"""SGLang's Python tree core with change notifications for HiState's eviction ranker.

Registered as tree-core backend "histate" (`register_tree_core_backend`, SGLang's registry for
tree cores) and selected per cache through `CacheInitParams.tree_core_backend`. It is the stock
`UnifiedTreeCore` plus four notifications: every evictable-leaf-set update (insert, split, lock
release, eviction: whenever a node may have become or stopped being an eviction unit), a state
materialised on the device (load-back), node removal, and reset. Tree semantics are untouched.
"""
from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

BACKEND_NAME = "histate"


class HiStateTreeCore(UnifiedTreeCore):
    histate_ranker: Any = None  # set by HiStateRadixCache after construction

    def _update_evictable_leaf_sets(self, node: Any) -> None:
        ranker = self.histate_ranker
        if ranker is None:
            super()._update_evictable_leaf_sets(node)
            return
        before = ranker.unit_of(node)
        super()._update_evictable_leaf_sets(node)
        if ranker.unit_of(node) is not before:  # became, stopped being or changed eviction unit
            ranker.touch(node)

    def set_component_device_value(self, node_id: Any, component_type: Any, value: Any) -> None:
        super().set_component_device_value(node_id, component_type, value)
        if self.histate_ranker is not None:  # a state (re)appeared on the device: a new unit
            self.histate_ranker.touch(self.node_by_id(node_id))

    def _unregister_node(self, node: Any) -> None:
        super()._unregister_node(node)
        node._hs_dead = True

    def reset(self) -> None:
        super().reset()
        if self.histate_ranker is not None:
            self.histate_ranker.reset()


def _factory(params: Any, components: Any) -> HiStateTreeCore:
    return HiStateTreeCore(params, components)


def register_tree_core() -> None:
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
        register_tree_core_backend,
        registered_tree_core_backends,
    )

    if BACKEND_NAME not in registered_tree_core_backends():
        register_tree_core_backend(BACKEND_NAME, _factory)
