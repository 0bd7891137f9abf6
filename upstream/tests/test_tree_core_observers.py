"""The test that ships with upstream/series 0005 ([mem_cache] tree-core observers).

Written as it would sit in SGLang's own test tree (no HiState import): SGLang's own unified-radix-cache
test kit builds a stock cache (Full + Mamba, Python tree core, on CPU here) and an observer keeps a mirror
of the core's evictable-leaf sets and node arena from the callbacks alone. After every operation the
mirror must equal the core: a change the core makes without telling its observers leaves them different.
"""
from __future__ import annotations

import pytest

from _full_mamba_kit import build_kit, build_python_core_cache, turn
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import (
    TreeCoreObserver,
    UnifiedTreeCoreInterface,
)


class Mirror(TreeCoreObserver):
    """What an eviction ranker would keep: the evictable nodes, and the nodes alive, from callbacks only."""

    def __init__(self, core):
        self.core = core
        self.device_leaves, self.host_leaves, self.alive = set(), set(), set()
        self.removed, self.materialized, self.loaded_back, self.resets = [], [], [], []

    def on_evictable_changed(self, node):
        self.alive.add(node.id)
        for mirror, live in ((self.device_leaves, self.core.evictable_device_leaves),
                             (self.host_leaves, self.core.evictable_host_leaves)):
            (mirror.add if node in live else mirror.discard)(node.id)

    def on_component_materialized(self, node, component_type):
        self.materialized.append((node.id, component_type))

    def on_load_back(self, node, loaded_node_ids):
        self.loaded_back.append(tuple(loaded_node_ids))

    def on_node_removed(self, node):
        self.removed.append(node.id)
        self.alive.discard(node.id)
        self.device_leaves.discard(node.id)
        self.host_leaves.discard(node.id)

    def on_before_reset(self, nodes):
        self.resets.append(("before", sorted(n.id for n in nodes)))

    def on_reset(self, root):
        self.resets.append(("after", root.id))
        self.device_leaves, self.host_leaves, self.alive = set(), set(), set()

    def check(self):
        core = self.core
        assert self.device_leaves == {n.id for n in core.evictable_device_leaves}
        assert self.host_leaves == {n.id for n in core.evictable_host_leaves}
        live = {nid for nid, n in core._node_arena.items() if n is not core.root_node}
        assert self.alive - {core.root_node.id} <= live  # nothing removed without a callback


@pytest.fixture
def kit():
    kit = build_kit(mamba_slots=6, kv_tokens=256)
    kit.mirror = Mirror(kit.cache.tree_core)
    kit.cache.tree_core.add_observer(kit.mirror)
    return kit


def test_every_leaf_set_change_and_removal_reaches_the_observer(kit):
    page = kit.cfg.page_size
    prompts = [[t] * (4 * page) for t in range(1, 4)]
    prompts.append(prompts[0][: 2 * page] + [99] * (2 * page))  # splits the first path
    for tokens in prompts:
        turn(kit, tokens)
        kit.mirror.check()
    assert kit.mirror.device_leaves
    turn(kit, prompts[0][: 2 * page])  # ends at the split node, which has KV and no state: stored on it
    kit.mirror.check()
    assert kit.mirror.materialized
    arena_before = set(kit.cache.tree_core._node_arena)
    kit.cache.evict(EvictParams(num_tokens=8 * page, mamba_num=2))
    kit.mirror.check()
    gone = arena_before - set(kit.cache.tree_core._node_arena)
    assert gone and gone <= set(kit.mirror.removed)  # every node that left the tree was reported
    for tokens in prompts:  # back into a tree that lost some of them
        turn(kit, tokens)
        kit.mirror.check()


def test_reset_reports_the_old_tree_then_the_new_root(kit):
    turn(kit, [5] * (4 * kit.cfg.page_size))
    core = kit.cache.tree_core
    old = sorted(nid for nid, n in core._node_arena.items() if n is not core.root_node)
    kit.cache.reset()
    assert kit.mirror.resets[-2:] == [("before", old), ("after", core.root_node.id)]
    kit.mirror.check()


def test_a_core_that_cannot_report_changes_refuses_an_observer():
    from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore

    assert RustUnifiedTreeCore.add_observer is UnifiedTreeCoreInterface.add_observer
    with pytest.raises(NotImplementedError, match="does not report tree changes"):
        UnifiedTreeCoreInterface.add_observer(object.__new__(RustUnifiedTreeCore), TreeCoreObserver())


def test_without_observers_the_core_keeps_none(kit):
    fresh = type(kit.cache.tree_core).__new__(type(kit.cache.tree_core))
    assert not hasattr(fresh, "_observers")  # built in __init__, empty unless add_observer is called
    cache = build_python_core_cache(kit)
    assert cache.tree_core._observers == []


def test_a_lock_that_takes_a_leaf_out_of_the_evictable_set_is_reported(kit):
    """FULL's lock walks up from the request's node and drops the first device-resident node from the
    evictable leaf set itself (not through the leaf-set update). When the request's own node has no device
    KV (its KV went to the host), that node is another one, which observers must hear about too."""
    from sglang.srt.mem_cache.base_prefix_cache import IncLockRefResult
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    page = kit.cfg.page_size
    turn(kit, [1] * (4 * page))
    turn(kit, [1] * (2 * page))  # splits: parent (2 pages) -> child (2 pages)
    core = kit.cache.tree_core
    parent = next(n for n in core._node_arena.values() if n is not core.root_node and n.children)
    child = next(iter(parent.children.values()))
    child.component_data[ComponentType.FULL].value = None  # as if its KV had been evicted to the host
    core._update_evictable_leaf_sets(parent)
    assert parent in core.evictable_device_leaves
    kit.mirror.check()
    core.components_by_type[ComponentType.FULL].acquire_component_lock(child, IncLockRefResult(node_id=child.id))
    assert parent not in core.evictable_device_leaves
    kit.mirror.check()
