"""The test that ships with upstream/series 0006 ([mem_cache] a pluggable eviction ranker for the unified walks).

Written as it would sit in SGLang's own test tree (no HiState import): on SGLang's own unified-radix-cache
test kit (Full + Mamba, Python tree core, on CPU here), a toy ranker with an order SGLang does not have
(the deepest leaf first; a named internal state) drives the walks, and the test checks what left the tree
against what that order says, independently of the walk code.
"""
from __future__ import annotations

from array import array
from unittest import mock

import pytest

from _full_mamba_kit import build_kit, turn
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer
from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import (
    EvictionRanker,
    EvictionUnit,
    UnifiedTreeCoreInterface,
)


def _depth_tokens(node) -> int:
    depth = 0
    while node is not None and node.parent is not None:
        depth += len(node.key)
        node = node.parent
    return depth


class DeepestFirst(EvictionRanker):
    """Device leaves, deepest first; `states`: internal nodes whose state a MAMBA walk takes first."""

    def __init__(self, core, states=()):
        self.core, self.states, self.walks, self.taken = core, list(states), [], []

    def begin(self, component_type, layer):
        self.walks.append(("begin", component_type, layer))

    def next_victim(self, component_type, layer):
        if component_type is ComponentType.MAMBA and self.states:
            node = self.states.pop(0)
            self.taken.append((node.id, "STATE"))
            return node, EvictionUnit.STATE
        leaves = self.core.evictable_device_leaves if layer == EvictLayer.DEVICE else self.core.evictable_host_leaves
        if not leaves:
            return None
        node = max(leaves, key=lambda n: (_depth_tokens(n), n.id))
        self.taken.append((node.id, "LEAF"))
        return node, EvictionUnit.LEAF

    def end(self, component_type, layer):
        self.walks.append(("end", component_type, layer))


@pytest.fixture
def kit():
    kit = build_kit(mamba_slots=8, kv_tokens=512)
    return kit


def _cached_tokens(kit, tokens) -> int:
    return kit.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).device_prefix_len


def test_the_device_walk_takes_the_rankers_leaf_not_its_own_lru(kit):
    page = kit.cfg.page_size
    prompts = [[t] * (n * page) for t, n in ((1, 2), (2, 6), (3, 4))]  # oldest is the shortest
    for tokens in prompts:
        turn(kit, tokens)
    ranker = DeepestFirst(kit.cache.tree_core)
    kit.cache.tree_core.set_eviction_ranker(ranker)
    kit.cache.evict(EvictParams(num_tokens=page))
    assert [unit for _, unit in ranker.taken] == ["LEAF"]
    assert _cached_tokens(kit, prompts[1]) == 0  # the deepest went, not the least recently used
    assert _cached_tokens(kit, prompts[0]) == 2 * page and _cached_tokens(kit, prompts[2]) == 4 * page
    assert ("begin", ComponentType.FULL, EvictLayer.DEVICE) in ranker.walks
    assert ranker.walks.count(("end", ComponentType.FULL, EvictLayer.DEVICE)) == \
        ranker.walks.count(("begin", ComponentType.FULL, EvictLayer.DEVICE))


def test_without_a_ranker_the_walk_keeps_its_own_order(kit):
    page = kit.cfg.page_size
    prompts = [[t] * (n * page) for t, n in ((1, 2), (2, 6), (3, 4))]
    for tokens in prompts:
        turn(kit, tokens)
    kit.cache.evict(EvictParams(num_tokens=page))
    assert _cached_tokens(kit, prompts[0]) == 0 and _cached_tokens(kit, prompts[1]) == 6 * page  # LRU


def test_a_mamba_walk_tombstones_the_state_the_ranker_names_and_keeps_the_node(kit):
    page = kit.cfg.page_size
    base = [7] * (4 * page)
    turn(kit, base)
    turn(kit, base[: 2 * page] + [8] * (2 * page))  # splits `base` after two pages
    turn(kit, base[: 2 * page])  # stores a state on the split node
    core = kit.cache.tree_core
    split = next(n for n in core._node_arena.values()
                 if n is not core.root_node and _depth_tokens(n) == 2 * page)
    assert split.component_data[ComponentType.MAMBA].value is not None and split.children
    ranker = DeepestFirst(core, states=[split])
    core.set_eviction_ranker(ranker)
    kit.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    assert ranker.taken == [(split.id, "STATE")]
    assert split.id in core._node_arena  # a tombstone: the node and its KV stay
    assert split.component_data[ComponentType.MAMBA].value is None
    assert split.component_data[ComponentType.FULL].value is not None
    assert _cached_tokens(kit, base) == 4 * page


def test_a_victim_the_walk_cannot_take_is_refused_before_anything_changes(kit):
    page = kit.cfg.page_size
    turn(kit, [1] * (2 * page))
    core = kit.cache.tree_core
    leaf = next(iter(core.evictable_device_leaves))
    parent_chain_internal = core.root_node

    class Wrong(EvictionRanker):
        def next_victim(self, component_type, layer):
            return parent_chain_internal, EvictionUnit.LEAF

    core.set_eviction_ranker(Wrong())
    arena = set(core._node_arena)
    with pytest.raises(RuntimeError, match=r"eviction ranker Wrong returned node \d+ as LEAF for the FULL DEVICE "
                                           r"walk, which can only take an evictable device leaf"):
        kit.cache.evict(EvictParams(num_tokens=page))
    assert set(core._node_arena) == arena and leaf in core.evictable_device_leaves


def test_the_ranker_is_refused_where_it_cannot_be_honoured(kit):
    from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore

    core = kit.cache.tree_core
    for component in core.components:
        component.is_evict_device_ongoing = True
    with pytest.raises(RuntimeError, match="during an eviction walk"):
        core.set_eviction_ranker(DeepestFirst(core))
    for component in core.components:
        component.is_evict_device_ongoing = False
    assert RustUnifiedTreeCore.set_eviction_ranker is UnifiedTreeCoreInterface.set_eviction_ranker
    with pytest.raises(NotImplementedError, match="does not support an eviction ranker"):
        UnifiedTreeCoreInterface.set_eviction_ranker(object.__new__(RustUnifiedTreeCore), DeepestFirst(core))
    with mock.patch.object(core, "component_types", (*core.component_types, ComponentType.SWA)):
        with pytest.raises(ValueError, match="orders FULL and MAMBA walks only"):
            core.set_eviction_ranker(DeepestFirst(core))
